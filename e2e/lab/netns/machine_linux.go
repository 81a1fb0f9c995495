package netns

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/e2e/lab/nspawn"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// nspawnRebootCode is systemd-nspawn's exit status when the container
// asked for a reboot.
const nspawnRebootCode = 133

// Machine is one network-namespace host. It implements machine.Machine;
// methods are safe for concurrent use.
type Machine struct {
	o                               Options
	log                             *slog.Logger
	ns, veth, name                  string
	disk, mnt, console, cmdlinePath string

	op sync.Mutex // serialises power actions

	mu        sync.Mutex // guards the fields below
	on        bool
	dev       string
	media     string
	cur       *boot
	launches  int
	lastError string
	nextBoot  func() string
}

var _ machine.Machine = (*Machine)(nil)

// boot is one power-on that runs something: the boot agent, or nspawn
// relaunched across reboots.
type boot struct {
	nspawn   bool
	stop     chan struct{} // closed: stopping, do not relaunch
	stopOnce sync.Once
	done     chan struct{} // closed when the boot has ended and is cleaned up

	mu  sync.Mutex
	pid int // the running agent or nspawn process, 0 when none
}

func (b *boot) requestStop() { b.stopOnce.Do(func() { close(b.stop) }) }

func (b *boot) stopping() bool {
	select {
	case <-b.stop:
		return true
	default:
		return false
	}
}

func (b *boot) getPID() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.pid
}

// New makes (or adopts, when they exist) the host's network namespace,
// veth and disk file, and returns it powered off. Only what it creates is
// reported to Options.Track. It returns
// InvalidArgument for bad options, FailedPrecondition when not root or
// `ip` is missing, and the failing command's output otherwise. Equivalent
// to:
//
//	ip netns add kiln-LAB-HOST
//	ip link add VETH type veth peer name VETHp; ip link set VETHp netns kiln-LAB-HOST
//	ip -n kiln-LAB-HOST link set VETHp name eth0 address MAC up
//	ip link set VETH master BRIDGE up
//	ip -n kiln-LAB-HOST addr add ADDRESS dev eth0; ip -n kiln-LAB-HOST route add default via GATEWAY
//	truncate -s DISKSIZE STATEDIR/disk.raw
func New(ctx context.Context, o Options) (*Machine, error) {
	if err := o.defaults(); err != nil {
		return nil, err
	}
	if os.Geteuid() != 0 {
		return nil, errdefs.FailedPrecondition("netns machine %s: needs root", o.Name)
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return nil, errdefs.FailedPrecondition("netns machine %s: ip not found (Debian package iproute2)", o.Name)
	}
	m := &Machine{
		o:           o,
		log:         o.Logger.With("component", "lab-netns", "host", o.Name),
		ns:          NamespaceName(o.Lab, o.Name),
		veth:        VethName(o.Lab, o.Name),
		name:        MachineName(o.Lab, o.Name),
		disk:        filepath.Join(o.StateDir, "disk.raw"),
		mnt:         filepath.Join(o.StateDir, "root"),
		console:     filepath.Join(o.StateDir, "console.log"),
		cmdlinePath: filepath.Join(o.StateDir, "cmdline"),
	}
	if err := os.MkdirAll(o.StateDir, 0o700); err != nil {
		return nil, fmt.Errorf("netns machine %s: %w", o.Name, err)
	}
	if err := m.network(ctx); err != nil {
		return nil, fmt.Errorf("netns machine %s: %w", o.Name, err)
	}
	if _, err := os.Stat(m.disk); errors.Is(err, os.ErrNotExist) {
		f, err := os.OpenFile(m.disk, os.O_CREATE|os.O_WRONLY, 0o600)
		if err != nil {
			return nil, fmt.Errorf("netns machine %s: disk: %w", o.Name, err)
		}
		err = f.Truncate(o.DiskSize)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("netns machine %s: disk: %w", o.Name, err)
		}
	}
	return m, nil
}

