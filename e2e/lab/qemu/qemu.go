// Package qemu is the lab's QEMU machine backend: a real VM
// (qemu-system-x86_64, TCG, or KVM when asked for) behind the lab's
// machine.Machine interface, so the Redfish emulator and the ipmi_sim
// chassis program drive it like a server. Power, boot order and virtual
// media go through QMP: power on is system_reset + cont after the boot
// device's bootindex is made first (qom-set), power off is
// system_powerdown (graceful, ACPI) or stop (hard), virtual media is
// blockdev-change-medium / eject on an empty ide-cd drive.
//
// The VM's NIC is on QEMU user-mode networking (the guest reaches the
// host's loopback as 10.0.2.2) or on a tap in a lab network namespace
// (LabNet) where dnsmasq answers DHCP for PXE.
package qemu

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/internal/atomicfile"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// Network attaches the VM's NIC.
type Network struct {
	// Netns and Tap put the NIC on an existing tap device inside a named
	// network namespace (see LabNet); QEMU runs in that namespace.
	Netns, Tap string
	// HostFwd are user-mode port forwards ("tcp:127.0.0.1:17441-:7441")
	// when Tap is empty.
	HostFwd []string
}

// Options configure a VM.
type Options struct {
	// Name of the VM (QEMU -name, logs).
	Name string
	// Dir holds the VM's files (serial log, blank disk); required.
	Dir string
	// Disk is a raw disk image; "" creates a sparse blank DiskSize disk in Dir.
	Disk     string
	DiskSize int64
	// MAC of the NIC (default 52:54:00:4b:69:01).
	MAC string
	// MemoryMB (default 1024) and CPUs (default 1).
	MemoryMB, CPUs int
	// Accel is "tcg" or "kvm"; "" reads $KILN_QEMU_ACCEL and defaults to
	// tcg. (On the project's CI machines /dev/kvm exists but guests hang in
	// GRUB under it, so KVM is opt-in.)
	Accel string
	// Network of the NIC; the zero value is user-mode networking.
	Network Network
	// UEFI boots with OVMF (UEFICode, read-only, and a private copy of
	// UEFIVars in Dir) instead of SeaBIOS.
	UEFI bool
	// UEFICode and UEFIVars default to Debian's ovmf package
	// (/usr/share/OVMF/OVMF_CODE_4M.fd, OVMF_VARS_4M.fd).
	UEFICode, UEFIVars string
	// QEMU is the emulator binary (default qemu-system-x86_64).
	QEMU string
	// GracePeriod bounds a graceful power-off before power is cut
	// (default 60s, or the caller's ctx).
	GracePeriod time.Duration
	// RebootTimeout, when positive, makes firmware that found nothing to
	// boot reboot the machine after that long (`-boot
	// reboot-timeout=MS`), as servers retry their boot order; 0 leaves
	// QEMU's default (it waits forever).
	RebootTimeout time.Duration
	// Logger receives lifecycle messages; nil discards them.
	Logger *slog.Logger
}

// VM is a QEMU virtual machine. The QEMU process starts at the first power
// on (paused, with QMP) and lives until Close; power states in between
// are QEMU run states.
type VM struct {
	o      Options
	log    *slog.Logger
	sock   string
	sockDr string
	serial string
	sercon string

	mu    sync.Mutex
	cmd   *exec.Cmd
	done  chan struct{}
	qmp   *QMP
	boot  string
	media string
	on    bool // powered on by us (and not stopped)
	order []string
	// next, when set (SetNextBoot), is the device a guest reboot boots;
	// seen counts the QMP events already looked at for guest resets.
	next      func() string
	seen      int
	watchStop chan struct{}
}

var _ machine.Machine = (*VM)(nil)

// Device IDs of the VM.
const (
	devDisk = "disk0"
	devNIC  = "nic0"
	devCD   = "cd0dev"
	driveCD = "cd0"
)

