package libvirt_test

import (
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
	"syscall"
	"testing"
	"time"

	golibvirt "github.com/digitalocean/go-libvirt"
	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"

	"github.com/kilnhq/kiln/bmc"
	"github.com/kilnhq/kiln/e2e/lab/libvirt"
	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/e2e/lab/redfish"
	"github.com/kilnhq/kiln/internal/errdefs"
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
	if media.dir != "" {
		os.RemoveAll(media.dir)
	}
	os.Exit(code)
}

func answers(socket string) bool {
	c, err := net.DialTimeout("unix", socket, time.Second)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// libvirtSocket returns the socket of a running libvirtd, or skips.
func libvirtSocket(t testing.TB) string {
	t.Helper()
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		testenv.Skip(t, "qemu-system-x86_64 not installed (apt-get install qemu-system-x86)")
	}
	daemon.once.Do(func() {
		if answers(libvirt.DefaultSocket) {
			daemon.socket = libvirt.DefaultSocket
			return
		}
		// Long: another package's private libvirtd may run (go test runs
		// packages in parallel) and only one can (libvirt.LockFile).
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
		defer cancel()
		var log *slog.Logger
		if testing.Verbose() {
			log = slog.New(slog.NewTextHandler(os.Stderr, nil))
		}
		daemon.d, daemon.err = libvirt.StartDaemon(ctx, libvirt.DaemonOptions{Logger: log})
		if daemon.err == nil {
			daemon.socket = daemon.d.Socket()
		}
	})
	if daemon.socket == "" {
		testenv.Skipf(t, "libvirtd not reachable at %s and a private one cannot start: %v", libvirt.DefaultSocket, daemon.err)
	}
	return daemon.socket
}

