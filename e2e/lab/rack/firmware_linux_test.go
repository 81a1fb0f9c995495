package rack

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kilnhq/kiln/bmc"
	"github.com/kilnhq/kiln/controller/bootserver"
	"github.com/kilnhq/kiln/e2e/lab/ipmisim"
	"github.com/kilnhq/kiln/imagebuilder/bootmedia/bootmediatest"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

// tokens is a boot token issuer that records what it minted, by host;
// hosts it does not know are NotFound (the boot server answers 404).
type tokens struct {
	mu     sync.Mutex
	known  map[string]bool
	minted map[string][]string
}

func (i *tokens) BootToken(_ context.Context, host string) (string, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if !i.known[host] {
		return "", errdefs.NotFound("host %q not found", host)
	}
	tok := fmt.Sprintf("%s%d.secret%08d", strings.ReplaceAll(host, "-", ""), len(i.minted[host]), time.Now().UnixNano()%1e8)
	i.minted[host] = append(i.minted[host], tok)
	return tok, nil
}

func (i *tokens) last(host string) string {
	i.mu.Lock()
	defer i.mu.Unlock()
	if m := i.minted[host]; len(m) > 0 {
		return m[len(m)-1]
	}
	return ""
}

// listenFreebind listens on addr before the address exists on this
// machine (IP_FREEBIND): the lab's bridge gets it later.
func listenFreebind(t *testing.T, addr string) net.Listener {
	t.Helper()
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_FREEBIND, 1) })
		if err != nil {
			return err
		}
		return serr
	}}
	ln, err := lc.Listen(context.Background(), "tcp", addr)
	require.NoError(t, err)
	return ln
}