func (m *Machine) network(ctx context.Context) error {
	if _, err := os.Stat(m.NetnsPath()); err != nil {
		m.o.Track(Resource{KindNetns, m.ns})
		if err := ip(ctx, "netns", "add", m.ns); err != nil {
			return err
		}
	}
	if _, err := os.Stat("/sys/class/net/" + m.veth); err != nil {
		peer := m.veth + "p"
		m.o.Track(Resource{KindLink, m.veth})
		steps := [][]string{
			{"link", "add", m.veth, "type", "veth", "peer", "name", peer},
			{"link", "set", peer, "netns", m.ns},
			{"-n", m.ns, "link", "set", peer, "name", "eth0", "address", m.o.MAC},
			{"-n", m.ns, "link", "set", "lo", "up"},
			{"-n", m.ns, "link", "set", "eth0", "up"},
		}
		if m.o.Bridge != "" {
			steps = append(steps, []string{"link", "set", m.veth, "master", m.o.Bridge})
		}
		steps = append(steps, []string{"link", "set", m.veth, "up"})
		if m.o.Address != "" {
			steps = append(steps, []string{"-n", m.ns, "addr", "add", m.o.Address, "dev", "eth0"})
		}
		if m.o.Gateway != "" {
			steps = append(steps, []string{"-n", m.ns, "route", "add", "default", "via", m.o.Gateway})
		}
		for _, s := range steps {
			if err := ip(ctx, s...); err != nil {
				return err
			}
		}
	}
	return nil
}

// Name is the host name.
func (m *Machine) Name() string { return m.o.Name }

// Namespace is the host's network namespace name.
func (m *Machine) Namespace() string { return m.ns }

// NetnsPath is /run/netns/NAMESPACE.
func (m *Machine) NetnsPath() string { return "/run/netns/" + m.ns }

// Veth is the host-side interface of the host's link.
func (m *Machine) Veth() string { return m.veth }

// MAC is the host's eth0 address.
func (m *Machine) MAC() string { return m.o.MAC }

// DiskPath is the host's disk file.
func (m *Machine) DiskPath() string { return m.disk }

// ConsoleLog is the file that collects the boot agent's or nspawn's
// output.
func (m *Machine) ConsoleLog() string { return m.console }

// RootDir is where a disk boot mounts the disk's root.
func (m *Machine) RootDir() string { return m.mnt }

// MachineName is the nspawn machine name (also the cgroup name).
func (m *Machine) MachineName() string { return m.name }

// Launches counts the processes started so far: boot agents, and nspawn
// once per disk boot plus once per reboot inside.
func (m *Machine) Launches() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.launches
}

// LastBootError says why the last power-on booted nothing ("" when it
// booted something).
func (m *Machine) LastBootError() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.lastError
}

// PID is the running boot agent or nspawn process, 0 when nothing runs.
func (m *Machine) PID() int {
	m.mu.Lock()
	b := m.cur
	m.mu.Unlock()
	if b == nil {
		return 0
	}
	return b.getPID()
}

// Leader is the PID of the booted system's init (the only child of
// nspawn), 0 when no disk boot runs.
func (m *Machine) Leader() int {
	m.mu.Lock()
	b := m.cur
	m.mu.Unlock()
	if b == nil || !b.nspawn {
		return 0
	}
	return nspawn.LeaderOf(b.getPID())
}

// BusAddress is the D-Bus address of the booted system's system bus, ""
// when no disk boot runs.
func (m *Machine) BusAddress() string {
	l := m.Leader()
	if l == 0 {
		return ""
	}
	return fmt.Sprintf("unix:path=/proc/%d/root/run/dbus/system_bus_socket", l)
}

// SystemState asks the booted system's systemd for its state ("starting",
// "running", "degraded", ...) over its D-Bus. It returns Unavailable when
// no disk boot runs or the bus does not answer. Equivalent to:
// `busctl --address=ADDR get-property org.freedesktop.systemd1
// /org/freedesktop/systemd1 org.freedesktop.systemd1.Manager SystemState`.
func (m *Machine) SystemState(ctx context.Context) (string, error) {
	addr := m.BusAddress()
	if addr == "" {
		return "", errdefs.Unavailable("host %s: no system booted from disk", m.o.Name)
	}
	out, err := exec.CommandContext(ctx, "busctl", "--address="+addr, "get-property",
		"org.freedesktop.systemd1", "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager", "SystemState").CombinedOutput()
	if err != nil {
		return "", errdefs.Unavailable("host %s: system bus: %v: %s", m.o.Name, err, strings.TrimSpace(string(out)))
	}
	// Output: s "running"
	return strings.Trim(strings.TrimPrefix(strings.TrimSpace(string(out)), "s "), `"`), nil
}