func newVM(t testing.TB, o libvirt.Options) *libvirt.VM {
	t.Helper()
	o.Socket = libvirtSocket(t)
	if o.Dir == "" {
		o.Dir = t.TempDir()
	}
	// Test temp dirs are 0700: QEMU runs as root to read them.
	o.RunAsRoot = true
	if testing.Verbose() {
		o.Logger = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	vm, err := libvirt.New(o)
	require.NoError(t, err)
	t.Cleanup(func() {
		pid := qemuPID(t, o.Name)
		require.NoError(t, vm.Close())
		if pid != 0 && syscall.Kill(pid, 0) == nil {
			t.Errorf("qemu pid %d of %s still runs after Close", pid, o.Name)
		}
		if lv, err := libvirt.Dial(o.Socket, ""); err == nil {
			if _, err := lv.DomainLookupByName(o.Name); !golibvirt.IsNotFound(err) {
				t.Errorf("domain %s is still defined after Close (lookup: %v)", o.Name, err)
			}
			_ = lv.Disconnect()
		}
		// libvirt's QEMU log of the domain (QEMU's own output: who
		// stopped it, "terminating on signal 15 from pid N").
		qemuLog := filepath.Join("/var/log/libvirt/qemu", o.Name+".log")
		if t.Failed() {
			b, _ := os.ReadFile(vm.SerialLog())
			t.Logf("serial console of %s:\n%s", o.Name, tail(string(b), 60))
			b, _ = os.ReadFile(qemuLog)
			t.Logf("QEMU log of %s (%s):\n%s", o.Name, qemuLog, tail(string(b), 30))
			if daemon.d != nil {
				b, _ = os.ReadFile(filepath.Join(daemon.d.Dir(), "libvirtd.log"))
				t.Logf("libvirtd log:\n%s", tail(string(b), 30))
			}
		}
		_ = os.Remove(qemuLog)
	})
	return vm
}

// qemuPID is the PID of the domain's QEMU from libvirt's pid file, 0 when
// it does not run.
func qemuPID(t testing.TB, name string) int {
	b, err := os.ReadFile(filepath.Join("/run/libvirt/qemu", name+".pid"))
	if err != nil {
		return 0
	}
	pid := 0
	for _, c := range strings.TrimSpace(string(b)) {
		pid = pid*10 + int(c-'0')
	}
	return pid
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// liveDomain reads the domain's definition as libvirt reports it.
func liveDomain(t *testing.T, vm *libvirt.VM) *libvirtxml.Domain {
	t.Helper()
	x, err := vm.XML()
	require.NoError(t, err)
	d := &libvirtxml.Domain{}
	require.NoError(t, d.Unmarshal(x))
	return d
}

// bootOrders maps "disk", "cd" and "pxe" to their <boot order> and
// returns the CD drive's source file.
func bootOrders(t *testing.T, d *libvirtxml.Domain) (map[string]uint, string) {
	t.Helper()
	got := map[string]uint{}
	cd := ""
	for _, disk := range d.Devices.Disks {
		name := map[string]string{"disk": "disk", "cdrom": "cd"}[disk.Device]
		if disk.Boot != nil {
			got[name] = disk.Boot.Order
		}
		if disk.Device == "cdrom" && disk.Source != nil && disk.Source.File != nil {
			cd = disk.Source.File.File
		}
	}
	for _, nic := range d.Devices.Interfaces {
		if nic.Boot != nil {
			got["pxe"] = nic.Boot.Order
		}
	}
	return got, cd
}

// TestPowerBootOrderAndMedia drives a TCG domain's power, boot order and
// virtual media through libvirtd without booting an OS (the firmware runs
// on a blank disk), checking what `virsh dumpxml` and `virsh domstate`
// would show.
func TestPowerBootOrderAndMedia(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	vm := newVM(t, libvirt.Options{Name: "kiln-lv-power", Dir: dir, DiskSize: 16 << 20, MemoryMB: 256, GracePeriod: 2 * time.Second})

	if _, err := libvirt.New(libvirt.Options{Name: "kiln-lv-power", Dir: t.TempDir(), DiskSize: 1 << 20, Socket: libvirtSocket(t)}); !errdefs.IsAlreadyExists(err) {
		t.Errorf("New() of a defined name = %v, want AlreadyExists", err)
	}
	d := liveDomain(t, vm)
	if d.Type != "qemu" {
		t.Errorf("domain type = %q, want qemu (TCG)", d.Type)
	}
	if vm.State() || vm.BootSource() != "" {
		t.Fatalf("new VM: State() = %v BootSource() = %q, want off and never booted", vm.State(), vm.BootSource())
	}
	if err := vm.Reset(ctx); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("Reset() of an off VM = %v, want FailedPrecondition", err)
	}

	// Media inserted while off is in the definition the VM starts with.
	iso := filepath.Join(dir, "first.iso")
	require.NoError(t, os.WriteFile(iso, make([]byte, 2048), 0o644))
	require.NoError(t, vm.InsertMedia("file://"+iso))
	require.NoError(t, vm.PowerOn(ctx, machine.BootCD))
	if !vm.State() {
		t.Fatalf("State() after PowerOn(cd) = off")
	}
	if pid := qemuPID(t, "kiln-lv-power"); pid == 0 || syscall.Kill(pid, 0) != nil {
		t.Fatalf("no QEMU runs after PowerOn (pid %d)", pid)
	}
	order, cd := bootOrders(t, liveDomain(t, vm))
	if order["cd"] != 1 || order["disk"] == 1 || order["pxe"] == 1 || cd != iso {
		t.Errorf("after PowerOn(cd): boot orders %v, cdrom %q; want cd first and %q", order, cd, iso)
	}
	// Power on of a running VM is a no-op.
	require.NoError(t, vm.PowerOn(ctx, machine.BootPXE))
	if vm.BootSource() != machine.BootCD {
		t.Errorf("BootSource() after a second PowerOn = %q, want cd", vm.BootSource())
	}
	require.NoError(t, vm.Reset(ctx))
	if !vm.State() {
		t.Errorf("State() after Reset = off")
	}

	// Live media changes: eject, then an http URL (downloaded).
	require.NoError(t, vm.InsertMedia(""))
	if _, cd := bootOrders(t, liveDomain(t, vm)); cd != "" {
		t.Errorf("cdrom after eject = %q, want empty", cd)
	}
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write(make([]byte, 4096))
	}))
	defer ts.Close()
	require.NoError(t, vm.InsertMedia(ts.URL+"/boot/iso/kiln-lv-power.iso"))
	_, cd = bootOrders(t, liveDomain(t, vm))
	if cd == "" || cd != vm.Media() || filepath.Dir(cd) != dir {
		t.Errorf("cdrom after inserting an http URL = %q (Media() %q), want the download in %s", cd, vm.Media(), dir)
	}

	require.NoError(t, vm.PowerOff(ctx, false))
	if vm.State() {
		t.Fatalf("State() after a hard PowerOff = on")
	}
	require.NoError(t, vm.PowerOff(ctx, false)) // off again: no-op

	// The new boot device is first in the next start's definition.
	require.NoError(t, vm.PowerOn(ctx, machine.BootPXE))
	order, _ = bootOrders(t, liveDomain(t, vm))
	if order["pxe"] != 1 || order["disk"] == 1 || order["cd"] == 1 {
		t.Errorf("after PowerOn(pxe): boot orders %v, want pxe first", order)
	}
	if vm.BootSource() != machine.BootPXE {
		t.Errorf("BootSource() = %q, want pxe", vm.BootSource())
	}
	// No OS answers the ACPI button: power is cut after the grace period.
	require.NoError(t, vm.PowerOff(ctx, true))
	if vm.State() {
		t.Errorf("State() after a graceful PowerOff with no OS = on")
	}
}

