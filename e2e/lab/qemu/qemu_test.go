package qemu_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/e2e/lab/qemu"
	"github.com/kilnhq/kiln/imagebuilder/bootmedia"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

func needQEMU(t testing.TB) {
	t.Helper()
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		testenv.Skip(t, "qemu-system-x86_64 not installed (apt-get install qemu-system-x86 ipxe-qemu)")
	}
}

func newVM(t testing.TB, o qemu.Options) *qemu.VM {
	t.Helper()
	if o.Dir == "" {
		o.Dir = t.TempDir()
	}
	vm, err := qemu.New(o)
	require.NoError(t, err)
	t.Cleanup(func() {
		pid := vm.PID()
		require.NoError(t, vm.Close())
		if pid != 0 && syscall.Kill(pid, 0) == nil {
			t.Errorf("qemu pid %d still runs after Close", pid)
		}
		if t.Failed() {
			b, _ := os.ReadFile(vm.SerialLog())
			t.Logf("serial console of %s:\n%s", o.Name, tail(string(b), 60))
		}
	})
	return vm
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func bootindex(t *testing.T, vm *qemu.VM, dev string) int {
	t.Helper()
	var v int
	require.NoError(t, vm.QMP().Execute(context.Background(), "qom-get", map[string]any{
		"path": "/machine/peripheral/" + dev, "property": "bootindex"}, &v))
	return v
}

// TestPowerAndBootOrderOverQMP drives a VM's power, boot order and
// virtual media through QMP without booting an OS (the firmware runs on
// a blank disk).
func TestPowerAndBootOrderOverQMP(t *testing.T) {
	needQEMU(t)
	ctx := context.Background()
	vm := newVM(t, qemu.Options{Name: "qmp-test", DiskSize: 16 << 20, GracePeriod: 2 * time.Second})
	if vm.State() || vm.BootSource() != "" || vm.PID() != 0 {
		t.Fatalf("new VM: State() = %v BootSource() = %q PID() = %d, want off and never booted", vm.State(), vm.BootSource(), vm.PID())
	}
	if err := vm.Reset(ctx); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("Reset() of an off VM = %v, want FailedPrecondition", err)
	}

	iso := filepath.Join(t.TempDir(), "media.iso")
	require.NoError(t, os.WriteFile(iso, make([]byte, 1<<20), 0o644))
	require.NoError(t, vm.InsertMedia(iso)) // before QEMU runs: inserted at start

	require.NoError(t, vm.PowerOn(ctx, machine.BootPXE))
	pid := vm.PID()
	if !vm.State() || vm.BootSource() != machine.BootPXE {
		t.Fatalf("after PowerOn(pxe): State() = %v BootSource() = %q, want on, pxe", vm.State(), vm.BootSource())
	}
	for dev, want := range map[string]int{"nic0": 1, "disk0": 2, "cd0dev": 3} {
		if got := bootindex(t, vm, dev); got != want {
			t.Errorf("after PowerOn(pxe) bootindex(%s) = %d, want %d", dev, got, want)
		}
	}
	var blocks []struct {
		Device   string `json:"device"`
		Inserted *struct {
			File string `json:"file"`
		} `json:"inserted"`
	}
	require.NoError(t, vm.QMP().Execute(ctx, "query-block", nil, &blocks))
	found := false
	for _, b := range blocks {
		if b.Device == "cd0" && b.Inserted != nil && b.Inserted.File == iso {
			found = true
		}
	}
	if !found {
		b, _ := json.Marshal(blocks)
		t.Errorf("query-block = %s, want %s in cd0", b, iso)
	}

	// Power on again is a no-op; Reset keeps the VM on.
	require.NoError(t, vm.PowerOn(ctx, machine.BootCD))
	if vm.BootSource() != machine.BootPXE {
		t.Errorf("second PowerOn changed the boot source to %q", vm.BootSource())
	}
	require.NoError(t, vm.Reset(ctx))
	require.True(t, vm.State())

	require.NoError(t, vm.PowerOff(ctx, false))
	if vm.State() {
		t.Fatalf("State() after a hard PowerOff = on")
	}
	require.NoError(t, vm.PowerOff(ctx, false)) // off again: no-op

	require.NoError(t, vm.InsertMedia(""))
	require.NoError(t, vm.PowerOn(ctx, machine.BootCD))
	if got := bootindex(t, vm, "cd0dev"); got != 1 {
		t.Errorf("after PowerOn(cd) bootindex(cd0dev) = %d, want 1", got)
	}
	if vm.PID() != pid {
		t.Errorf("power cycle restarted QEMU (pid %d -> %d); want the same process", pid, vm.PID())
	}
	if err := vm.PowerOn(ctx, "floppy"); !errdefs.IsInvalidArgument(err) {
		t.Errorf("PowerOn(floppy) = %v, want InvalidArgument", err)
	}

	// No OS answers the ACPI power button: a graceful power off cuts power
	// after the grace period.
	require.NoError(t, vm.PowerOff(ctx, true))
	if vm.State() {
		t.Errorf("State() after a graceful PowerOff with no OS = on, want power cut after the grace period")
	}
	var names []string
	for _, e := range vm.QMP().Events() {
		names = append(names, e.Name)
	}
	if got := strings.Join(names, " "); !strings.Contains(got, "RESET") || !strings.Contains(got, "POWERDOWN") || !strings.Contains(got, "STOP") {
		t.Errorf("QMP events = %s, want RESET, POWERDOWN and STOP among them", got)
	}

	// QEMU's errors come back as QMPError.
	err := vm.QMP().Execute(ctx, "no-such-command", nil, nil)
	var qe *qemu.QMPError
	if !errors.As(err, &qe) || qe.Class != "CommandNotFound" {
		t.Errorf("Execute(no-such-command) = %v, want a CommandNotFound QMPError", err)
	}
}