// New returns a powered-off VM. It creates the blank disk when
// Options.Disk is empty. No QEMU runs until PowerOn.
func New(o Options) (*VM, error) {
	if o.Dir == "" {
		return nil, errdefs.InvalidArgument("qemu: a directory is required")
	}
	if o.Name == "" {
		o.Name = "kiln-vm"
	}
	if o.MAC == "" {
		o.MAC = "52:54:00:4b:69:01"
	}
	if o.MemoryMB <= 0 {
		o.MemoryMB = 1024
	}
	if o.CPUs <= 0 {
		o.CPUs = 1
	}
	if o.Accel == "" {
		o.Accel = os.Getenv("KILN_QEMU_ACCEL")
	}
	if o.Accel == "" {
		o.Accel = "tcg"
	}
	if o.QEMU == "" {
		o.QEMU = "qemu-system-x86_64"
	}
	if o.GracePeriod <= 0 {
		o.GracePeriod = time.Minute
	}
	if _, err := exec.LookPath(o.QEMU); err != nil {
		return nil, errdefs.NotFound("qemu: %s not found (apt-get install qemu-system-x86 ipxe-qemu)", o.QEMU)
	}
	if err := os.MkdirAll(o.Dir, 0o755); err != nil {
		return nil, fmt.Errorf("qemu: %w", err)
	}
	if o.UEFI {
		if o.UEFICode == "" {
			o.UEFICode = "/usr/share/OVMF/OVMF_CODE_4M.fd"
		}
		if o.UEFIVars == "" {
			o.UEFIVars = "/usr/share/OVMF/OVMF_VARS_4M.fd"
		}
		if _, err := os.Stat(o.UEFICode); err != nil {
			return nil, errdefs.NotFound("qemu: UEFI firmware %s not found (apt-get install ovmf)", o.UEFICode)
		}
		b, err := os.ReadFile(o.UEFIVars)
		if err != nil {
			return nil, errdefs.NotFound("qemu: UEFI variables %s not found (apt-get install ovmf)", o.UEFIVars)
		}
		vars := filepath.Join(o.Dir, "efivars.fd")
		if err := os.WriteFile(vars, b, 0o644); err != nil {
			return nil, fmt.Errorf("qemu: %w", err)
		}
		o.UEFIVars = vars
	}
	if o.Disk == "" {
		if o.DiskSize <= 0 {
			o.DiskSize = 1 << 30
		}
		o.Disk = filepath.Join(o.Dir, "disk.raw")
		f, err := os.OpenFile(o.Disk, os.O_CREATE|os.O_RDWR, 0o644)
		if err != nil {
			return nil, fmt.Errorf("qemu: disk: %w", err)
		}
		err = f.Truncate(o.DiskSize)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("qemu: disk: %w", err)
		}
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// unix socket paths are limited to 108 bytes: keep the socket short.
	sd, err := os.MkdirTemp("", "kiln-qmp-")
	if err != nil {
		return nil, fmt.Errorf("qemu: %w", err)
	}
	// etc/sercon-port: 0x3f8 (ttyS0) as a little-endian 16-bit integer.
	sercon := filepath.Join(o.Dir, "sercon-port")
	if err := os.WriteFile(sercon, []byte{0xf8, 0x03}, 0o644); err != nil {
		return nil, fmt.Errorf("qemu: %w", err)
	}
	return &VM{
		o: o, log: log.With("component", "qemu", "vm", o.Name),
		sockDr: sd, sock: filepath.Join(sd, "qmp.sock"),
		serial: filepath.Join(o.Dir, "serial.log"),
		sercon: sercon,
		order:  []string{devDisk, devNIC, devCD},
	}, nil
}

// SerialLog is the path of the file that receives the VM's serial
// console (ttyS0), appended across boots.
func (v *VM) SerialLog() string { return v.serial }

// SocketDir is the directory of the QMP socket (under $TMPDIR, created
// by New, removed by Close), for callers that track what to clean up.
func (v *VM) SocketDir() string { return v.sockDr }

// PID is the QEMU process ID, 0 when no QEMU runs.
func (v *VM) PID() int {
	v.mu.Lock()
	defer v.mu.Unlock()
	if !v.runningLocked() {
		return 0
	}
	return v.cmd.Process.Pid
}

