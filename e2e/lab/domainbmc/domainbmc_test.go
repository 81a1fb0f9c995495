package domainbmc_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"

	"github.com/kilnhq/kiln/bmc"
	"github.com/kilnhq/kiln/e2e/lab/domainbmc"
	"github.com/kilnhq/kiln/e2e/lab/libvirt"
	"github.com/kilnhq/kiln/internal/testenv"
)

// daemon is the libvirtd the tests use: the system one when its socket
// answers, else a private one started once per test process.
var daemon struct {
	once   sync.Once
	socket string
	d      *libvirt.Daemon
	err    error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if daemon.d != nil {
		_ = daemon.d.Close()
	}
	os.Exit(code)
}

func libvirtSocket(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root to reach (or start) libvirtd")
	}
	for tool, pkg := range map[string]string{"qemu-system-x86_64": "qemu-system-x86", "virsh": "libvirt-clients"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (apt-get install %s)", tool, pkg)
		}
	}
	daemon.once.Do(func() {
		if libvirt.Answers(libvirt.DefaultSocket) {
			daemon.socket = libvirt.DefaultSocket
			return
		}
		// Long: another package's private libvirtd may run (go test runs
		// packages in parallel) and only one can (libvirt.LockFile).
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
		defer cancel()
		daemon.d, daemon.err = libvirt.StartDaemon(ctx, libvirt.DaemonOptions{})
		if daemon.err == nil {
			daemon.socket = daemon.d.Socket()
		}
	})
	if daemon.socket == "" {
		testenv.Skipf(t, "libvirtd not reachable at %s and a private one cannot start: %v", libvirt.DefaultSocket, daemon.err)
	}
	return daemon.socket
}

// domainXML is a domain as a CI would write it by hand (docs/lab.md has
// the same one): BIOS, a raw virtio disk, an empty SATA CD drive, a
// virtio NIC on user-mode networking, the serial console in a file.
// bootXML is `<boot dev='hd'/>` in <os>, or "" for per-device
// `<boot order>`; QEMU runs as root (the test's directories are 0700).
const domainXML = `<domain type='qemu'>
  <name>%[1]s</name>
  <memory unit='MiB'>256</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    %[3]s
  </os>
  <features><acpi/></features>
  <on_poweroff>destroy</on_poweroff>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw'/>
      <source file='%[2]s/disk.raw'/>
      <target dev='vda' bus='virtio'/>
      %[4]s
    </disk>
    <disk type='file' device='cdrom'>
      <driver name='qemu' type='raw'/>
      <target dev='sda' bus='sata'/>
      <readonly/>
    </disk>
    <interface type='user'>
      <mac address='52:54:00:4b:70:01'/>
      <model type='virtio'/>
    </interface>
    <serial type='file'>
      <source path='%[2]s/serial.log'/>
      <target port='0'/>
    </serial>
  </devices>
  <seclabel type='static' model='dac' relabel='no'><label>+0:+0</label></seclabel>
</domain>
`