// TestRedfishDrivesDomain puts the lab's Redfish emulator in front of a
// libvirt domain and drives it with Kiln's bmc package, as the controller
// drives a rack: virtual media from a URL, a one-time PXE boot, power on
// and off. No OS boots (blank disk).
func TestRedfishDrivesDomain(t *testing.T) {
	dir := t.TempDir()
	vm := newVM(t, libvirt.Options{Name: "kiln-lv-redfish", Dir: dir, DiskSize: 16 << 20, MemoryMB: 256, MAC: "52:54:00:4b:69:22"})
	emu, err := redfish.New(redfish.Config{
		Username: "admin", Password: "lab-secret",
		Systems: []redfish.System{{ID: "kiln-lv-redfish", Machine: vm, MACs: []string{"52:54:00:4b:69:22"}}},
	})
	require.NoError(t, err)
	emu.Start()
	t.Cleanup(emu.Close)
	media := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write(make([]byte, 4096))
	}))
	defer media.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	b, err := bmc.Dial(ctx, bmc.Endpoint{Protocol: bmc.ProtocolRedfish, Address: emu.URL(), Username: "admin", Password: "lab-secret"}, bmc.Options{Name: "kiln-lv-redfish"})
	require.NoError(t, err)

	require.NoError(t, b.InsertVirtualMedia(ctx, media.URL+"/boot/iso/kiln-lv-redfish.iso"))
	if _, cd := bootOrders(t, liveDomain(t, vm)); cd == "" || filepath.Dir(cd) != dir {
		t.Errorf("cdrom after Redfish InsertMedia = %q, want the download in %s", cd, dir)
	}
	require.NoError(t, b.SetBootDevice(ctx, bmc.BootPXE, false, false))
	require.NoError(t, b.PowerOn(ctx))
	if !vm.State() || vm.BootSource() != machine.BootPXE {
		t.Fatalf("after Redfish PowerOn: State() = %v BootSource() = %q, want on from pxe", vm.State(), vm.BootSource())
	}
	if order, _ := bootOrders(t, liveDomain(t, vm)); order["pxe"] != 1 {
		t.Errorf("boot orders after a one-time PXE power on = %v, want pxe first", order)
	}
	if st, err := b.PowerState(ctx); err != nil || st != bmc.PowerOn {
		t.Errorf("PowerState() = %q, %v, want on", st, err)
	}
	require.NoError(t, b.PowerOff(ctx))
	if vm.State() {
		t.Errorf("domain still running after a Redfish ForceOff")
	}
	if st, err := b.PowerState(ctx); err != nil || st != bmc.PowerOff {
		t.Errorf("PowerState() after PowerOff = %q, %v, want off", st, err)
	}
}