// State implements machine.Machine.
func (m *Machine) State() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.on
}

// BootSource implements machine.Machine.
func (m *Machine) BootSource() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.dev
}

// InsertMedia implements machine.Machine; the URL reaches the next boot
// agent as KILN_BOOT_MEDIA and kiln.media= on its command line.
func (m *Machine) InsertMedia(url string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.media = url
	return nil
}

// PowerOn implements machine.Machine. PXE and virtual media ("cd", with
// media inserted) start the boot agent; "disk" boots the disk under
// systemd-nspawn. When nothing is bootable the machine is on and runs
// nothing (LastBootError says why). It returns once the process has
// started, not when the system is up.
func (m *Machine) PowerOn(ctx context.Context, dev string) error {
	if err := machine.ValidBootDevice(dev); err != nil {
		return err
	}
	m.op.Lock()
	defer m.op.Unlock()
	m.mu.Lock()
	if m.on {
		m.mu.Unlock()
		return nil
	}
	m.on, m.dev, m.lastError = true, dev, ""
	m.mu.Unlock()
	return m.start(ctx, dev)
}

func (m *Machine) start(ctx context.Context, dev string) error {
	var err error
	if dev == machine.BootDisk {
		err = m.startDisk(ctx)
	} else {
		err = m.startAgent(ctx, dev)
	}
	var nb *notBootable
	switch {
	case errors.As(err, &nb):
		m.log.Warn("nothing to boot", "boot", dev, "reason", nb.reason)
		m.mu.Lock()
		m.lastError = nb.reason
		m.mu.Unlock()
		return nil
	case err != nil:
		m.mu.Lock()
		m.on = false
		m.mu.Unlock()
		return fmt.Errorf("host %s: power on from %s: %w", m.o.Name, dev, err)
	}
	return nil
}

// notBootable is a power-on that finds nothing to boot: not an error of
// the BMC action, the machine just sits there powered.
type notBootable struct{ reason string }

func (e *notBootable) Error() string { return e.reason }

// PowerOff implements machine.Machine. Graceful asks the boot agent to
// stop (SIGTERM) or the booted system to power off (D-Bus StartUnit
// poweroff.target), waits up to the grace period or ctx, then kills.
// It returns when everything of the boot has stopped and been cleaned up.
func (m *Machine) PowerOff(ctx context.Context, graceful bool) error {
	m.op.Lock()
	defer m.op.Unlock()
	return m.powerOff(ctx, graceful)
}

func (m *Machine) powerOff(ctx context.Context, graceful bool) error {
	m.mu.Lock()
	b, on := m.cur, m.on
	m.mu.Unlock()
	if !on {
		return nil
	}
	if b != nil {
		m.stopBoot(ctx, b, graceful)
	}
	m.mu.Lock()
	m.on = false
	if m.cur == b {
		m.cur = nil
	}
	m.mu.Unlock()
	m.log.Info("machine powered off", "graceful", graceful)
	return nil
}

// Reset implements machine.Machine: a hard power cycle from the same boot
// device.
func (m *Machine) Reset(ctx context.Context) error {
	m.op.Lock()
	defer m.op.Unlock()
	m.mu.Lock()
	on, dev := m.on, m.dev
	m.mu.Unlock()
	if !on {
		return errdefs.FailedPrecondition("host %s: reset: machine is off", m.o.Name)
	}
	if err := m.powerOff(ctx, false); err != nil {
		return err
	}
	m.mu.Lock()
	m.on, m.lastError = true, ""
	m.mu.Unlock()
	return m.start(ctx, dev)
}

