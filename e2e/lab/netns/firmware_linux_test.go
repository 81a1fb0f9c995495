package netns

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/bootserver"
	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/imagebuilder/bootmedia"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

func TestParseIPXE(t *testing.T) {
	const mac = "52:54:00:aa:00:01"
	s, err := ParseIPXE(bootserver.IPXEScript("lab-h1", "http://10.0.0.1:8080", "console=ttyS0 kiln.token=abc.def kiln.host=lab-h1"), mac)
	require.NoError(t, err)
	if s.Kernel != "http://10.0.0.1:8080/boot/files/"+bootmedia.KernelFile ||
		s.Cmdline != "initrd="+bootmedia.InitrdFile+" console=ttyS0 kiln.token=abc.def kiln.host=lab-h1 BOOTIF=01-52-54-00-aa-00-01" ||
		len(s.Initrds) != 1 || s.Initrds[0] != "http://10.0.0.1:8080/boot/files/"+bootmedia.InitrdFile {
		t.Errorf("ParseIPXE(the boot server's script) = %+v", s)
	}
	s, err = ParseIPXE("#!ipxe\ndhcp\nchain --autofree http://10.0.0.1/boot/ipxe/${net0/mac:hexhyp}\n", mac)
	require.NoError(t, err)
	if s.Chain != "http://10.0.0.1/boot/ipxe/52-54-00-aa-00-01" {
		t.Errorf("ParseIPXE(chain) = %+v", s)
	}
	s, err = ParseIPXE("#!ipxe\r\nkernel --name k vmlinuz a=${unset} b\r\ninitrd initrd.img\r\nboot\r\n", mac)
	require.NoError(t, err)
	if s.Kernel != "vmlinuz" || s.Cmdline != "a= b" {
		t.Errorf("ParseIPXE(kernel --name) = %+v", s)
	}
	for _, bad := range []string{"", "<html>404</html>", "#!ipxe\necho no kernel\nboot\n"} {
		if _, err := ParseIPXE(bad, mac); !errdefs.IsInvalidArgument(err) {
			t.Errorf("ParseIPXE(%q) = %v, want InvalidArgument", bad, err)
		}
	}
}

func TestParseBootConfig(t *testing.T) {
	const c = "console=ttyS0 kiln.boot=virtualmedia kiln.token=abc.def"
	if got, ok := ParseBootConfig(bootmedia.GrubConfig(c)); !ok || got != c {
		t.Errorf("ParseBootConfig(bootmedia.GrubConfig(%q)) = %q, %v", c, got, ok)
	}
	if got, ok := ParseBootConfig("DEFAULT kiln\nLABEL kiln\n  KERNEL /boot/vmlinuz\n  APPEND initrd=/boot/initrd.img " + c + "\n"); !ok || got != "initrd=/boot/initrd.img "+c {
		t.Errorf("ParseBootConfig(isolinux) = %q, %v", got, ok)
	}
	if got, ok := ParseBootConfig("set timeout=0\n# linux /boot/vmlinuz commented\n"); ok {
		t.Errorf("ParseBootConfig(no linux line) = %q, true", got)
	}
}

func needXorriso(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("xorriso"); err != nil {
		testenv.Skip(t, "xorriso not installed (Debian package xorriso)")
	}
}

// mkISO writes an ISO 9660 image holding files (path → content).
func mkISO(t *testing.T, files map[string]string) string {
	t.Helper()
	root := t.TempDir()
	for p, c := range files {
		require.NoError(t, os.MkdirAll(filepath.Join(root, filepath.Dir(p)), 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(root, p), []byte(c), 0o644))
	}
	iso := filepath.Join(t.TempDir(), "media.iso")
	out, err := exec.Command("xorriso", "-as", "mkisofs", "-R", "-o", iso, root).CombinedOutput()
	require.NoError(t, err, "xorriso -as mkisofs: %s", out)
	return iso
}