func (v *VM) args() []string {
	a := []string{
		"-name", v.o.Name,
		"-machine", "q35", "-accel", v.o.Accel,
		"-m", fmt.Sprint(v.o.MemoryMB), "-smp", fmt.Sprint(v.o.CPUs),
		"-nodefaults", "-display", "none", "-vga", "none",
		"-S", "-no-shutdown",
		"-qmp", "unix:" + v.sock + ",server=on,wait=off",
	}
	if v.o.RebootTimeout > 0 {
		a = append(a, "-boot", fmt.Sprintf("reboot-timeout=%d", v.o.RebootTimeout.Milliseconds()))
	}
	a = append(a,
		"-chardev", "file,id=ser0,path="+v.serial+",append=on",
		"-serial", "chardev:ser0",
	)
	if v.o.UEFI {
		a = append(a,
			"-drive", "if=pflash,format=raw,unit=0,readonly=on,file="+v.o.UEFICode,
			"-drive", "if=pflash,format=raw,unit=1,file="+v.o.UEFIVars)
	} else {
		// SeaBIOS mirrors its console (its own messages, the iPXE ROM's,
		// GRUB's before grub.cfg) to the serial port named here.
		a = append(a, "-fw_cfg", "name=etc/sercon-port,file="+v.sercon)
	}
	if v.o.Network.Tap != "" {
		a = append(a, "-netdev", "tap,id=n0,ifname="+v.o.Network.Tap+",script=no,downscript=no")
	} else {
		nd := "user,id=n0,restrict=off"
		for _, f := range v.o.Network.HostFwd {
			nd += ",hostfwd=" + f
		}
		a = append(a, "-netdev", nd)
	}
	a = append(a,
		"-device", "virtio-net-pci,netdev=n0,id="+devNIC+",mac="+v.o.MAC+",bootindex=2",
		"-drive", "file="+v.o.Disk+",format=raw,if=none,id=d0",
		"-device", "virtio-blk-pci,drive=d0,id="+devDisk+",bootindex=1",
		"-drive", "if=none,id="+driveCD+",media=cdrom,readonly=on",
		"-device", "ide-cd,drive="+driveCD+",id="+devCD+",bootindex=3",
	)
	return a
}

// start launches QEMU paused and connects QMP.
func (v *VM) startLocked(ctx context.Context) error {
	_ = os.Remove(v.sock)
	name, args := v.o.QEMU, v.args()
	if v.o.Network.Netns != "" {
		args = append([]string{"netns", "exec", v.o.Network.Netns, name}, args...)
		name = "ip"
	}
	cmd := exec.Command(name, args...)
	out, err := os.OpenFile(filepath.Join(v.o.Dir, "qemu.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("qemu: %w", err)
	}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	err = cmd.Start()
	out.Close()
	if err != nil {
		return fmt.Errorf("qemu: start: %w", err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	v.cmd, v.done = cmd, done
	dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	go func() {
		select {
		case <-done:
			cancel() // QEMU died: stop dialing
		case <-dctx.Done():
		}
	}()
	q, err := DialQMP(dctx, v.sock)
	if err != nil {
		v.killLocked()
		b, _ := os.ReadFile(filepath.Join(v.o.Dir, "qemu.log"))
		return fmt.Errorf("qemu: %w; qemu.log: %s", err, lastLine(string(b)))
	}
	v.qmp = q
	v.seen = 0
	v.order = []string{devDisk, devNIC, devCD}
	v.log.Info("qemu started", "pid", cmd.Process.Pid, "accel", v.o.Accel)
	if v.media != "" {
		if err := v.changeMediumLocked(ctx, v.media); err != nil {
			return err
		}
	}
	return nil
}

func lastLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		return s[i+1:]
	}
	return s
}

func (v *VM) runningLocked() bool {
	if v.cmd == nil {
		return false
	}
	select {
	case <-v.done:
		return false
	default:
		return true
	}
}

// killLocked stops QEMU by PID. Equivalent to `kill -KILL -PGID`.
func (v *VM) killLocked() {
	if v.qmp != nil {
		v.qmp.Close()
		v.qmp = nil
	}
	if v.runningLocked() {
		_ = syscall.Kill(-v.cmd.Process.Pid, syscall.SIGKILL)
		<-v.done
	}
}

// bootDevices maps the lab's boot devices to QEMU device IDs.
var bootDevices = map[string]string{machine.BootDisk: devDisk, machine.BootPXE: devNIC, machine.BootCD: devCD}

// setBootFirstLocked makes dev the first boot device. Every bootindex
// stays unique at every step (QEMU refuses duplicates): first all move to
// 11.., then to 1.. in the new order. Equivalent to
// `{"execute":"qom-set","arguments":{"path":"/machine/peripheral/ID","property":"bootindex","value":N}}`.
func (v *VM) setBootFirstLocked(ctx context.Context, dev string) error {
	if v.order[0] == dev {
		return nil
	}
	order := []string{dev}
	for _, d := range v.order {
		if d != dev {
			order = append(order, d)
		}
	}
	for _, base := range []int{11, 1} {
		for i, d := range order {
			if err := v.qmp.Execute(ctx, "qom-set", map[string]any{
				"path": "/machine/peripheral/" + d, "property": "bootindex", "value": base + i,
			}, nil); err != nil {
				return fmt.Errorf("qemu: boot order: %w", err)
			}
		}
	}
	v.order = order
	return nil
}

// PowerOn implements machine.Machine: it starts QEMU if needed, makes
// bootDevice first in the boot order, and resets and resumes the VM.
// Equivalent to qom-set bootindex, `system_reset` and `cont`.
func (v *VM) PowerOn(ctx context.Context, bootDevice string) error {
	if err := machine.ValidBootDevice(bootDevice); err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if !v.runningLocked() {
		if err := v.startLocked(ctx); err != nil {
			return err
		}
	} else if on, err := v.stateLocked(ctx); err != nil {
		return err
	} else if on {
		return nil
	}
	if err := v.setBootFirstLocked(ctx, bootDevices[bootDevice]); err != nil {
		return err
	}
	if err := v.qmp.Execute(ctx, "system_reset", nil, nil); err != nil {
		return fmt.Errorf("qemu: power on: %w", err)
	}
	if err := v.qmp.Execute(ctx, "cont", nil, nil); err != nil {
		return fmt.Errorf("qemu: power on: %w", err)
	}
	v.boot, v.on = bootDevice, true
	v.log.Info("powered on", "boot", bootDevice)
	return nil
}

// stateLocked asks QEMU whether the VM runs: "running" is on; "shutdown"
// (the guest powered off), "paused" (hard off) and "prelaunch" are off.
func (v *VM) stateLocked(ctx context.Context) (bool, error) {
	if !v.runningLocked() || v.qmp == nil {
		return false, nil
	}
	st, err := v.qmp.QueryStatus(ctx)
	if err != nil {
		return false, err
	}
	return st.Status == "running" || st.Status == "debug" || st.Status == "io-error", nil
}

// PowerOff implements machine.Machine. Graceful presses the ACPI power
// button (`system_powerdown`) and waits for the guest to power off, up to
// GracePeriod or ctx, then cuts power; hard off stops the VM (`stop`).
func (v *VM) PowerOff(ctx context.Context, graceful bool) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	on, err := v.stateLocked(ctx)
	if err != nil {
		return err
	}
	if !on {
		v.on = false
		return nil
	}
	if graceful {
		if err := v.qmp.Execute(ctx, "system_powerdown", nil, nil); err != nil {
			return fmt.Errorf("qemu: power off: %w", err)
		}
		wctx, cancel := context.WithTimeout(ctx, v.o.GracePeriod)
		for {
			if on, err := v.stateLocked(wctx); err == nil && !on {
				cancel()
				v.on = false
				v.log.Info("shut down")
				return nil
			}
			select {
			case <-wctx.Done():
			case <-time.After(200 * time.Millisecond):
				continue
			}
			break
		}
		cancel()
		v.log.Warn("guest did not shut down; cutting power")
	}
	// The caller's ctx may be done; cutting power must still happen.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := v.qmp.Execute(cctx, "stop", nil, nil); err != nil {
		return fmt.Errorf("qemu: power off: %w", err)
	}
	v.on = false
	v.log.Info("powered off")
	return nil
}