// TestFirmwareBoot runs a lab of one Redfish and one IPMI host against a
// real boot server (real boot media, a token issuer that records what it
// mints) listening on the lab's gateway, and drives the hosts with the
// controller's own BMC client as the host lifecycle does: the Redfish
// host boots the virtual media the boot server built for it, the IPMI
// host PXE-boots through ipmi_sim and fetches its iPXE script from inside
// its namespace; each agent's /proc/cmdline carries the token the boot
// server minted for that host. An ISO the boot server does not have (404)
// boots nothing, and the supervisor's log says why.
func TestFirmwareBoot(t *testing.T) {
	needLab(t)
	// xorriso reads the ISOs; the rest is what the boot server's ISO
	// builder (bootmedia.WriteISO) runs.
	for _, tool := range []string{"xorriso", "grub-mkimage", "mformat", "mcopy"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (apt-get install xorriso grub-common grub-pc-bin grub-efi-amd64-bin mtools)", tool)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	bin := t.TempDir()
	chassis, err := ipmisim.BuildChassis(ctx, bin)
	if err != nil {
		testenv.Skipf(t, "cannot build kiln-chassis: %v", err)
	}
	media := t.TempDir()
	bootmediatest.Build(t, media)

	// The "agent" records the command line its boot media gave it.
	agent := filepath.Join(bin, "agent")
	require.NoError(t, os.WriteFile(agent, []byte("#!/bin/sh\ncat /proc/cmdline > seen.tmp && mv seen.tmp seen\nexec sleep infinity\n"), 0o755))

	name := fmt.Sprintf("f%d", os.Getpid()%100000)
	subnet, err := freeSubnet(ctx, name)
	require.NoError(t, err)
	gw := netip.MustParsePrefix(subnet).Addr().Next()
	ln := listenFreebind(t, gw.String()+":0")
	base := "http://" + ln.Addr().String()
	_, port, _ := net.SplitHostPort(ln.Addr().String())

	h1, h2 := ResourceName(name, "h1"), ResourceName(name, "h2")
	iss := &tokens{known: map[string]bool{h1: true, h2: true}, minted: map[string][]string{}}
	srv, err := bootserver.New(bootserver.Options{MediaDir: media, ControllerAddr: gw.String() + ":7443",
		CAHash: "sha256:" + strings.Repeat("ab", 32), Tokens: iss, ISOCacheDir: t.TempDir(),
		Log: slog.New(slog.NewTextHandler(testWriter{t}, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = srv.Close() })
	var mu sync.Mutex
	remotes := map[string]string{}
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		remotes[r.URL.Path] = r.RemoteAddr
		mu.Unlock()
		srv.ServeHTTP(w, r)
	})}
	go func() { _ = hs.Serve(ln) }()
	t.Cleanup(func() { _ = hs.Close() })

	dir := filepath.Join(t.TempDir(), "lab")
	rep, err := Up(ctx, Options{
		Name: name, Hosts: 1, IPMI: 1, StateDir: dir, DiskSize: 64 << 20, Subnet: subnet,
		AgentBinary: agent, ControllerURL: "static:7443",
		BootURL:      "http://{gateway}:" + port + "/boot/ipxe/{host}",
		ServeCommand: []string{os.Args[0], "-test.run=^$"}, ServeEnv: []string{serveEnv + "=" + dir},
		ChassisCommand: []string{chassis},
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = Down(context.Background(), dir, nil) })
	require.Len(t, rep.Hosts, 2)
	require.Equal(t, h1, rep.Hosts[0].Resource)
	require.Equal(t, h2, rep.Hosts[1].Resource)

	dial := func(h Host) *bmc.BMC {
		c := rep.Credentials[h.Name]
		b, err := bmc.Dial(ctx, bmc.Endpoint{Protocol: h.BMC.Protocol, Address: h.BMC.Address,
			Username: c.Username, Password: c.Password, InsecureSkipVerify: h.BMC.Insecure}, bmc.Options{MaxAttempts: 1})
		require.NoError(t, err)
		return b
	}
	seen := func(h Host) string {
		t.Helper()
		p := filepath.Join(h.Dir, "seen")
		waitFor(t, h.Name+"'s agent", time.Minute, func() bool { _, err := os.Stat(p); return err == nil })
		b, err := os.ReadFile(p)
		require.NoError(t, err)
		return " " + strings.TrimSpace(string(b)) + " "
	}
	want := func(t *testing.T, h Host, cmdline string, args ...string) {
		t.Helper()
		for _, a := range args {
			if !strings.Contains(cmdline, " "+a+" ") {
				t.Errorf("%s: agent's /proc/cmdline = %q, want %q in it", h.Name, cmdline, a)
			}
		}
		if strings.Contains(cmdline, "static:7443") {
			t.Errorf("%s: agent's /proc/cmdline = %q: the lab's static command line, not the boot media's", h.Name, cmdline)
		}
	}

	t.Run("redfish virtual media", func(t *testing.T) {
		h := rep.Hosts[0]
		b := dial(h)
		require.NoError(t, b.InsertVirtualMedia(ctx, bootserver.ISOURL(base, h1)))
		require.NoError(t, b.SetBootDevice(ctx, bmc.BootCDROM, false, true))
		require.NoError(t, b.PowerOn(ctx))
		got := seen(h)
		tok := iss.last(h1)
		require.NotEmpty(t, tok, "no token minted for %s", h1)
		want(t, h, got, "kiln.boot=virtualmedia", "kiln.token="+tok, "kiln.host="+h1, "kiln.controller="+gw.String()+":7443", "kiln.lab_disk="+h.Disk)
		require.NoError(t, b.PowerOff(ctx))

		// The boot server has no ISO for an unknown host: nothing boots.
		require.NoError(t, os.Remove(filepath.Join(h.Dir, "seen")))
		from := 0
		if fi, err := os.Stat(filepath.Join(dir, ServeLog)); err == nil {
			from = int(fi.Size())
		}
		require.NoError(t, b.InsertVirtualMedia(ctx, bootserver.ISOURL(base, "unknown")))
		require.NoError(t, b.SetBootDevice(ctx, bmc.BootCDROM, false, true))
		require.NoError(t, b.PowerOn(ctx))
		// The machine decides before the power-on returns: it logs either
		// "nothing to boot" or "boot agent started" (with its PID), and
		// starts no process later.
		logb, _ := os.ReadFile(filepath.Join(dir, ServeLog))
		after := string(logb[min(from, len(logb)):])
		if !strings.Contains(after, "nothing to boot") || !strings.Contains(after, "unknown.iso: HTTP 404") {
			t.Errorf("serve.log does not say why %s booted nothing:\n%s", h.Name, after)
		}
		if strings.Contains(after, "boot agent started") {
			t.Errorf("%s started a boot agent from a 404 ISO:\n%s", h.Name, after)
		}
		if _, err := os.Stat(filepath.Join(h.Dir, "seen")); err == nil {
			t.Errorf("%s booted an agent from a 404 ISO", h.Name)
		}
		require.NoError(t, b.PowerOff(ctx))
	})

	t.Run("ipmi pxe", func(t *testing.T) {
		h := rep.Hosts[1]
		b := dial(h)
		require.NoError(t, b.SetBootDevice(ctx, bmc.BootPXE, false, false))
		require.NoError(t, b.PowerOn(ctx))
		got := seen(h)
		tok := iss.last(h2)
		require.NotEmpty(t, tok, "no token minted for %s", h2)
		want(t, h, got, "kiln.boot=pxe", "kiln.token="+tok, "kiln.host="+h2, "BOOTIF=01-"+strings.ReplaceAll(h.MAC, ":", "-"), "kiln.lab_disk="+h.Disk)
		mu.Lock()
		remote := remotes["/boot/ipxe/"+h2]
		mu.Unlock()
		if ip, _, _ := net.SplitHostPort(remote); ip != h.Address {
			t.Errorf("%s's iPXE script was fetched from %s, want from the host's own address %s", h2, remote, h.Address)
		}
		require.NoError(t, b.PowerOff(ctx))
	})

	logb, _ := os.ReadFile(filepath.Join(dir, ServeLog))
	for _, h := range []string{h1, h2} {
		for _, tok := range iss.minted[h] {
			if strings.Contains(string(logb), tok) {
				t.Errorf("the boot token of %s is in serve.log", h)
			}
		}
	}
	require.NoError(t, Down(ctx, dir, nil))
}