func TestReadISOCmdline(t *testing.T) {
	needXorriso(t)
	ctx := context.Background()
	const c = "console=ttyS0 kiln.boot=virtualmedia kiln.token=abc.def"
	got, err := ReadISOCmdline(ctx, mkISO(t, map[string]string{"boot/grub/grub.cfg": bootmedia.GrubConfig(c), "boot/vmlinuz": "K"}))
	if err != nil || got != c {
		t.Errorf("ReadISOCmdline(grub ISO) = %q, %v, want %q", got, err, c)
	}
	got, err = ReadISOCmdline(ctx, mkISO(t, map[string]string{"isolinux/isolinux.cfg": "LABEL a\n APPEND " + c + "\n"}))
	if err != nil || got != c {
		t.Errorf("ReadISOCmdline(isolinux ISO) = %q, %v, want %q", got, err, c)
	}
	_, err = ReadISOCmdline(ctx, mkISO(t, map[string]string{"readme.txt": "no boot config"}))
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "no kernel command line") {
		t.Errorf("ReadISOCmdline(ISO without boot config) = %v, want InvalidArgument no kernel command line", err)
	}
	notISO := filepath.Join(t.TempDir(), "page.html")
	require.NoError(t, os.WriteFile(notISO, []byte("<html>hello</html>"), 0o644))
	if _, err := ReadISOCmdline(ctx, notISO); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "not an ISO") {
		t.Errorf("ReadISOCmdline(HTML page) = %v, want InvalidArgument not an ISO", err)
	}
}

// recordingIssuer mints a distinct token per call and remembers them;
// unknown hosts are NotFound, as the controller's issuer answers.
type recordingIssuer struct {
	mu     sync.Mutex
	hosts  map[string]bool
	tokens map[string][]string
}

func (i *recordingIssuer) BootToken(_ context.Context, host string) (string, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if !i.hosts[host] {
		return "", errdefs.NotFound("host %q not found", host)
	}
	tok := "tok" + strings.ReplaceAll(host, "-", "") + "." + strings.Repeat("s", 10) + string(rune('a'+len(i.tokens[host])))
	i.tokens[host] = append(i.tokens[host], tok)
	return tok, nil
}

func (i *recordingIssuer) last(host string) string {
	i.mu.Lock()
	defer i.mu.Unlock()
	if ts := i.tokens[host]; len(ts) > 0 {
		return ts[len(ts)-1]
	}
	return ""
}