// Close powers the machine off hard and removes its network namespace
// and veth. The state directory (disk, logs) stays.
func (m *Machine) Close(ctx context.Context) error {
	_ = m.PowerOff(ctx, false)
	return errors.Join(
		Remove(ctx, Resource{KindNetns, m.ns}),
		Remove(ctx, Resource{KindLink, m.veth}))
}

func (m *Machine) stopBoot(ctx context.Context, b *boot, graceful bool) {
	b.requestStop()
	if graceful {
		if b.nspawn {
			m.askPowerOff(ctx, b)
		} else if pid := b.getPID(); pid > 0 {
			_ = syscall.Kill(-pid, syscall.SIGTERM)
		}
		t := time.NewTimer(m.o.GracePeriod)
		select {
		case <-b.done:
			t.Stop()
			return
		case <-t.C:
			m.log.Warn("graceful power off timed out: forcing", "grace", m.o.GracePeriod)
		case <-ctx.Done():
		}
		t.Stop()
	}
	m.kill(b)
	<-b.done
}

// askPowerOff asks the booted system's systemd to power off, over its
// D-Bus; when the bus does not answer, with SIGRTMIN+4 to its init.
// Equivalent to `busctl --address=ADDR call org.freedesktop.systemd1
// /org/freedesktop/systemd1 org.freedesktop.systemd1.Manager StartUnit ss
// poweroff.target replace-irreversibly`.
func (m *Machine) askPowerOff(ctx context.Context, b *boot) {
	leader := nspawn.LeaderOf(b.getPID())
	if leader == 0 {
		return
	}
	addr := fmt.Sprintf("unix:path=/proc/%d/root/run/dbus/system_bus_socket", leader)
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	out, err := exec.CommandContext(cctx, "busctl", "--address="+addr, "call", "org.freedesktop.systemd1",
		"/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager", "StartUnit", "ss",
		"poweroff.target", "replace-irreversibly").CombinedOutput()
	if err != nil {
		m.log.Info("system bus did not take the power off: signalling init", "err", strings.TrimSpace(string(out)))
		_ = syscall.Kill(leader, syscall.Signal(sigRTMIN()+4))
	}
}

// sigRTMIN is the kernel's SIGRTMIN (34 on Linux; glibc reserves two).
func sigRTMIN() int { return 34 }

// kill ends the boot by force: the agent's process group, or the booted
// system's init (which ends its PID namespace) and nspawn, then whatever
// is left in the machine's cgroups.
func (m *Machine) kill(b *boot) {
	pid := b.getPID()
	if pid == 0 {
		return
	}
	if b.nspawn {
		if l := nspawn.LeaderOf(pid); l != 0 {
			_ = syscall.Kill(l, syscall.SIGKILL)
		}
		_ = syscall.Kill(pid, syscall.SIGKILL)
		return
	}
	_ = syscall.Kill(-pid, syscall.SIGKILL)
}

// --- boot agent

