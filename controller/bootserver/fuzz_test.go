package bootserver_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/net/http/httpguts"

	"github.com/kilnhq/kiln/controller/bootserver"
	"github.com/kilnhq/kiln/imagebuilder/bootmedia"
)

// outsideMarker is the content of a file next to the served directories,
// reachable only by escaping them; no response may ever carry it.
const outsideMarker = "OUTSIDE-THE-SERVED-DIRECTORIES"

type fuzzServer struct {
	s     *bootserver.Server
	iss   *issuer
	files map[string][]byte // "/boot/files/x" and "/images/y" → content
}

func newFuzzServer(f *testing.F) *fuzzServer {
	root := f.TempDir()
	mediaDir, imagesDir := filepath.Join(root, "media"), filepath.Join(root, "images")
	for _, d := range []string{mediaDir, imagesDir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			f.Fatal(err)
		}
	}
	write := func(p string, b []byte) {
		if err := os.WriteFile(p, b, 0o644); err != nil {
			f.Fatal(err)
		}
	}
	write(filepath.Join(root, "secret"), []byte(outsideMarker))
	fs := &fuzzServer{iss: &issuer{}, files: map[string][]byte{}}
	m := bootmedia.Manifest{}
	for name, b := range map[string][]byte{
		bootmedia.KernelFile: bytes.Repeat([]byte("K"), 5000),
		bootmedia.InitrdFile: []byte(strings.Repeat("0123456789", 1000)),
	} {
		write(filepath.Join(mediaDir, name), b)
		sum := sha256.Sum256(b)
		m.Files = append(m.Files, bootmedia.File{Name: name, Size: int64(len(b)), SHA256: hex.EncodeToString(sum[:])})
		fs.files["/boot/files/"+name] = b
	}
	mb, err := json.Marshal(m)
	if err != nil {
		f.Fatal(err)
	}
	write(filepath.Join(mediaDir, bootmedia.ManifestFile), mb)
	fs.files["/boot/files/"+bootmedia.ManifestFile] = mb
	img := bytes.Repeat([]byte{1, 2, 3, 4, 5, 6, 7}, 3000)
	write(filepath.Join(imagesDir, "debian12.raw.zst"), img)
	fs.files["/images/debian12.raw.zst"] = img
	// A symlink out of the images directory: never followed.
	if err := os.Symlink(filepath.Join(root, "secret"), filepath.Join(imagesDir, "escape.raw")); err != nil {
		f.Fatal(err)
	}
	s, err := bootserver.New(bootserver.Options{
		MediaDir: mediaDir, ImagesDir: imagesDir, ControllerAddr: "10.0.0.1:7443", CAHash: caHash, Tokens: fs.iss,
		ISOCacheDir: filepath.Join(root, "iso"),
		// An "ISO" that is its command line.
		BuildISO: func(_ context.Context, _, _, cmdline, out string) error {
			return os.WriteFile(out, []byte(cmdline), 0o644)
		},
	})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = s.Close() })
	fs.s = s
	return fs
}

// tokenField is the kiln.token= field of a served command line.
var tokenField = regexp.MustCompile(`(^| )kiln\.token=([^ ]*)`)