// TestResetBootsBMCDevice: a domain reset while running (as its OS
// reboots it; here `virsh reset`) boots the device its BMC picks
// (SetNextBoot), as a server's firmware reads the BMC's boot override at
// POST: QEMU alone keeps the boot order the domain started with. A reset
// that keeps the device leaves the domain running as it is.
func TestResetBootsBMCDevice(t *testing.T) {
	ctx := context.Background()
	vm := newVM(t, libvirt.Options{Name: "kiln-lv-reset", DiskSize: 16 << 20, MemoryMB: 256})
	next := make(chan string, 4)
	asked := make(chan struct{}, 4)
	require.NoError(t, vm.SetNextBoot(func() string {
		asked <- struct{}{}
		select {
		case d := <-next:
			return d
		default:
			return machine.BootDisk
		}
	}))
	require.NoError(t, vm.PowerOn(ctx, machine.BootCD))
	pid := qemuPID(t, "kiln-lv-reset")
	require.NotZero(t, pid)
	virsh := func(args ...string) {
		t.Helper()
		out, err := exec.Command("virsh", append([]string{"-c", "qemu:///system?socket=" + libvirtSocket(t)}, args...)...).CombinedOutput()
		require.NoError(t, err, "virsh %s: %s", strings.Join(args, " "), out)
	}
	waitAsked := func() {
		t.Helper()
		select {
		case <-asked:
		case <-time.After(30 * time.Second):
			t.Fatal("the domain reset but its BMC was not asked for the boot device")
		}
	}

	// The BMC says disk now (a persistent override set while it ran).
	next <- machine.BootDisk
	virsh("reset", "kiln-lv-reset")
	waitAsked()
	require.Eventually(t, func() bool { return vm.BootSource() == machine.BootDisk && vm.State() }, 30*time.Second, 100*time.Millisecond,
		"BootSource() = %q after a reset with the BMC set to disk", vm.BootSource())
	order, _ := bootOrders(t, liveDomain(t, vm))
	require.Equal(t, uint(1), order["disk"], "live boot orders %v after the reset: want disk first", order)
	pid2 := qemuPID(t, "kiln-lv-reset")
	require.NotEqual(t, pid, pid2, "QEMU kept running: it would boot the CD again")

	// Disk again: the reset is QEMU's own; the same QEMU runs on.
	next <- machine.BootDisk
	virsh("reset", "kiln-lv-reset")
	waitAsked()
	time.Sleep(time.Second)
	require.Equal(t, pid2, qemuPID(t, "kiln-lv-reset"), "a reset keeping the boot device restarted QEMU")
	require.Equal(t, machine.BootDisk, vm.BootSource())
	require.True(t, vm.State())
}

// TestResetSurvivesStopAfterRestart: when the domain goes off right after
// a reset started it from another device (libvirtd handling the old
// QEMU's SIGTERM after the new QEMU is up stops the new one; here a
// `virsh destroy` of the new QEMU injects it), the reset starts it again
// from the BMC's device: a server whose firmware reset stays powered on.
func TestResetSurvivesStopAfterRestart(t *testing.T) {
	vm := newVM(t, libvirt.Options{Name: "kiln-lv-restop", DiskSize: 16 << 20, MemoryMB: 256})
	socket := libvirtSocket(t)
	pid := 0
	stopped := make(chan error, 1)
	require.NoError(t, vm.SetNextBoot(func() string {
		// Runs before the reset's destroy and start: stop the QEMU that
		// start brings up, as soon as it is up.
		go func() {
			deadline := time.Now().Add(30 * time.Second)
			for time.Now().Before(deadline) {
				st, _ := exec.Command("virsh", "-c", "qemu:///system?socket="+socket, "domstate", "kiln-lv-restop").Output()
				if p := qemuPID(t, "kiln-lv-restop"); p != 0 && p != pid && strings.TrimSpace(string(st)) == "running" {
					// Past the start's return (it sets running last).
					time.Sleep(200 * time.Millisecond)
					out, err := exec.Command("virsh", "-c", "qemu:///system?socket="+socket, "destroy", "kiln-lv-restop").CombinedOutput()
					if err != nil {
						err = fmt.Errorf("virsh destroy: %v: %s", err, out)
					}
					stopped <- err
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
			stopped <- fmt.Errorf("the reset did not start a new QEMU within 30s")
		}()
		return machine.BootDisk
	}))
	require.NoError(t, vm.PowerOn(context.Background(), machine.BootCD))
	pid = qemuPID(t, "kiln-lv-restop")
	require.NotZero(t, pid)
	out, err := exec.Command("virsh", "-c", "qemu:///system?socket="+socket, "reset", "kiln-lv-restop").CombinedOutput()
	require.NoError(t, err, "virsh reset: %s", out)
	select {
	case err := <-stopped:
		require.NoError(t, err)
	case <-time.After(60 * time.Second):
		t.Fatal("the reset did not start the domain again")
	}
	require.Eventually(t, func() bool { return vm.State() && vm.BootSource() == machine.BootDisk }, 30*time.Second, 100*time.Millisecond,
		"the domain stayed off after it went off right after its reset (State() = %v, BootSource() = %q)", vm.State(), vm.BootSource())
	order, _ := bootOrders(t, liveDomain(t, vm))
	require.Equal(t, uint(1), order["disk"], "live boot orders %v: want disk first", order)
}
