package bootserver_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/bootserver"
	"github.com/kilnhq/kiln/imagebuilder/bootmedia"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

const caHash = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

// issuer mints numbered tokens and can be told to fail.
type issuer struct {
	mu    sync.Mutex
	n     int
	err   error
	token string // returned as is when set
	hosts []string
}

func (i *issuer) BootToken(_ context.Context, host string) (string, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.err != nil {
		return "", i.err
	}
	i.n++
	i.hosts = append(i.hosts, host)
	if i.token != "" {
		return i.token, nil
	}
	return fmt.Sprintf("abc%03d.secret%013d", i.n, i.n), nil
}

func (i *issuer) count() int {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.n
}

// media writes fake boot media with a manifest and returns its directory.
func media(t *testing.T) (string, map[string][]byte) {
	dir := t.TempDir()
	files := map[string][]byte{
		bootmedia.KernelFile: bytes.Repeat([]byte("K"), 5000),
		bootmedia.InitrdFile: []byte(strings.Repeat("0123456789", 1000)),
	}
	m := bootmedia.Manifest{}
	for name, b := range files {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), b, 0o644))
		sum := sha256.Sum256(b)
		m.Files = append(m.Files, bootmedia.File{Name: name, Size: int64(len(b)), SHA256: hex.EncodeToString(sum[:])})
	}
	mb, err := json.Marshal(m)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, bootmedia.ManifestFile), mb, 0o644))
	return dir, files
}

func newServer(t *testing.T, o bootserver.Options) (*bootserver.Server, *httptest.Server) {
	t.Helper()
	if o.ControllerAddr == "" {
		o.ControllerAddr = "10.0.0.1:7443"
	}
	if o.CAHash == "" {
		o.CAHash = caHash
	}
	s, err := bootserver.New(o)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	ts := httptest.NewServer(s)
	t.Cleanup(ts.Close)
	return s, ts
}

func get(t *testing.T, url string, header ...string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp, b
}