// Reset implements machine.Machine. Equivalent to `system_reset`.
func (v *VM) Reset(ctx context.Context) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	on, err := v.stateLocked(ctx)
	if err != nil {
		return err
	}
	if !on {
		return errdefs.FailedPrecondition("reset: machine is off")
	}
	if err := v.qmp.Execute(ctx, "system_reset", nil, nil); err != nil {
		return fmt.Errorf("qemu: reset: %w", err)
	}
	return nil
}

// State implements machine.Machine.
func (v *VM) State() bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	on, err := v.stateLocked(ctx)
	if err != nil {
		v.log.Warn("query-status failed", "error", err)
		return false
	}
	return on
}

// InsertMedia implements machine.Machine: url (http(s):// read by QEMU's
// curl driver with Range requests, or a local path) goes into the virtual
// CD drive; "" ejects. Equivalent to `blockdev-change-medium` / `eject`.
func (v *VM) InsertMedia(url string) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.media = url
	if !v.runningLocked() {
		return nil // inserted when QEMU starts
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	return v.changeMediumLocked(ctx, url)
}

func (v *VM) changeMediumLocked(ctx context.Context, url string) error {
	if url == "" {
		if err := v.qmp.Execute(ctx, "eject", map[string]any{"id": devCD, "force": true}, nil); err != nil {
			return fmt.Errorf("qemu: eject: %w", err)
		}
		return nil
	}
	filename := strings.TrimPrefix(url, "file://")
	change := func(filename string) error {
		return v.qmp.Execute(ctx, "blockdev-change-medium", map[string]any{
			"id": devCD, "filename": filename, "format": "raw", "read-only-mode": "read-only",
		}, nil)
	}
	err := change(filename)
	if err != nil && (strings.HasPrefix(url, "http://") || strings.HasPrefix(url, "https://")) {
		// QEMU without its curl block driver (Debian qemu-block-extra):
		// fetch the image and insert the local copy.
		v.log.Warn("qemu cannot read the media URL itself; downloading it", "url", url, "error", err)
		local := filepath.Join(v.o.Dir, "media.iso")
		if err = download(ctx, url, local); err == nil {
			err = change(local)
		}
	}
	if err != nil {
		return fmt.Errorf("qemu: insert media %s: %w", url, err)
	}
	v.log.Info("media inserted", "url", url)
	return nil
}