// TestFirmwareBoot boots a host from a real boot server listening on the
// host-side end of its veth: PXE fetches the host's iPXE script from
// inside the host's namespace (the server sees the host's address), and
// virtual media downloads and reads the host's ISO; the agent's
// /proc/cmdline is the one the boot server wrote, with the token it minted
// for that host. Scripts and media that cannot be had boot nothing, and
// LastBootError says why.
func TestFirmwareBoot(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	dir := t.TempDir()
	out := filepath.Join(dir, "cmdline.out")
	const hostAddr, gwAddr = "10.252.9.2", "10.252.9.1"

	media := t.TempDir()
	for _, f := range []string{bootmedia.KernelFile, bootmedia.InitrdFile} {
		require.NoError(t, os.WriteFile(filepath.Join(media, f), []byte(strings.Repeat(f, 1000)), 0o644))
	}
	iss := &recordingIssuer{hosts: map[string]bool{"lab-boot3": true}, tokens: map[string][]string{}}
	srv, err := bootserver.New(bootserver.Options{MediaDir: media, ControllerAddr: gwAddr + ":7443",
		CAHash: "sha256:" + strings.Repeat("0", 64), Tokens: iss, ISOCacheDir: t.TempDir()})
	require.NoError(t, err)
	t.Cleanup(func() { _ = srv.Close() })

	m, err := New(ctx, Options{
		Name: "boot3", Lab: testLab(), StateDir: filepath.Join(dir, "boot3"), Address: hostAddr + "/24",
		Agent: Agent{
			Command:    []string{"sh", "-c", `cat /proc/cmdline > "$0.tmp" && mv "$0.tmp" "$0"; exec sleep infinity`, out},
			Cmdline:    "kiln.host=static kiln.controller=static:7443",
			ReadMedia:  true,
			BootScript: "", // set below, once the server's port is known
		},
		GracePeriod: 5 * time.Second,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close(context.Background()) })
	require.NoError(t, exec.Command("ip", "addr", "add", gwAddr+"/24", "dev", m.Veth()).Run())

	ln, err := net.Listen("tcp", gwAddr+":0")
	require.NoError(t, err)
	var mu sync.Mutex
	remotes := map[string]string{} // path → remote address
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		remotes[r.URL.Path] = r.RemoteAddr
		mu.Unlock()
		srv.ServeHTTP(w, r)
	})}
	go func() { _ = hs.Serve(ln) }()
	t.Cleanup(func() { _ = hs.Close() })
	base := "http://" + ln.Addr().String()

	boot := func(t *testing.T, dev, script, media string) string {
		t.Helper()
		_ = os.Remove(out)
		m.o.Agent.BootScript = script
		require.NoError(t, m.InsertMedia(media))
		require.NoError(t, m.PowerOn(ctx, dev))
		t.Cleanup(func() { require.NoError(t, m.PowerOff(context.Background(), false)) })
		if m.PID() == 0 {
			return ""
		}
		waitFor(t, "the agent's command line", 30*time.Second, func() bool { _, err := os.Stat(out); return err == nil })
		b, err := os.ReadFile(out)
		require.NoError(t, err)
		return strings.TrimSpace(string(b))
	}

	t.Run("pxe", func(t *testing.T) {
		got := boot(t, machine.BootPXE, bootserver.IPXEURL(base, "lab-boot3"), "")
		tok := iss.last("lab-boot3")
		require.NotEmpty(t, tok, "the boot server minted no token: %s", m.LastBootError())
		want := "initrd=" + bootmedia.InitrdFile + " " + srv.Cmdline("lab-boot3", "pxe", tok, "") +
			" BOOTIF=01-" + strings.ReplaceAll(m.MAC(), ":", "-") + " kiln.lab_disk=" + m.DiskPath()
		if got != want {
			t.Errorf("PXE boot: agent's /proc/cmdline =\n%q\nwant\n%q", got, want)
		}
		mu.Lock()
		remote := remotes["/boot/ipxe/lab-boot3"]
		mu.Unlock()
		if h, _, _ := net.SplitHostPort(remote); h != hostAddr {
			t.Errorf("the iPXE script was fetched from %s, want from the host's namespace (%s)", remote, hostAddr)
		}
	})
	t.Run("virtual media", func(t *testing.T) {
		// The tools the boot server's ISO builder (bootmedia.WriteISO) runs.
		for _, tool := range []string{"grub-mkimage", "xorriso", "mformat", "mcopy"} {
			if _, err := exec.LookPath(tool); err != nil {
				testenv.Skipf(t, "%s not installed (apt-get install grub-common grub-pc-bin grub-efi-amd64-bin xorriso mtools)", tool)
			}
		}
		got := boot(t, machine.BootCD, "", bootserver.ISOURL(base, "lab-boot3"))
		tok := iss.last("lab-boot3")
		want := srv.Cmdline("lab-boot3", "virtualmedia", tok, "") + " kiln.lab_disk=" + m.DiskPath()
		if got != want {
			t.Errorf("virtual media boot: agent's /proc/cmdline =\n%q\nwant\n%q (%s)", got, want, m.LastBootError())
		}
		if _, err := os.Stat(filepath.Join(m.o.StateDir, "media.iso")); err == nil {
			t.Errorf("the downloaded ISO was left in the host's directory")
		}
	})
	t.Run("kernel missing", func(t *testing.T) {
		k := filepath.Join(media, bootmedia.KernelFile)
		require.NoError(t, os.Rename(k, k+".away"))
		defer func() { require.NoError(t, os.Rename(k+".away", k)) }()
		if got := boot(t, machine.BootPXE, bootserver.IPXEURL(base, "lab-boot3"), ""); got != "" {
			t.Errorf("booted %q without a kernel, want nothing", got)
		}
		t.Logf("LastBootError: %s", m.LastBootError())
		if e := m.LastBootError(); !strings.Contains(e, "/boot/files/"+bootmedia.KernelFile+": HTTP 404") {
			t.Errorf("LastBootError() = %q, want the kernel URL and 404 in it", e)
		}
	})
	t.Run("boot server briefly away", func(t *testing.T) {
		needXorriso(t)
		// The first two reads of the ISO get 503 (a controller restarting),
		// the third the ISO: firmware retries and boots.
		var n atomic.Int32
		target, err := url.Parse(base)
		require.NoError(t, err)
		proxy := httputil.NewSingleHostReverseProxy(target)
		flaky := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if n.Add(1) <= 2 {
				http.Error(w, "restarting", http.StatusServiceUnavailable)
				return
			}
			proxy.ServeHTTP(w, r)
		}))
		defer flaky.Close()
		m.o.Agent.FirmwareRetry = time.Minute
		defer func() { m.o.Agent.FirmwareRetry = 0 }()
		got := boot(t, machine.BootCD, "", bootserver.ISOURL(flaky.URL, "lab-boot3"))
		if !strings.Contains(got, "kiln.token=") || n.Load() < 3 {
			t.Errorf("virtual media boot through a boot server answering 503 twice: agent's /proc/cmdline = %q after %d requests (%s); want a boot after retries", got, n.Load(), m.LastBootError())
		}
	})
	for _, tc := range []struct {
		name, dev, script, media, why string
	}{
		{"iso 404", machine.BootCD, "", base + "/boot/iso/nohost.iso", "404"},
		{"not an iso", machine.BootCD, "", base + "/boot/files/" + bootmedia.KernelFile, "not an ISO"},
		{"unreachable media", machine.BootCD, "", "http://127.0.0.1:1/x.iso", "refused"},
		{"missing file", machine.BootCD, "", "file:///nonexistent/kiln.iso", "no such file"},
		{"not a URL", machine.BootCD, "", "nfs://10.0.0.1/x.iso", "not an http(s) URL"},
		{"script 404", machine.BootPXE, bootserver.IPXEURL(base, "nohost"), "", "404"},
		// The script is on the supervisor's loopback, which the host cannot reach.
		{"script outside the host's network", machine.BootPXE, "http://127.0.0.1:" + strings.Split(ln.Addr().String(), ":")[1] + "/boot/ipxe/lab-boot3", "", "refused"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.dev == machine.BootCD {
				needXorriso(t)
			}
			launches := m.Launches()
			if got := boot(t, tc.dev, tc.script, tc.media); got != "" {
				t.Errorf("booted %q, want nothing", got)
			}
			if !m.State() || m.PID() != 0 || m.Launches() != launches {
				t.Errorf("State() = %v, PID() = %d, launches %d → %d: want on, running nothing", m.State(), m.PID(), launches, m.Launches())
			}
			t.Logf("LastBootError: %s", m.LastBootError())
			if e := m.LastBootError(); !strings.Contains(e, tc.why) {
				t.Errorf("LastBootError() = %q, want %q in it", e, tc.why)
			}
		})
	}
}