func TestFilesRangeAndDigest(t *testing.T) {
	dir, files := media(t)
	images := t.TempDir()
	img := bytes.Repeat([]byte{1, 2, 3, 4, 5, 6, 7}, 3000)
	require.NoError(t, os.WriteFile(filepath.Join(images, "debian12.raw.zst"), img, 0o644))
	_, ts := newServer(t, bootserver.Options{MediaDir: dir, ImagesDir: images, Tokens: &issuer{}})

	initrd := files[bootmedia.InitrdFile]
	sum := sha256.Sum256(initrd)
	imgSum := sha256.Sum256(img)
	for _, tc := range []struct {
		path, rng string
		status    int
		body      []byte
		sum       [32]byte
	}{
		{"/boot/files/initrd.img", "", http.StatusOK, initrd, sum},
		{"/boot/files/initrd.img", "bytes=100-199", http.StatusPartialContent, initrd[100:200], sum},
		{"/boot/files/initrd.img", "bytes=9990-", http.StatusPartialContent, initrd[9990:], sum},
		{"/boot/files/initrd.img", "bytes=-5", http.StatusPartialContent, initrd[len(initrd)-5:], sum},
		{"/images/debian12.raw.zst", "bytes=7-13", http.StatusPartialContent, img[7:14], imgSum},
	} {
		resp, body := get(t, ts.URL+tc.path, "Range", tc.rng)
		if resp.StatusCode != tc.status || !bytes.Equal(body, tc.body) {
			t.Errorf("GET %s Range %q = %d, %d bytes, want %d, %d bytes", tc.path, tc.rng, resp.StatusCode, len(body), tc.status, len(tc.body))
		}
		if got, want := resp.Header.Get("X-Kiln-Sha256"), hex.EncodeToString(tc.sum[:]); got != want {
			t.Errorf("GET %s X-Kiln-Sha256 = %q, want %q", tc.path, got, want)
		}
		if got, want := resp.Header.Get("Digest"), "sha-256="+base64.StdEncoding.EncodeToString(tc.sum[:]); got != want {
			t.Errorf("GET %s Digest = %q, want %q", tc.path, got, want)
		}
	}

	// Found by FuzzBootServer: net/http answered the last 0 bytes with 206
	// and Content-Range "bytes 10000-9999/10000".
	for _, rng := range []string{"bytes=-0", "bytes=- 0", "bytes=0-1, -00"} {
		if resp, body := get(t, ts.URL+"/boot/files/initrd.img", "Range", rng); resp.StatusCode != http.StatusRequestedRangeNotSatisfiable ||
			resp.Header.Get("Content-Range") != fmt.Sprintf("bytes */%d", len(initrd)) {
			t.Errorf("GET Range %q = %d, Content-Range %q, %q; want 416, bytes */%d", rng, resp.StatusCode, resp.Header.Get("Content-Range"), body, len(initrd))
		}
	}

	// Resuming with If-Range against a changed file restarts from 0.
	resp, _ := get(t, ts.URL+"/boot/files/initrd.img")
	resp2, body := get(t, ts.URL+"/boot/files/initrd.img", "Range", "bytes=10-", "If-Range", resp.Header.Get("Last-Modified"))
	if resp2.StatusCode != http.StatusPartialContent || len(body) != len(initrd)-10 {
		t.Errorf("GET with a matching If-Range = %d (%d bytes), want 206 (%d bytes)", resp2.StatusCode, len(body), len(initrd)-10)
	}

	// Found by FuzzBootServer: a symlink out of the images directory was
	// followed (issue 12, hole 6).
	outside := filepath.Join(t.TempDir(), "secret")
	require.NoError(t, os.WriteFile(outside, []byte("outside"), 0o600))
	require.NoError(t, os.Symlink(outside, filepath.Join(images, "escape.raw")))
	if resp, body := get(t, ts.URL+"/images/escape.raw"); resp.StatusCode != http.StatusNotFound {
		t.Errorf("GET /images/escape.raw (a symlink out of the directory) = %d %q, want 404", resp.StatusCode, body)
	}

	for _, p := range []string{"/boot/files/missing", "/boot/files/..%2fbootmedia.json", "/boot/files/.hidden", "/images/", "/boot/files/"} {
		if resp, _ := get(t, ts.URL+p); resp.StatusCode != http.StatusNotFound {
			t.Errorf("GET %s = %d, want 404", p, resp.StatusCode)
		}
	}
}