func (m *Machine) startAgent(ctx context.Context, dev string) error {
	a := m.o.Agent
	if len(a.Command) == 0 {
		return &notBootable{"no boot program configured for PXE or virtual media"}
	}
	m.mu.Lock()
	media := m.media
	m.mu.Unlock()
	if dev == machine.BootCD && media == "" {
		return &notBootable{"boot from virtual media: no media inserted"}
	}
	source := "pxe"
	if dev == machine.BootCD {
		source = "virtualmedia"
	}
	cmdline := []string{"kiln.boot=" + source}
	if media != "" {
		cmdline = append(cmdline, "kiln.media="+media)
	}
	cmdline = append(cmdline, "kiln.lab_disk="+m.disk)
	if a.Cmdline != "" {
		cmdline = append(cmdline, a.Cmdline)
	}
	// Boot media read as firmware does replace all of it (firmware_linux.go).
	if fw, err := m.firmwareCmdline(ctx, dev, media); err != nil {
		return err
	} else if fw != "" {
		cmdline = []string{fw, "kiln.lab_disk=" + m.disk}
	}
	if a.CmdlineFile != "" {
		if b, err := os.ReadFile(a.CmdlineFile); err == nil {
			cmdline = append(cmdline, strings.Join(strings.Fields(string(b)), " "))
		}
	}
	if err := os.WriteFile(m.cmdlinePath, []byte(strings.Join(cmdline, " ")+"\n"), 0o600); err != nil {
		return err
	}
	if a.Scratch != "" {
		if err := os.RemoveAll(a.Scratch); err != nil {
			return fmt.Errorf("boot agent scratch: %w", err)
		}
		if err := os.MkdirAll(a.Scratch, 0o700); err != nil {
			return fmt.Errorf("boot agent scratch: %w", err)
		}
	}
	console, err := os.OpenFile(m.console, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer console.Close()

	// `ip netns exec` enters the namespace with a private mount namespace
	// (and /sys remounted for it); inside it the command line file is
	// bound over /proc/cmdline.
	script := `mount --bind "$1" /proc/cmdline || exit 1; shift; exec "$@"`
	if a.OSPower {
		// $$ is the agent's PID once sh has exec'd it.
		script = `mount --bind "$1" /proc/cmdline || exit 1; shift; exec "$@" --reboot-command "kill -KILL $$" --poweroff-command "kill -TERM $$"`
	}
	args := append([]string{"netns", "exec", m.ns, "sh", "-c", script, "kiln-boot", m.cmdlinePath}, a.Command...)
	cmd := exec.Command("ip", args...)
	cmd.Dir = m.o.StateDir
	cmd.Env = append(os.Environ(),
		"KILN_BOOT_DEVICE="+dev,
		"KILN_BOOT_SOURCE="+source,
		"KILN_LAB_DISK="+m.disk)
	if media != "" {
		cmd.Env = append(cmd.Env, "KILN_BOOT_MEDIA="+media)
	}
	cmd.Stdout, cmd.Stderr = console, console
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start boot agent: %w", err)
	}
	pid := cmd.Process.Pid
	m.o.Track(Resource{KindPID, ProcessID(pid)})
	b := &boot{stop: make(chan struct{}), done: make(chan struct{}), pid: pid}
	m.mu.Lock()
	m.cur = b
	m.launches++
	m.mu.Unlock()
	m.log.Info("machine powered on: boot agent started", "boot", dev, "pid", pid)
	go func() {
		err := cmd.Wait()
		b.mu.Lock()
		b.pid = 0
		b.mu.Unlock()
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && a.OSPower && ws.Signaled() && ws.Signal() == syscall.SIGKILL && !b.stopping() {
			close(b.done)
			m.osReboot(b, pid)
			return
		}
		m.ended(b, "boot agent exited", err)
		close(b.done)
	}()
	return nil
}

// SetNextBoot sets how the machine picks its boot device when its own OS
// reboots it: a BMC's choice (a one-time override consumed, else the
// persistent setting). Without it the machine boots the same device again.
func (m *Machine) SetNextBoot(next func() string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.nextBoot = next
}

// osReboot boots the machine again after its OS asked for a reboot
// (the boot agent's --reboot-command), from the device the BMC picks.
func (m *Machine) osReboot(b *boot, pid int) {
	m.op.Lock()
	defer m.op.Unlock()
	m.mu.Lock()
	if m.cur != b || !m.on {
		m.mu.Unlock()
		return
	}
	m.cur = nil
	dev, next := m.dev, m.nextBoot
	m.mu.Unlock()
	_ = syscall.Kill(-pid, syscall.SIGKILL) // whatever the agent left in its process group
	if next != nil {
		dev = next()
	}
	m.log.Info("machine rebooting (asked by its OS)", "boot", dev)
	m.mu.Lock()
	m.dev, m.lastError = dev, ""
	m.mu.Unlock()
	if err := m.start(context.Background(), dev); err != nil {
		m.log.Warn("reboot failed", "boot", dev, "error", err)
	}
}

// ended records that a boot ended on its own (the host halted) unless it
// was being stopped.
func (m *Machine) ended(b *boot, msg string, err error) {
	if b.stopping() {
		return
	}
	m.log.Info(msg, "err", err)
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cur == b {
		m.cur, m.on = nil, false
	}
}

// --- disk boot