// BenchmarkFirmwareBoot measures a power-on through the lab's firmware
// against a real boot server on the host's veth, until the agent has
// started, and a hard power-off: "pxe" fetches the iPXE script from
// inside the host's namespace and probes its kernel and initrd; "cd"
// downloads the host's ISO (built once by the boot server, 8 MiB kernel
// and 10 MiB initrd) and reads its grub.cfg with xorriso.
func BenchmarkFirmwareBoot(b *testing.B) {
	if os.Geteuid() != 0 {
		testenv.Skip(b, "needs root")
	}
	for _, tool := range []string{"grub-mkimage", "xorriso", "mformat", "mcopy"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(b, "%s not installed", tool)
		}
	}
	ctx := context.Background()
	const gwAddr = "10.252.10.1"
	media := b.TempDir()
	for f, size := range map[string]int{bootmedia.KernelFile: 8 << 20, bootmedia.InitrdFile: 10 << 20} {
		if err := os.WriteFile(filepath.Join(media, f), []byte(strings.Repeat("x", size)), 0o644); err != nil {
			b.Fatal(err)
		}
	}
	iss := &recordingIssuer{hosts: map[string]bool{"lab-bench3": true}, tokens: map[string][]string{}}
	srv, err := bootserver.New(bootserver.Options{MediaDir: media, ControllerAddr: gwAddr + ":7443",
		CAHash: "sha256:" + strings.Repeat("0", 64), Tokens: iss, ISOCacheDir: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	defer srv.Close()
	m, err := New(ctx, Options{Name: "bench3", Lab: testLab(), StateDir: filepath.Join(b.TempDir(), "h"), Address: "10.252.10.2/24",
		Agent: Agent{Command: []string{"sleep", "infinity"}, ReadMedia: true}})
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close(ctx)
	if out, err := exec.Command("ip", "addr", "add", gwAddr+"/24", "dev", m.Veth()).CombinedOutput(); err != nil {
		b.Fatalf("ip addr add: %v: %s", err, out)
	}
	ln, err := net.Listen("tcp", gwAddr+":0")
	if err != nil {
		b.Fatal(err)
	}
	hs := &http.Server{Handler: srv}
	go func() { _ = hs.Serve(ln) }()
	defer hs.Close()
	base := "http://" + ln.Addr().String()
	m.o.Agent.BootScript = bootserver.IPXEURL(base, "lab-bench3")
	if err := m.InsertMedia(bootserver.ISOURL(base, "lab-bench3")); err != nil {
		b.Fatal(err)
	}
	// The boot server builds the ISO at the first request: not measured.
	resp, err := http.Get(bootserver.ISOURL(base, "lab-bench3"))
	if err != nil {
		b.Fatal(err)
	}
	resp.Body.Close()
	for _, dev := range []string{machine.BootPXE, machine.BootCD} {
		b.Run(dev, func(b *testing.B) {
			for b.Loop() {
				if err := m.PowerOn(ctx, dev); err != nil {
					b.Fatal(err)
				}
				if m.PID() == 0 {
					b.Fatalf("nothing booted: %s", m.LastBootError())
				}
				if err := m.PowerOff(ctx, false); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