func TestIPXEScript(t *testing.T) {
	dir, _ := media(t)
	var logs bytes.Buffer
	iss := &issuer{}
	_, ts := newServer(t, bootserver.Options{
		MediaDir: dir, Tokens: iss, ControllerAddr: "10.77.0.1:7443",
		Log: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	resp, body := get(t, ts.URL+"/boot/ipxe/rack1-07")
	require.Equal(t, http.StatusOK, resp.StatusCode, string(body))
	script := string(body)
	tok := "abc001.secret0000000000001"
	kernelLine := ""
	for _, l := range strings.Split(script, "\n") {
		if strings.HasPrefix(l, "kernel ") {
			kernelLine = l
		}
	}
	for _, want := range []string{
		"kernel " + ts.URL + "/boot/files/vmlinuz initrd=initrd.img ",
		" kiln.boot=pxe ", " kiln.controller=10.77.0.1:7443 ", " kiln.token=" + tok + " ",
		" kiln.ca_hash=" + caHash + " ", " kiln.host=rack1-07 ", " console=ttyS0,115200 ", " BOOTIF=01-${mac:hexhyp}",
	} {
		if !strings.Contains(kernelLine, want) {
			t.Errorf("iPXE kernel line %q lacks %q", kernelLine, want)
		}
	}
	if !strings.HasPrefix(script, "#!ipxe\n") || !strings.Contains(script, "\ninitrd "+ts.URL+"/boot/files/initrd.img\nboot\n") {
		t.Errorf("iPXE script =\n%s\nwant #!ipxe, initrd and boot lines", script)
	}
	if cc := resp.Header.Get("Cache-Control"); cc != "no-store" {
		t.Errorf("Cache-Control = %q, want no-store (the script holds a token)", cc)
	}
	if iss.hosts[0] != "rack1-07" {
		t.Errorf("token minted for %q, want rack1-07", iss.hosts[0])
	}
	// A second fetch mints a second one-time token.
	_, body = get(t, ts.URL+"/boot/ipxe/rack1-07")
	if !strings.Contains(string(body), "kiln.token=abc002.") {
		t.Errorf("second script does not carry a new token:\n%s", body)
	}
	if !strings.Contains(logs.String(), "rack1-07") {
		t.Errorf("boot request not logged: %q", logs.String())
	}
	if strings.Contains(logs.String(), "secret") || strings.Contains(logs.String(), "abc001") {
		t.Errorf("log holds the token:\n%s", logs.String())
	}
}

func TestIPXEScriptErrors(t *testing.T) {
	dir, _ := media(t)
	for _, tc := range []struct {
		name   string
		host   string
		iss    *issuer
		status int
	}{
		{"unknown host", "nohost", &issuer{err: errdefs.NotFound("host %q not found", "nohost")}, http.StatusNotFound},
		{"host not bootable", "vm1", &issuer{err: errdefs.FailedPrecondition("host is provisioned")}, http.StatusForbidden},
		{"store down", "vm1", &issuer{err: errdefs.Unavailable("etcd")}, http.StatusServiceUnavailable},
		{"token with spaces", "vm1", &issuer{token: "abc.def rd.break"}, http.StatusInternalServerError},
		{"bad host name", "VM_1;", &issuer{}, http.StatusBadRequest},
	} {
		_, ts := newServer(t, bootserver.Options{MediaDir: dir, Tokens: tc.iss})
		resp, body := get(t, ts.URL+"/boot/ipxe/"+tc.host)
		if resp.StatusCode != tc.status {
			t.Errorf("%s: GET /boot/ipxe/%s = %d %q, want %d", tc.name, tc.host, resp.StatusCode, body, tc.status)
		}
		if strings.Contains(string(body), "rd.break") {
			t.Errorf("%s: response echoes the token: %q", tc.name, body)
		}
	}
}

func TestNewValidates(t *testing.T) {
	dir, _ := media(t)
	for _, tc := range []struct {
		name string
		o    bootserver.Options
	}{
		{"no media", bootserver.Options{ControllerAddr: "a:1", CAHash: caHash, Tokens: &issuer{}}},
		{"no controller", bootserver.Options{MediaDir: dir, CAHash: caHash, Tokens: &issuer{}}},
		{"bad hash", bootserver.Options{MediaDir: dir, ControllerAddr: "a:1", CAHash: "sha256:xyz", Tokens: &issuer{}}},
		{"no issuer", bootserver.Options{MediaDir: dir, ControllerAddr: "a:1", CAHash: caHash}},
		{"cmdline injection", bootserver.Options{MediaDir: dir, ControllerAddr: "a:1", CAHash: caHash, Tokens: &issuer{}, Cmdline: "x\ninitrd http://evil"}},
	} {
		if _, err := bootserver.New(tc.o); !errdefs.IsInvalidArgument(err) {
			t.Errorf("New(%s) = %v, want InvalidArgument", tc.name, err)
		}
	}
}

func TestHostISOBuiltOnceAndForgotten(t *testing.T) {
	dir, _ := media(t)
	iss := &issuer{}
	var builds int
	var mu sync.Mutex
	fake := func(_ context.Context, kernel, initrd, cmdline, out string) error {
		mu.Lock()
		builds++
		mu.Unlock()
		// An "ISO" that is its command line, padded.
		return os.WriteFile(out, []byte(cmdline+strings.Repeat(" ", 4096)), 0o644)
	}
	s, ts := newServer(t, bootserver.Options{MediaDir: dir, Tokens: iss, BuildISO: fake})
	url := bootserver.ISOURL(ts.URL, "vm1")

	// A BMC reads the ISO with many concurrent Range requests: one build,
	// one token.
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, body := get(t, url, "Range", fmt.Sprintf("bytes=%d-%d", i*10, i*10+9))
			if resp.StatusCode != http.StatusPartialContent || len(body) != 10 {
				t.Errorf("GET %s Range %d = %d (%d bytes), want 206 (10 bytes)", url, i, resp.StatusCode, len(body))
			}
		}()
	}
	wg.Wait()
	resp, body := get(t, url)
	if builds != 1 || iss.count() != 1 {
		t.Fatalf("after 9 reads: %d builds, %d tokens, want 1 and 1", builds, iss.count())
	}
	cmdline := strings.TrimSpace(string(body))
	for _, want := range []string{"kiln.boot=virtualmedia", "kiln.token=abc001.", "kiln.host=vm1", "kiln.ca_hash=" + caHash} {
		if !strings.Contains(cmdline, want) {
			t.Errorf("ISO cmdline %q lacks %q", cmdline, want)
		}
	}
	sum := sha256.Sum256(body)
	if resp.Header.Get("X-Kiln-Sha256") != hex.EncodeToString(sum[:]) {
		t.Errorf("ISO X-Kiln-Sha256 = %q, want %x", resp.Header.Get("X-Kiln-Sha256"), sum)
	}

	s.Forget("vm1")
	_, body = get(t, url)
	if builds != 2 || !strings.Contains(string(body), "kiln.token=abc002.") {
		t.Errorf("after Forget: %d builds, ISO %q: want a rebuild with a new token", builds, strings.TrimSpace(string(body)))
	}
	if resp, _ := get(t, ts.URL+"/boot/iso/vm1.img"); resp.StatusCode != http.StatusNotFound {
		t.Errorf("GET /boot/iso/vm1.img = %d, want 404", resp.StatusCode)
	}
}