// TestRedfishDrivesExistingDomain defines a domain with virsh, serves a
// BMC in front of it (by name, and by UUID) and drives it with the
// controller's bmc client as the host lifecycle does: virtual media,
// one-time CD boot, power on, off, on again from disk, eject. Each step is
// checked with virsh; the password never reaches the log.
func TestRedfishDrivesExistingDomain(t *testing.T) {
	sock := libvirtSocket(t)
	for _, tc := range []struct {
		name          string
		osBoot        bool
		byUUID        bool
		bootXML, disk string
	}{
		{name: "os boot dev, by name", osBoot: true, bootXML: "<boot dev='hd'/>"},
		{name: "device boot order, by UUID", byUUID: true, disk: "<boot order='1'/>"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			dom := fmt.Sprintf("kiln-dbmc-%d-%v", os.Getpid()%100000, tc.byUUID)
			require.NoError(t, os.WriteFile(filepath.Join(dir, "disk.raw"), nil, 0o644))
			require.NoError(t, os.Truncate(filepath.Join(dir, "disk.raw"), 64<<20))
			xmlPath := filepath.Join(dir, "domain.xml")
			require.NoError(t, os.WriteFile(xmlPath, []byte(fmt.Sprintf(domainXML, dom, dir, tc.bootXML, tc.disk)), 0o644))
			virsh := func(args ...string) (string, error) {
				out, err := exec.Command("virsh", append([]string{"-c", "qemu:///system?socket=" + sock}, args...)...).CombinedOutput()
				return strings.TrimSpace(string(out)), err
			}
			out, err := virsh("define", xmlPath)
			require.NoError(t, err, "virsh define: %s", out)
			t.Cleanup(func() {
				_, _ = virsh("destroy", dom)
				_, _ = virsh("undefine", dom)
				_ = os.Remove(filepath.Join("/var/log/libvirt/qemu", dom+".log"))
			})
			id := dom
			if tc.byUUID {
				id, err = virsh("domuuid", dom)
				require.NoError(t, err, id)
			}

			const password = "s3cret-bmc-pw-77"
			var logs bytes.Buffer
			var logMu sync.Mutex
			srv, err := domainbmc.Start(context.Background(), domainbmc.Options{
				Domains: []string{id}, Password: password, Socket: sock, Dir: t.TempDir(),
				Logger: slog.New(slog.NewTextHandler(lockedWriter{&logMu, &logs}, nil)),
			})
			require.NoError(t, err)
			closed := false
			t.Cleanup(func() {
				if !closed {
					srv.Close()
				}
			})
			bmcs := srv.BMCs()
			require.Len(t, bmcs, 1)
			require.Equal(t, dom, bmcs[0].Domain)
			require.Equal(t, []string{"52:54:00:4b:70:01"}, bmcs[0].MACs)
			host, _, err := net.SplitHostPort(strings.TrimPrefix(bmcs[0].Redfish, "https://"))
			require.NoError(t, err)
			require.Equal(t, "127.0.0.1", host)

			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			b, err := bmc.Dial(ctx, bmc.Endpoint{Protocol: bmc.ProtocolRedfish, Address: bmcs[0].Redfish,
				Username: "admin", Password: password, InsecureSkipVerify: true}, bmc.Options{Name: dom})
			require.NoError(t, err)
			inv, err := b.Inventory(ctx)
			require.NoError(t, err)
			require.Equal(t, []string{"52:54:00:4b:70:01"}, inv.MACs)

			domstate := func() string {
				t.Helper()
				s, err := virsh("domstate", dom)
				require.NoError(t, err, s)
				return s
			}
			inactive := func() *libvirtxml.Domain {
				t.Helper()
				x, err := virsh("dumpxml", "--inactive", dom)
				require.NoError(t, err, x)
				d := &libvirtxml.Domain{}
				require.NoError(t, d.Unmarshal(x))
				return d
			}
			// first is the device that boots first in the definition: "hd",
			// "cdrom" or "network".
			first := func(d *libvirtxml.Domain) string {
				if tc.osBoot {
					require.NotEmpty(t, d.OS.BootDevices, "the domain keeps <os><boot dev>")
					return d.OS.BootDevices[0].Dev
				}
				require.Empty(t, d.OS.BootDevices)
				for _, dk := range d.Devices.Disks {
					if dk.Boot != nil && dk.Boot.Order == 1 {
						return map[string]string{"disk": "hd", "cdrom": "cdrom"}[dk.Device]
					}
				}
				for _, n := range d.Devices.Interfaces {
					if n.Boot != nil && n.Boot.Order == 1 {
						return "network"
					}
				}
				return ""
			}
			cdSource := func(d *libvirtxml.Domain) string {
				for _, dk := range d.Devices.Disks {
					if dk.Device == "cdrom" && dk.Source != nil && dk.Source.File != nil {
						return dk.Source.File.File
					}
				}
				return ""
			}

			require.Equal(t, "shut off", domstate())
			if st, err := b.PowerState(ctx); err != nil || st != bmc.PowerOff {
				t.Errorf("PowerState() = %q, %v; want off", st, err)
			}

			// Virtual media by URL: downloaded, then in the CD drive.
			iso := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				_, _ = w.Write(bytes.Repeat([]byte("kiln"), 1<<14))
			}))
			defer iso.Close()
			require.NoError(t, b.InsertVirtualMedia(ctx, iso.URL+"/boot/iso/h1.iso"))
			src := cdSource(inactive())
			require.NotEmpty(t, src, "virsh dumpxml --inactive: the CD drive has no source after InsertMedia")
			require.FileExists(t, src)

			// One-time CD boot, power on.
			require.NoError(t, b.SetBootDevice(ctx, bmc.BootCDROM, false, false))
			require.NoError(t, b.PowerOn(ctx))
			require.Equal(t, "running", domstate())
			require.Equal(t, "cdrom", first(inactive()), "boot order after a one-time CD override")
			live, err := virsh("dumpxml", dom)
			require.NoError(t, err)
			require.Contains(t, live, src, "the running domain's CD drive holds the media")

			require.NoError(t, b.PowerOff(ctx))
			require.Equal(t, "shut off", domstate())

			// The override was one-time: the next power on boots the disk.
			require.NoError(t, b.PowerOn(ctx))
			require.Equal(t, "running", domstate())
			require.Equal(t, "hd", first(inactive()), "boot order after the one-time override was used")

			// Eject while running: live and in the definition.
			require.NoError(t, b.EjectVirtualMedia(ctx))
			require.Empty(t, cdSource(inactive()), "CD source after eject")
			live, err = virsh("dumpxml", dom)
			require.NoError(t, err)
			require.NotContains(t, live, src)
			require.NoError(t, b.PowerOff(ctx))
			require.Equal(t, "shut off", domstate())

			require.NoError(t, srv.Close())
			closed = true
			if _, err := virsh("dominfo", dom); err != nil {
				t.Errorf("domain %s not defined any more after the BMC stopped: %v", dom, err)
			}
			logMu.Lock()
			defer logMu.Unlock()
			if strings.Contains(logs.String(), password) {
				t.Errorf("the BMC password is in the log")
			}
			if !strings.Contains(logs.String(), "BMC serving") {
				t.Errorf("log lacks the serving line:\n%s", logs.String())
			}
		})
	}
}

// TestStartErrors: what a user gets wrong is refused with a reason.
func TestStartErrors(t *testing.T) {
	sock := libvirtSocket(t)
	for _, tc := range []struct {
		name string
		o    domainbmc.Options
		want string
	}{
		{"no password", domainbmc.Options{Domains: []string{"x"}, Dir: t.TempDir(), Socket: sock}, "no password"},
		{"unknown domain", domainbmc.Options{Domains: []string{"kiln-no-such-domain"}, Password: "pw", Dir: t.TempDir(), Socket: sock}, `no domain named "kiln-no-such-domain"`},
		{"bad listen", domainbmc.Options{Domains: []string{"x"}, Password: "pw", Dir: t.TempDir(), Socket: sock, Listen: "nonsense"}, "want HOST:PORT"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := domainbmc.Start(context.Background(), tc.o)
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.want)
		})
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (w lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.w.Write(p)
}