func TestNewValidates(t *testing.T) {
	if _, err := qemu.New(qemu.Options{}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("New(no dir) = %v, want InvalidArgument", err)
	}
	if _, err := qemu.New(qemu.Options{Dir: t.TempDir(), QEMU: "/nonexistent/qemu"}); !errdefs.IsNotFound(err) {
		t.Errorf("New(missing qemu) = %v, want NotFound", err)
	}
}

func waitSerial(t testing.TB, vm *qemu.VM, want string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		b, _ := os.ReadFile(vm.SerialLog())
		if strings.Contains(consoleText(b), want) {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Fatalf("serial console never showed %q within %s", want, timeout)
}

// TestInsertMediaURL inserts virtual media by URL: a server with Range
// support is read by QEMU itself (curl driver), as a BMC streams virtual
// media; one without is downloaded first.
func TestInsertMediaURL(t *testing.T) {
	needQEMU(t)
	iso := make([]byte, 1<<20)
	ranged := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.ServeContent(w, r, "media.iso", time.Time{}, bytes.NewReader(iso))
	}))
	t.Cleanup(ranged.Close)
	plain := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write(iso) // no Accept-Ranges, no Range
	}))
	t.Cleanup(plain.Close)

	dir := t.TempDir()
	vm := newVM(t, qemu.Options{Name: "media-test", Dir: dir, DiskSize: 16 << 20})
	ctx := context.Background()
	require.NoError(t, vm.PowerOn(ctx, machine.BootDisk))
	for _, tc := range []struct {
		url, wantFile string
	}{
		{ranged.URL + "/media.iso", ranged.URL + "/media.iso"},
		{plain.URL + "/media.iso", filepath.Join(dir, "media.iso")},
	} {
		require.NoError(t, vm.InsertMedia(tc.url))
		if got := insertedMedia(t, vm); got != tc.wantFile {
			t.Errorf("InsertMedia(%q): cd0 holds %q, want %q", tc.url, got, tc.wantFile)
		}
	}
	require.NoError(t, vm.InsertMedia(""))
	if got := insertedMedia(t, vm); got != "" {
		t.Errorf("after InsertMedia(\"\") cd0 holds %q, want nothing", got)
	}
}

func insertedMedia(t *testing.T, vm *qemu.VM) string {
	t.Helper()
	var blocks []struct {
		Device   string `json:"device"`
		Inserted *struct {
			File string `json:"file"`
		} `json:"inserted"`
	}
	require.NoError(t, vm.QMP().Execute(context.Background(), "query-block", nil, &blocks))
	for _, b := range blocks {
		if b.Device == "cd0" && b.Inserted != nil {
			return b.Inserted.File
		}
	}
	return ""
}

func TestConsoleText(t *testing.T) {
	// As captured from a disk boot under load.
	for _, in := range []string{
		"Booting from Hard Disk...\r\nGRUB loading.\r\n\x1b[0;30;47mWelcome \x1b[10;08H\x1b[10;09Hto GRUB!\r\n\x1bc\x1b[?7l\x1b[2J\x1b[0mSeaBIOS",
		"Booting from Hard Disk...\r\nGRUB loading.\r\n\x1b[0;30;47mW\r\x1b[10;02Helcome to GRUB\x1b[10;15H\x1b[10;16H!\r\n\x1bcSeaBIOS",
	} {
		want := "Booting from Hard Disk...\nGRUB loading.\nWelcome to GRUB!\nSeaBIOS"
		if got := consoleText([]byte(in)); got != want {
			t.Errorf("consoleText(%q) = %q, want %q", in, got, want)
		}
	}
	if got := consoleText([]byte("cut \x1b[10;0")); got != "cut " {
		t.Errorf("consoleText(a cut sequence) = %q, want %q", got, "cut ")
	}
}