func (m *Machine) startDisk(ctx context.Context) error {
	st, err := os.Stat(m.disk)
	if err != nil || st.Size() == 0 {
		return &notBootable{"no disk"}
	}
	for _, tool := range []string{"systemd-nspawn", "busctl", "unshare", "sfdisk"} {
		if _, err := exec.LookPath(tool); err != nil {
			return errdefs.FailedPrecondition("%s not found (Debian packages systemd-container, util-linux, fdisk)", tool)
		}
	}
	mount, err := m.mountCommand(ctx)
	if err != nil {
		return &notBootable{"disk is not bootable: " + err.Error()}
	}
	if err := os.MkdirAll(m.mnt, 0o755); err != nil {
		return err
	}
	procs, err := m.makeCgroups()
	if err != nil {
		return err
	}
	b := &boot{nspawn: true, stop: make(chan struct{}), done: make(chan struct{})}
	cmd, err := m.launchNspawn(b, procs, mount)
	if err != nil {
		m.teardownDisk(context.Background())
		return err
	}
	m.mu.Lock()
	m.cur = b
	m.mu.Unlock()
	m.log.Info("machine powered on: booting disk", "pid", cmd.Process.Pid, "machine", m.name)
	go m.supervise(b, cmd, procs, mount)
	return nil
}

// mountCommand is the command that mounts the disk's root partition at
// the machine's root directory: `systemd-dissect --mount DISK DIR`, or
// where the kernel has no vfat (systemd-dissect then fails on the ESP),
// `mount -o loop,offset=N,sizelimit=S DISK DIR`. It fails when the disk
// has no GPT with a discoverable root partition.
func (m *Machine) mountCommand(ctx context.Context) ([]string, error) {
	off, size, err := rootPartition(ctx, m.disk)
	if err != nil {
		return nil, err
	}
	if _, err := exec.LookPath("systemd-dissect"); err == nil && hasFilesystem("vfat") {
		return []string{"systemd-dissect", "--mount", m.disk, m.mnt}, nil
	}
	return []string{"mount", "-t", "ext4", "-o", fmt.Sprintf("loop,offset=%d,sizelimit=%d,nodev", off, size), m.disk, m.mnt}, nil
}

// nspawnOptions boot the mounted disk root in the host's network
// namespace with the flags LAB.md found necessary for a host whose
// systemd runs containerd and kubelet (see nspawn.Args).
func (m *Machine) nspawnOptions() nspawn.Options {
	return nspawn.Options{Name: m.name, Dir: m.mnt, NetNS: m.NetnsPath()}
}

// Exit codes of the boot script before nspawn runs.
const (
	exitMountFailed = 86
	exitNoInit      = 87
)

// launchNspawn mounts the disk and starts systemd-nspawn on it, inside
// the machine's cgroups and a private mount namespace of its own: the
// disk's mount is never in the host's mount table, so no other namespace
// (another host's boot agent, another nspawn) can hold a copy of it, and
// it goes away with nspawn whatever happens. Equivalent to:
//
//	unshare --mount --propagation private sh -c '
//	  echo $$ > /sys/fs/cgroup/*/NAME/cgroup.procs
//	  systemd-dissect --mount DISK ROOT
//	  exec env SYSTEMD_NSPAWN_API_VFS_WRITABLE=network systemd-nspawn -D ROOT -M NAME -b ...'
func (m *Machine) launchNspawn(b *boot, procs, mount []string) (*exec.Cmd, error) {
	console, err := os.OpenFile(m.console, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer console.Close()
	var script strings.Builder
	opts := m.nspawnOptions()
	fmt.Fprintf(&script, "%s\n", nspawn.JoinScript(procs))
	fmt.Fprintf(&script, "%s || { echo 'kiln: cannot mount the disk' >&2; exit %d; }\n", nspawn.ShellQuote(mount), exitMountFailed)
	fmt.Fprintf(&script, "for i in sbin/init usr/sbin/init usr/lib/systemd/systemd lib/systemd/systemd; do [ -e %s/$i ] && exec systemd-nspawn %s; done\n",
		nspawn.ShellQuote([]string{m.mnt}), nspawn.ShellQuote(nspawn.Args(opts)))
	fmt.Fprintf(&script, "echo 'kiln: the disk root has no init' >&2; exit %d\n", exitNoInit)
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c", script.String())
	cmd.Env = append(os.Environ(), nspawn.Env(opts)...)
	cmd.Stdout, cmd.Stderr = console, console
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start systemd-nspawn: %w", err)
	}
	m.o.Track(Resource{KindPID, ProcessID(cmd.Process.Pid)})
	b.mu.Lock()
	b.pid = cmd.Process.Pid
	b.mu.Unlock()
	m.mu.Lock()
	m.launches++
	m.mu.Unlock()
	return cmd, nil
}