// download fetches url into path (via a temporary name).
func download(ctx context.Context, url, path string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return atomicfile.WriteFunc(path, 0o644, func(w io.Writer) error {
		if _, err := io.Copy(w, resp.Body); err != nil {
			return fmt.Errorf("GET %s: %w", url, err)
		}
		return nil
	})
}

// BootSource implements machine.Machine.
func (v *VM) BootSource() string {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.boot
}

// QMP returns the VM's QMP client (nil before the first power on), for
// tests that inspect the VM.
func (v *VM) QMP() *QMP {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.qmp
}

// SetNextBoot makes a guest reboot boot next() (a machine boot device,
// e.g. what the host's BMC sets; "" keeps the device of the last power
// on), as a server's firmware reads its BMC's boot override at every
// POST. QEMU alone resets into the boot order of the last power on: a
// boot agent that reboots the machine to boot from disk would boot its
// ISO again. A goroutine polls QMP every second until Close; on a guest
// reset (a RESET event with reason guest-reset) whose next device is not
// first in the boot order it makes it first and resets the VM again
// (the firmware has only begun its POST). Equivalent to qom-set
// bootindex and `system_reset`.
func (v *VM) SetNextBoot(next func() string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.next = next
	if v.watchStop == nil {
		v.watchStop = make(chan struct{})
		go v.watchResets(v.watchStop)
	}
}

// resetPoll is how often watchResets asks QEMU for guest resets.
const resetPoll = time.Second

func (v *VM) watchResets(stop chan struct{}) {
	t := time.NewTicker(resetPoll)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		if err := v.rebootIfReset(); err != nil {
			v.log.Warn("guest reboot: booting the BMC's device failed", "error", err)
		}
	}
}

// rebootIfReset boots the VM again from next() when the guest reset
// itself since the last look.
func (v *VM) rebootIfReset() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if !v.runningLocked() || v.qmp == nil || v.next == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Any command collects the events that arrived since the last one.
	if _, err := v.qmp.QueryStatus(ctx); err != nil {
		return err
	}
	evs := v.qmp.Events()
	reset := false
	for _, e := range evs[min(v.seen, len(evs)):] {
		var d struct {
			Reason string `json:"reason"`
		}
		if e.Name == "RESET" && json.Unmarshal(e.Data, &d) == nil && d.Reason == "guest-reset" {
			reset = true
		}
	}
	v.seen = len(evs)
	if !reset {
		return nil
	}
	dev := v.next()
	if dev == "" {
		dev = v.boot
	}
	if err := machine.ValidBootDevice(dev); err != nil {
		return err
	}
	if v.order[0] == bootDevices[dev] {
		v.boot = dev
		return nil
	}
	if err := v.setBootFirstLocked(ctx, bootDevices[dev]); err != nil {
		return err
	}
	if err := v.qmp.Execute(ctx, "system_reset", nil, nil); err != nil {
		return fmt.Errorf("qemu: reboot: %w", err)
	}
	v.boot = dev
	v.log.Info("guest rebooted; booting the next device", "boot", dev)
	return nil
}

// Close ends QEMU (`quit`, then SIGKILL by PID after 5 s) and removes the
// QMP socket. The VM's directory is left to its owner.
func (v *VM) Close() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.watchStop != nil {
		close(v.watchStop)
		v.watchStop = nil
	}
	if v.runningLocked() && v.qmp != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		// quit's answer may be lost as QEMU exits: wait for the process.
		_ = v.qmp.Execute(ctx, "quit", nil, nil)
		cancel()
		select {
		case <-v.done:
		case <-time.After(5 * time.Second):
		}
	}
	v.killLocked()
	return os.RemoveAll(v.sockDr)
}