// firmwareTimeout bounds one power on until the boot loader shows on the
// serial console: well under a second when idle, but TCG on a loaded
// 2-core machine (a full `go test ./...` with other VMs and ISO builds
// running) can be a hundred times slower.
const firmwareTimeout = 3 * time.Minute

// TestBootDeviceSelection powers a VM on from disk, CD and network in turn
// and checks on the serial console that the firmware boots from that
// device: the disk and the CD hold a hybrid GRUB ISO (GRUB's banner shows),
// the network boots QEMU's iPXE ROM. The ISO's kernel is a 12-byte fake:
// GRUB, if left running, fails to load it ("premature end of file").
func TestBootDeviceSelection(t *testing.T) {
	needQEMU(t)
	if _, err := exec.LookPath("grub-mkrescue"); err != nil {
		testenv.Skip(t, "grub-mkrescue not installed (grub-common grub-pc-bin xorriso mtools)")
	}
	dir := t.TempDir()
	iso := filepath.Join(dir, "grub.iso")
	for _, f := range []string{"vmlinuz", "initrd.img"} {
		require.NoError(t, os.WriteFile(filepath.Join(dir, f), []byte("not a kernel"), 0o644))
	}
	require.NoError(t, bootmedia.BuildISO(context.Background(), bootmedia.ExecRunner{},
		filepath.Join(dir, "vmlinuz"), filepath.Join(dir, "initrd.img"), "console=ttyS0", iso))
	b, err := os.ReadFile(iso)
	require.NoError(t, err)
	disk := filepath.Join(dir, "disk.raw")
	require.NoError(t, os.WriteFile(disk, b, 0o644)) // a hybrid ISO boots as a disk too

	vm := newVM(t, qemu.Options{Name: "bootdev", Dir: t.TempDir(), Disk: disk})
	ctx := context.Background()
	for _, tc := range []struct {
		dev, media string
		want       []string
	}{
		{machine.BootDisk, "", []string{"Booting from Hard Disk", "Welcome to GRUB"}},
		{machine.BootCD, iso, []string{"Booting from DVD/CD", "Welcome to GRUB"}},
		{machine.BootPXE, "", []string{"iPXE"}},
	} {
		require.NoError(t, vm.InsertMedia(tc.media))
		st, _ := os.Stat(vm.SerialLog())
		var offset int64
		if st != nil {
			offset = st.Size()
		}
		t0 := time.Now()
		require.NoError(t, vm.PowerOn(ctx, tc.dev))
		for _, w := range tc.want {
			waitSerialAfter(t, vm, offset, w, firmwareTimeout)
		}
		t.Logf("power on from %s: firmware and boot loader up after %.1fs", tc.dev, time.Since(t0).Seconds())
		require.NoError(t, vm.PowerOff(ctx, false))
	}
}

// waitSerialAfter waits until the serial console, from offset on, shows
// want, in consoleText. The console is read once more at the deadline, so
// a slow poll (a loaded machine) cannot miss a line that came in time.
func waitSerialAfter(t *testing.T, vm *qemu.VM, offset int64, want string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		b, _ := os.ReadFile(vm.SerialLog())
		b = b[min(offset, int64(len(b))):]
		if strings.Contains(consoleText(b), want) {
			return
		}
		if !time.Now().Before(deadline) {
			t.Fatalf("serial console never showed %q after power on (%s); it shows:\n%q", want, timeout, tail(string(b), 20))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// consoleText is serial console output without terminal escape sequences
// and carriage returns.
// SeaBIOS's serial console (sercon), which carries the firmware's, iPXE's
// and GRUB's BIOS-console text, holds back one character and flushes it
// from its periodic event check too; a flush between two characters puts
// cursor moves into the text: "Welcome \x1b[10;08H\x1b[10;09Hto GRUB!",
// or "W\r\x1b[10;02Helcome to GRUB".
// The slower the guest runs against the host's clock (TCG on a loaded
// machine), the likelier that is.
func consoleText(b []byte) string {
	var out strings.Builder
	for i := 0; i < len(b); i++ {
		if b[i] == '\r' {
			continue
		}
		if b[i] != 0x1b {
			out.WriteByte(b[i])
			continue
		}
		if i+1 < len(b) && b[i+1] == '[' { // CSI: parameters, then a final byte @..~
			i += 2
			for i < len(b) && (b[i] < 0x40 || b[i] > 0x7e) {
				i++
			}
			continue
		}
		i++ // a two-byte sequence such as ESC c
	}
	return out.String()
}