// TestUnknownHostsLeaveNoISOCache is the attack of issue 12 (hole 6): GETs
// of ISOs for hosts that do not exist grew the per-host ISO cache by one
// entry each (200k requests, 200k entries). Refused requests now leave
// nothing behind, while a real host's ISO stays cached.
func TestUnknownHostsLeaveNoISOCache(t *testing.T) {
	dir, _ := media(t)
	iss := &issuer{}
	fake := func(_ context.Context, _, _, cmdline, out string) error {
		return os.WriteFile(out, []byte(cmdline), 0o644)
	}
	s, ts := newServer(t, bootserver.Options{MediaDir: dir, Tokens: iss, BuildISO: fake})
	if resp, _ := get(t, bootserver.ISOURL(ts.URL, "real")); resp.StatusCode != http.StatusOK {
		t.Fatalf("GET real.iso = %d, want 200", resp.StatusCode)
	}

	iss.mu.Lock()
	iss.err = errdefs.NotFound("no host")
	iss.mu.Unlock()
	const n = 2000
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < n; i += 8 {
				// Every name twice, so some requests wait on another's
				// refused build of the same host.
				for range 2 {
					resp, _ := get(t, bootserver.ISOURL(ts.URL, fmt.Sprintf("ghost%d", i/2)))
					if resp.StatusCode != http.StatusNotFound {
						t.Errorf("GET ghost%d.iso = %d, want 404", i/2, resp.StatusCode)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	if got := s.CachedISOs(); got != 1 {
		t.Errorf("after %d refused ISO requests for unknown hosts: %d cached entries, want 1 (the real host's)", 2*n, got)
	}
	iss.mu.Lock()
	iss.err = nil
	iss.mu.Unlock()
	if resp, _ := get(t, bootserver.ISOURL(ts.URL, "real")); resp.StatusCode != http.StatusOK || iss.count() != 1 {
		t.Errorf("GET real.iso again = %d after %d tokens, want 200 from the cache (1 token)", resp.StatusCode, iss.count())
	}
}

// TestHostISOWithGrub builds a real per-host ISO with grub-mkrescue and
// reads its grub.cfg back with xorriso.
func TestHostISOWithGrub(t *testing.T) {
	for _, tool := range []string{"grub-mkrescue", "xorriso", "mformat"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (apt-get install grub-common grub-pc-bin grub-efi-amd64-bin xorriso mtools)", tool)
		}
	}
	dir, _ := media(t)
	_, ts := newServer(t, bootserver.Options{MediaDir: dir, Tokens: &issuer{}, ISOCacheDir: t.TempDir()})
	resp, body := get(t, bootserver.ISOURL(ts.URL, "vm1"))
	require.Equal(t, http.StatusOK, resp.StatusCode, string(body))
	iso := filepath.Join(t.TempDir(), "vm1.iso")
	require.NoError(t, os.WriteFile(iso, body, 0o644))
	out := t.TempDir()
	cmd := exec.Command("xorriso", "-osirrox", "on", "-indev", iso, "-extract", "/boot/grub/grub.cfg", filepath.Join(out, "grub.cfg"))
	b, err := cmd.CombinedOutput()
	require.NoError(t, err, string(b))
	cfg, err := os.ReadFile(filepath.Join(out, "grub.cfg"))
	require.NoError(t, err)
	if !strings.Contains(string(cfg), "linux /boot/vmlinuz console=tty0 console=ttyS0,115200 panic=10 kiln.boot=virtualmedia kiln.controller=10.0.0.1:7443 kiln.token=abc001.secret0000000000001 kiln.ca_hash="+caHash+" kiln.host=vm1\n") {
		t.Errorf("grub.cfg of the host ISO:\n%s\nwant the host's kernel command line", cfg)
	}
}

// BenchmarkHostISO measures building one host's ISO (grub-mkrescue) from
// boot media of realistic size (8 MiB kernel, 10 MiB initramfs).
func BenchmarkHostISO(b *testing.B) {
	if _, err := exec.LookPath("grub-mkrescue"); err != nil {
		testenv.Skip(b, "grub-mkrescue not installed")
	}
	dir := b.TempDir()
	for name, size := range map[string]int{bootmedia.KernelFile: 8 << 20, bootmedia.InitrdFile: 10 << 20} {
		buf := make([]byte, size)
		for i := range buf {
			buf[i] = byte(i * 7919 >> 3)
		}
		require.NoError(b, os.WriteFile(filepath.Join(dir, name), buf, 0o644))
	}
	s, err := bootserver.New(bootserver.Options{MediaDir: dir, ControllerAddr: "10.0.0.1:7443", CAHash: caHash, Tokens: &issuer{}})
	require.NoError(b, err)
	b.Cleanup(func() { s.Close() })
	ts := httptest.NewServer(s)
	b.Cleanup(ts.Close)
	b.ResetTimer()
	for i := range b.N {
		resp, err := http.Get(bootserver.ISOURL(ts.URL, fmt.Sprintf("host%d", i)))
		require.NoError(b, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		require.Equal(b, http.StatusOK, resp.StatusCode)
	}
}

// BenchmarkServeRange measures 1 MiB Range reads of a served image.
func BenchmarkServeRange(b *testing.B) {
	dir := b.TempDir()
	require.NoError(b, os.WriteFile(filepath.Join(dir, "img.raw"), make([]byte, 64<<20), 0o644))
	s, err := bootserver.New(bootserver.Options{MediaDir: dir, ImagesDir: dir, ControllerAddr: "10.0.0.1:7443", CAHash: caHash, Tokens: &issuer{}})
	require.NoError(b, err)
	b.Cleanup(func() { s.Close() })
	ts := httptest.NewServer(s)
	b.Cleanup(ts.Close)
	b.SetBytes(1 << 20)
	b.ResetTimer()
	for i := range b.N {
		off := (i % 64) << 20
		req, _ := http.NewRequest(http.MethodGet, ts.URL+"/images/img.raw", nil)
		req.Header.Set("Range", fmt.Sprintf("bytes=%d-%d", off, off+(1<<20)-1))
		resp, err := http.DefaultClient.Do(req)
		require.NoError(b, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusPartialContent {
			b.Fatalf("status %d", resp.StatusCode)
		}
	}
}

func TestBootNetworkCmdline(t *testing.T) {
	for _, tc := range []struct {
		n       *bootserver.BootNetwork
		want    string
		wantErr bool
	}{
		{nil, "", false},
		{&bootserver.BootNetwork{Address: "10.0.0.5/24"}, "kiln.ip=10.0.0.5/24", false},
		{&bootserver.BootNetwork{Address: "10.0.0.5/24", Gateway: "10.0.0.1", MAC: "52:54:00:AB:CD:EF", DNS: []string{"10.0.0.2", "fd00::53"}},
			"kiln.ip=10.0.0.5/24 kiln.gateway=10.0.0.1 kiln.mac=52:54:00:ab:cd:ef kiln.dns=10.0.0.2,fd00::53", false},
		{&bootserver.BootNetwork{Address: "10.0.0.5"}, "", true},
		{&bootserver.BootNetwork{Address: "10.0.0.5/24 rd.break"}, "", true},
		{&bootserver.BootNetwork{Address: "10.0.0.5/24", Gateway: "gw"}, "", true},
		{&bootserver.BootNetwork{Address: "10.0.0.5/24", MAC: "52:54"}, "", true},
		{&bootserver.BootNetwork{Address: "10.0.0.5/24", DNS: []string{"8.8.8.8 x"}}, "", true},
		// Found by FuzzBootNetworkCmdline: a zone is free text that went
		// onto the command line as is.
		{&bootserver.BootNetwork{Address: "fd00::5/64", Gateway: "fe80::1%x rd.break"}, "", true},
		{&bootserver.BootNetwork{Address: "fd00::5/64", DNS: []string{"fe80::53%x kiln.host=other"}}, "", true},
	} {
		got, err := tc.n.Cmdline()
		if got != tc.want || (err != nil) != tc.wantErr {
			t.Errorf("BootNetwork(%+v).Cmdline() = %q, %v, want %q, error %v", tc.n, got, err, tc.want, tc.wantErr)
		}
	}
}

type networks map[string]*bootserver.BootNetwork

func (n networks) BootNetwork(_ context.Context, host string) (*bootserver.BootNetwork, error) {
	if b, ok := n[host]; ok {
		return b, nil
	}
	return nil, errdefs.NotFound("host %q", host)
}

func TestStaticNetworkOnCommandLines(t *testing.T) {
	dir, _ := media(t)
	fake := func(_ context.Context, _, _, cmdline, out string) error {
		return os.WriteFile(out, []byte(cmdline), 0o644)
	}
	iss := &issuer{}
	_, ts := newServer(t, bootserver.Options{MediaDir: dir, Tokens: iss, BuildISO: fake, Networks: networks{
		"vm1":  {Address: "10.0.0.5/24", Gateway: "10.0.0.1"},
		"dhcp": nil,
		"bad":  {Address: "nonsense"},
	}})
	_, iso := get(t, bootserver.ISOURL(ts.URL, "vm1"))
	_, script := get(t, bootserver.IPXEURL(ts.URL, "vm1"))
	for _, b := range [][]byte{iso, script} {
		if !strings.Contains(string(b), " kiln.ip=10.0.0.5/24 kiln.gateway=10.0.0.1") {
			t.Errorf("command line %q lacks the static network", b)
		}
	}
	if _, b := get(t, bootserver.ISOURL(ts.URL, "dhcp")); strings.Contains(string(b), "kiln.ip=") {
		t.Errorf("DHCP host's command line %q has kiln.ip", b)
	}
	n := iss.count()
	if resp, _ := get(t, bootserver.IPXEURL(ts.URL, "bad")); resp.StatusCode != http.StatusInternalServerError {
		t.Errorf("GET script of a host with a malformed network = %d, want 500", resp.StatusCode)
	}
	if resp, _ := get(t, bootserver.ISOURL(ts.URL, "unknown")); resp.StatusCode != http.StatusNotFound {
		t.Errorf("GET ISO of a host the network source does not know = %d, want 404", resp.StatusCode)
	}
	if iss.count() != n {
		t.Errorf("tokens were minted for hosts that got no boot media")
	}
}
