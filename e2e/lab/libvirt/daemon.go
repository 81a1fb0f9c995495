package libvirt

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// SystemQEMUConf is the QEMU driver's configuration (a path compiled
// into libvirt).
const SystemQEMUConf = "/etc/libvirt/qemu.conf"

// LockFile serializes private libvirtds on a machine. Their QEMU drivers
// share the system state paths, and a second one exits at once ("Driver
// state initialization failed"), so StartDaemon takes an exclusive flock
// on this file first, waiting while another holds it, and the lock lives
// as long as the libvirtd it started (the child inherits it).
const LockFile = "/run/lock/kiln-libvirtd.lock"

// Daemon is a private libvirtd started for a lab on a machine without a
// service manager: its own configuration, log and unix sockets in a
// directory of its own, and its own QEMU driver configuration
// (bind-mounted over SystemQEMUConf in a private mount namespace): QEMU
// runs as root and writes its output to files, so no virtlogd is needed,
// and libvirt does not re-probe QEMU on every call when /dev/kvm exists
// but libvirt-qemu may not open it. It runs as root, so the QEMU driver
// still keeps domain state in libvirt's system paths (/etc/libvirt/qemu,
// /run/libvirt/qemu, /var/lib/libvirt/qemu): do not start one next to a
// system libvirtd.
type Daemon struct {
	dir    string
	socket string
	cmd    *exec.Cmd
	done   chan struct{}
	ownDir bool
	log    *slog.Logger
	lock   *os.File
}

// DaemonOptions configure StartDaemon.
type DaemonOptions struct {
	// Dir receives the configuration, log and sockets; "" makes a
	// temporary directory (removed by Close). Keep it short: unix socket
	// paths are limited to 108 bytes.
	Dir string
	// Logger receives lifecycle messages; nil discards them.
	Logger *slog.Logger
}

// qemuConf is the private daemon's QEMU driver configuration.
const qemuConf = `user = "root"
group = "root"
stdio_handler = "file"
`