// supervise waits for nspawn; a reboot inside (exit 133) launches it
// again, anything else ends the boot. A disk that cannot be mounted or
// has no init leaves the machine on with nothing running. Then the loop
// device, cgroups and nspawn's leftovers are cleaned up.
func (m *Machine) supervise(b *boot, cmd *exec.Cmd, procs, mount []string) {
	for {
		err := cmd.Wait()
		code := cmd.ProcessState.ExitCode()
		b.mu.Lock()
		b.pid = 0
		b.mu.Unlock()
		m.killCgroups() // nothing of the last boot survives it
		_ = os.RemoveAll(nspawn.PropagateDir(m.name))
		if !b.stopping() && (code == exitMountFailed || code == exitNoInit) {
			reason := "disk is not bootable: it cannot be mounted"
			if code == exitNoInit {
				reason = "disk is not bootable: its root has no init"
			}
			m.log.Warn("nothing to boot", "boot", machine.BootDisk, "reason", reason)
			m.mu.Lock()
			m.lastError = reason
			if m.cur == b {
				m.cur = nil // powered, running nothing
			}
			m.mu.Unlock()
			break
		}
		if b.stopping() || code != nspawnRebootCode {
			if !b.stopping() {
				m.ended(b, "system halted", err)
			}
			break
		}
		m.log.Info("system rebooted: booting the disk again")
		next, lerr := m.launchNspawn(b, procs, mount)
		if lerr != nil {
			m.ended(b, "relaunch after reboot failed", lerr)
			break
		}
		cmd = next
	}
	m.teardownDisk(context.Background())
	close(b.done)
}

// teardownDisk makes sure the disk's loop device is detached and removes
// the machine's cgroups and nspawn's propagation directory.
func (m *Machine) teardownDisk(ctx context.Context) {
	m.killCgroups()
	m.unmount(ctx) // a mount in the host's table, left by an older version or by hand
	if err := DetachLoops(ctx, m.disk); err != nil {
		m.log.Warn("loop device left attached", "disk", m.disk, "err", err)
	}
	_ = os.RemoveAll(nspawn.PropagateDir(m.name))
	for _, d := range m.cgroups().Dirs {
		if err := nspawn.RemoveCgroup(d); err != nil {
			m.log.Warn("cgroup left behind", "cgroup", d, "err", err)
		}
	}
}

// unmount unmounts the disk's root and its loop device. Equivalent to
// `umount -R ROOT; losetup -d LOOP`.
func (m *Machine) unmount(ctx context.Context) {
	loop := mountSource(m.mnt)
	if loop == "" {
		return
	}
	if err := Unmount(ctx, m.mnt); err != nil {
		m.log.Warn("unmount failed", "dir", m.mnt, "err", err)
	}
	if strings.HasPrefix(loop, "/dev/loop") {
		if err := DetachLoop(ctx, loop, m.disk); err != nil {
			m.log.Warn("loop device left attached", "loop", loop, "err", err)
		}
	}
}

// --- cgroups

// cgroups are the machine's cgroups, one per hierarchy.
func (m *Machine) cgroups() nspawn.Cgroups { return nspawn.NewCgroups(m.name) }

// makeCgroups reports the machine's cgroups to Track, makes them and
// returns their cgroup.procs files.
func (m *Machine) makeCgroups() ([]string, error) {
	cg := m.cgroups()
	for _, d := range cg.Dirs {
		m.o.Track(Resource{KindCgroup, d})
	}
	return cg.Create()
}

// killCgroups kills every process left in the machine's cgroups.
func (m *Machine) killCgroups() { m.cgroups().Kill() }