// FuzzBootServer sends the boot server requests as a host on the boot
// network could: any method, path, Host and Range header, and a token
// of any form from the issuer. Properties:
//   - nothing outside the media and images directories is ever served
//     (a symlink out of the images directory included);
//   - a file is served whole with its sha256, or as the exact byte
//     ranges Content-Range (or each multipart part) says;
//   - HEAD never mints a token;
//   - an iPXE script is the five lines IPXEScript writes for the host of
//     its path, with exactly one kiln.host= (that host) and one
//     kiln.token= (the token minted for that host), and a token the
//     server would not put on a command line is refused, not served;
//   - an ISO carries the same command line for its host;
//   - no request makes the server fail (5xx) except a malformed token.
func FuzzBootServer(f *testing.F) {
	fs := newFuzzServer(f)
	for _, seed := range [][4]string{
		{"GET", "/boot/files/initrd.img", "10.0.0.1:8080", ""},
		{"GET", "/boot/files/initrd.img", "10.0.0.1:8080", "bytes=100-199"},
		{"GET", "/boot/files/initrd.img", "10.0.0.1:8080", "bytes=9990-"},
		{"GET", "/boot/files/vmlinuz", "10.0.0.1:8080", "bytes=-5"},
		{"GET", "/images/debian12.raw.zst", "boot.lab", "bytes=7-13,20-30"},
		{"HEAD", "/images/debian12.raw.zst", "boot.lab", "bytes=0-0"},
		{"GET", "/images/escape.raw", "boot.lab", ""},
		{"GET", "/boot/files/..%2f..%2fsecret", "boot.lab", ""},
		{"GET", "/images/%2e%2e/secret", "boot.lab", ""},
		{"GET", "/boot/ipxe/rack1-07", "10.0.0.1:8080", ""},
		{"HEAD", "/boot/ipxe/rack1-07", "10.0.0.1:8080", ""},
		{"GET", "/boot/iso/rack1-07.iso", "10.0.0.1:8080", "bytes=0-10"},
		{"HEAD", "/boot/iso/rack1-07.iso", "10.0.0.1:8080", ""},
		{"GET", "/boot/ipxe/VM_1;", "10.0.0.1:8080", ""},
	} {
		f.Add(seed[0], seed[1], seed[2], seed[3], "")
	}
	f.Add("GET", "/boot/ipxe/vm1", "10.0.0.1", "", "abc.def rd.break")
	f.Add("GET", "/boot/iso/vm1.iso", "10.0.0.1", "", "abc.def\ninitrd")

	f.Fuzz(func(t *testing.T, method, target, host, rng, token string) {
		raw := method + " " + target + " HTTP/1.1\r\nHost: " + host + "\r\n"
		if rng != "" {
			raw += "Range: " + rng + "\r\n"
		}
		req, err := http.ReadRequest(bufio.NewReader(strings.NewReader(raw + "\r\n")))
		if err != nil || !httpguts.ValidHostHeader(req.Host) {
			return // net/http's server answers 400 before any handler
		}
		fs.iss.mu.Lock()
		fs.iss.token, fs.iss.hosts = token, nil
		minted := fs.iss.n
		fs.iss.mu.Unlock()
		rec := httptest.NewRecorder()
		fs.s.ServeHTTP(rec, req)
		resp := rec.Result()
		body := rec.Body.Bytes()
		fs.iss.mu.Lock()
		hosts := fs.iss.hosts
		mintedNow := fs.iss.n - minted
		fs.iss.mu.Unlock()
		what := fmt.Sprintf("%s %q (Host %q, Range %q, token %q) = %d", method, target, host, rng, token, resp.StatusCode)

		if bytes.Contains(body, []byte(outsideMarker)) {
			t.Fatalf("%s served a file outside the served directories", what)
		}
		if req.Method == http.MethodHead && mintedNow > 0 {
			t.Fatalf("%s minted %d boot tokens: HEAD must not", what, mintedNow)
		}
		if resp.StatusCode >= 500 && !strings.Contains(string(body), "malformed token") {
			t.Fatalf("%s: %s", what, body)
		}
		path := req.URL.Path
		if h, ok := strings.CutPrefix(path, "/boot/iso/"); ok {
			// Each request starts without a cached ISO, whatever its
			// answer (a 416 for a bad Range comes after the build).
			defer fs.s.Forget(strings.TrimSuffix(h, ".iso"))
		}
		if resp.StatusCode/100 != 2 {
			return
		}
		switch {
		case strings.HasPrefix(path, "/boot/ipxe/"):
			h := strings.TrimPrefix(path, "/boot/ipxe/")
			checkIPXE(t, what, string(body), h, hosts, token)
		case strings.HasPrefix(path, "/boot/iso/"):
			h := strings.TrimSuffix(strings.TrimPrefix(path, "/boot/iso/"), ".iso")
			if req.Method == http.MethodHead || resp.StatusCode != http.StatusOK {
				return
			}
			checkCmdline(t, what, string(body), h, hosts, token)
		default:
			content, ok := fs.files[path]
			if !ok {
				t.Fatalf("%s served %q, which is not a served file", what, path)
			}
			if req.Method == http.MethodHead {
				return
			}
			sum := sha256.Sum256(content)
			if got := resp.Header.Get("X-Kiln-Sha256"); got != hex.EncodeToString(sum[:]) {
				t.Fatalf("%s: X-Kiln-Sha256 %q, want %x", what, got, sum)
			}
			checkRanges(t, what, resp, body, content)
		}
	})
}

func checkIPXE(t *testing.T, what, script, host string, hosts []string, token string) {
	t.Helper()
	lines := strings.Split(script, "\n")
	if len(lines) != 6 || lines[0] != "#!ipxe" || lines[4] != "boot" || lines[5] != "" ||
		lines[1] != "echo Kiln: booting the agent of host "+host || !strings.HasPrefix(lines[3], "initrd ") {
		t.Fatalf("%s: script is not the five lines of IPXEScript for host %q:\n%s", what, host, script)
	}
	kernel := strings.Fields(lines[2])
	if len(kernel) < 4 || kernel[0] != "kernel" || kernel[2] != "initrd="+bootmedia.InitrdFile || kernel[len(kernel)-1] != "BOOTIF=01-${mac:hexhyp}" {
		t.Fatalf("%s: kernel line %q", what, lines[2])
	}
	if strings.Count(lines[2], "${") != 1 || strings.Count(lines[3], "${") != 0 {
		t.Fatalf("%s: the script asks iPXE to expand a setting the server did not write:\n%s", what, script)
	}
	checkCmdline(t, what, strings.Join(kernel[3:len(kernel)-1], " "), host, hosts, token)
}