// StartDaemon starts libvirtd in the foreground as a child of this
// process and waits until it answers on its socket. It first waits, as
// long as ctx allows, for any other private libvirtd of this machine to
// stop (LockFile), and returns Unavailable naming the lock when ctx ends. It needs root,
// unshare (util-linux) and Debian's libvirt-daemon-system and
// libvirt-daemon-driver-qemu. Equivalent to `unshare --mount
// --propagation private sh -c 'mount --bind DIR/qemu.conf
// /etc/libvirt/qemu.conf && exec libvirtd -f DIR/libvirtd.conf'`.
func StartDaemon(ctx context.Context, o DaemonOptions) (*Daemon, error) {
	for _, bin := range []string{"libvirtd", "unshare"} {
		if _, err := exec.LookPath(bin); err != nil {
			return nil, errdefs.NotFound("libvirt: %s not found (apt-get install libvirt-daemon-system libvirt-daemon-driver-qemu)", bin)
		}
	}
	if _, err := os.Stat(SystemQEMUConf); err != nil {
		return nil, errdefs.NotFound("libvirt: %s not found (apt-get install libvirt-daemon-system)", SystemQEMUConf)
	}
	if os.Geteuid() != 0 {
		return nil, errdefs.PermissionDenied("libvirt: a system libvirtd needs root")
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d := &Daemon{dir: o.Dir, log: log.With("component", "libvirtd")}
	lock, err := lockPrivate(ctx, d.log)
	if err != nil {
		return nil, err
	}
	d.lock = lock
	if d.dir == "" {
		dir, err := os.MkdirTemp("", "kiln-lv-")
		if err != nil {
			return nil, fmt.Errorf("libvirt: %w", err)
		}
		d.dir, d.ownDir = dir, true
	} else if err := os.MkdirAll(d.dir, 0o700); err != nil {
		return nil, fmt.Errorf("libvirt: %w", err)
	}
	sockDir := filepath.Join(d.dir, "sock")
	d.socket = filepath.Join(sockDir, "libvirt-sock")
	if err := os.MkdirAll(sockDir, 0o700); err != nil {
		d.Close()
		return nil, fmt.Errorf("libvirt: %w", err)
	}
	conf := strings.Join([]string{
		fmt.Sprintf("unix_sock_dir = %q", sockDir),
		`unix_sock_rw_perms = "0700"`,
		`auth_unix_rw = "none"`,
		`auth_unix_ro = "none"`,
		fmt.Sprintf("log_outputs = %q", "3:file:"+filepath.Join(d.dir, "libvirtd.log")),
		"",
	}, "\n")
	for name, content := range map[string]string{"libvirtd.conf": conf, "qemu.conf": qemuConf} {
		if err := os.WriteFile(filepath.Join(d.dir, name), []byte(content), 0o600); err != nil {
			d.Close()
			return nil, fmt.Errorf("libvirt: %w", err)
		}
	}
	script := fmt.Sprintf("mount --bind %s %s && exec libvirtd -f %s -p %s",
		filepath.Join(d.dir, "qemu.conf"), SystemQEMUConf,
		filepath.Join(d.dir, "libvirtd.conf"), filepath.Join(d.dir, "libvirtd.pid"))
	if err := d.start("unshare", "--mount", "--propagation", "private", "sh", "-c", script); err != nil {
		d.Close()
		return nil, err
	}
	if err := d.wait(ctx); err != nil {
		d.Close()
		return nil, err
	}
	lv, err := Dial(d.socket, "")
	if err != nil {
		d.Close()
		return nil, err
	}
	_ = lv.Disconnect()
	d.log.Info("libvirtd started", "pid", d.cmd.Process.Pid, "socket", d.socket)
	return d, nil
}

func answers(socket string) bool {
	c, err := net.DialTimeout("unix", socket, time.Second)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

func (d *Daemon) start(name string, args ...string) error {
	out, err := os.OpenFile(filepath.Join(d.dir, "libvirtd.out"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("libvirt: %w", err)
	}
	defer out.Close()
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if d.lock != nil {
		// libvirtd keeps the lock when this process dies before it.
		cmd.ExtraFiles = []*os.File{d.lock}
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("libvirt: start libvirtd: %w", err)
	}
	d.cmd, d.done = cmd, make(chan struct{})
	go func() { _ = cmd.Wait(); close(d.done) }()
	return nil
}

// wait waits until the socket answers, libvirtd exits or 60 s pass.
func (d *Daemon) wait(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for !answers(d.socket) {
		select {
		case <-d.done:
			return errdefs.Unavailable("libvirt: libvirtd exited: %s", d.lastLog())
		case <-ctx.Done():
			return errdefs.Unavailable("libvirt: libvirtd did not answer on %s: %s", d.socket, d.lastLog())
		case <-time.After(100 * time.Millisecond):
		}
	}
	return nil
}

// lastLog is the last line of libvirtd's output or log.
func (d *Daemon) lastLog() string {
	for _, f := range []string{"libvirtd.out", "libvirtd.log"} {
		b, _ := os.ReadFile(filepath.Join(d.dir, f))
		if s := strings.TrimSpace(string(b)); s != "" {
			if i := strings.LastIndexByte(s, '\n'); i >= 0 {
				s = s[i+1:]
			}
			return s
		}
	}
	return "no log"
}

// Socket is the private libvirtd's read-write socket, for Options.Socket.
func (d *Daemon) Socket() string { return d.socket }

// Dir is the daemon's directory (configuration, log, sockets).
func (d *Daemon) Dir() string { return d.dir }

// PID is libvirtd's process ID, 0 before it started.
func (d *Daemon) PID() int {
	if d.cmd == nil {
		return 0
	}
	return d.cmd.Process.Pid
}

// Close stops libvirtd by PID (SIGTERM, SIGKILL of its process group
// after 10 s). Domains still running keep running (libvirtd does not
// stop them): close the VMs first. A temporary directory made by
// StartDaemon is removed.
func (d *Daemon) Close() error {
	var errs []error
	if d.cmd != nil {
		select {
		case <-d.done:
		default:
			_ = syscall.Kill(d.cmd.Process.Pid, syscall.SIGTERM)
			select {
			case <-d.done:
			case <-time.After(10 * time.Second):
				_ = syscall.Kill(-d.cmd.Process.Pid, syscall.SIGKILL)
				<-d.done
				errs = append(errs, fmt.Errorf("libvirt: libvirtd (pid %d) ignored SIGTERM", d.cmd.Process.Pid))
			}
			d.log.Info("libvirtd stopped")
		}
	}
	if d.ownDir {
		errs = append(errs, os.RemoveAll(d.dir))
	}
	if d.lock != nil {
		_ = d.lock.Close()
		d.lock = nil
	}
	return errors.Join(errs...)
}

// lockPrivate takes LockFile exclusively, waiting while another private
// libvirtd holds it, until ctx ends.
func lockPrivate(ctx context.Context, log *slog.Logger) (*os.File, error) {
	if err := os.MkdirAll(filepath.Dir(LockFile), 0o755); err != nil {
		return nil, fmt.Errorf("libvirt: %w", err)
	}
	f, err := os.OpenFile(LockFile, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("libvirt: %w", err)
	}
	t0 := time.Now()
	for waited := false; ; {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			if waited {
				log.Info("the other private libvirtd stopped", "waited", time.Since(t0).Round(time.Second))
			}
			return f, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("libvirt: lock %s: %w", LockFile, err)
		}
		if !waited {
			log.Info("waiting for another private libvirtd of this machine to stop (only one can run)", "lock", LockFile)
			waited = true
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, errdefs.Unavailable("libvirt: another private libvirtd runs on this machine (%s is locked; libvirt's QEMU driver keeps its state in system paths, so only one runs at a time): waited %s", LockFile, time.Since(t0).Round(time.Second))
		case <-time.After(500 * time.Millisecond):
		}
	}
}