// checkCmdline checks a served kernel command line: one kiln.host= for
// host, one kiln.token= with the token minted for host.
func checkCmdline(t *testing.T, what, cmdline, host string, hosts []string, token string) {
	t.Helper()
	if len(hosts) != 1 || hosts[0] != host {
		t.Fatalf("%s: served host %q a command line with tokens minted for %q", what, host, hosts)
	}
	if n := strings.Count(" "+cmdline, " kiln.host="); n != 1 || !strings.Contains(cmdline+" ", " kiln.host="+host+" ") {
		t.Fatalf("%s: command line %q does not name host %q exactly once", what, cmdline, host)
	}
	m := tokenField.FindAllStringSubmatch(cmdline, -1)
	if len(m) != 1 {
		t.Fatalf("%s: command line %q has %d kiln.token= fields, want 1", what, cmdline, len(m))
	}
	if token != "" && m[0][2] != token {
		t.Fatalf("%s: command line %q carries token %q, want the minted %q", what, cmdline, m[0][2], token)
	}
	if strings.ContainsAny(cmdline, "\n\r\t\"'$;\\") {
		t.Fatalf("%s: command line %q holds characters a boot loader would interpret", what, cmdline)
	}
}

var contentRange = regexp.MustCompile(`^bytes (\d+)-(\d+)/(\d+)$`)

// checkRanges checks a 200 or 206 body against the file's content.
func checkRanges(t *testing.T, what string, resp *http.Response, body, content []byte) {
	t.Helper()
	if resp.StatusCode == http.StatusOK {
		if !bytes.Equal(body, content) {
			t.Fatalf("%s: 200 body of %d bytes is not the file's %d", what, len(body), len(content))
		}
		return
	}
	if resp.StatusCode != http.StatusPartialContent {
		t.Fatalf("%s: unexpected success status", what)
	}
	part := func(cr string, b []byte) {
		m := contentRange.FindStringSubmatch(cr)
		if m == nil {
			t.Fatalf("%s: Content-Range %q", what, cr)
		}
		first, _ := strconv.Atoi(m[1])
		last, _ := strconv.Atoi(m[2])
		size, _ := strconv.Atoi(m[3])
		if size != len(content) || first > last || last >= size || !bytes.Equal(b, content[first:last+1]) {
			t.Fatalf("%s: part %q of %d bytes is not those bytes of the file", what, cr, len(b))
		}
	}
	mt, params, err := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if err != nil || mt != "multipart/byteranges" {
		part(resp.Header.Get("Content-Range"), body)
		return
	}
	mr := multipart.NewReader(bytes.NewReader(body), params["boundary"])
	for {
		p, err := mr.NextPart()
		if err == io.EOF {
			return
		}
		if err != nil {
			t.Fatalf("%s: multipart body: %v", what, err)
		}
		b, err := io.ReadAll(p)
		if err != nil {
			t.Fatalf("%s: multipart part: %v", what, err)
		}
		part(p.Header.Get("Content-Range"), b)
	}
}

// FuzzBootNetworkCmdline checks the kernel parameters of a static boot
// network: accepted fields give only kiln.ip=, kiln.gateway=, kiln.mac=
// and kiln.dns= words (one each at most), with nothing a boot loader or
// the kernel would split or interpret.
func FuzzBootNetworkCmdline(f *testing.F) {
	f.Add("10.0.0.5/24", "10.0.0.1", "52:54:00:12:34:56", "10.0.0.2")
	f.Add("fd00::5/64", "fe80::1%eth0", "52-54-00-12-34-56", "1.1.1.1")
	f.Add("10.0.0.5", "", "", "")
	f.Add("10.0.0.5/24", "", "00:00:00:00:fe:80:00:00:00:00:00:00:02:00:5e:10:00:00:00:01", "::1")
	f.Fuzz(func(t *testing.T, addr, gw, mac, dns string) {
		n := &bootserver.BootNetwork{Address: addr, Gateway: gw, MAC: mac}
		if dns != "" {
			n.DNS = strings.Split(dns, ",")
		}
		c, err := n.Cmdline()
		if err != nil {
			return
		}
		seen := map[string]bool{}
		for _, w := range strings.Split(c, " ") {
			k, v, ok := strings.Cut(w, "=")
			switch {
			case !ok || v == "":
				t.Fatalf("Cmdline(%+v) = %q: word %q is not key=value", n, c, w)
			case k != "kiln.ip" && k != "kiln.gateway" && k != "kiln.mac" && k != "kiln.dns", seen[k]:
				t.Fatalf("Cmdline(%+v) = %q: unexpected or repeated %q", n, c, k)
			case strings.ContainsAny(v, "=\"'$;\\\t\n\r%"):
				t.Fatalf("Cmdline(%+v) = %q: %s holds characters a boot loader or init would interpret", n, c, k)
			}
			seen[k] = true
		}
	})
}
