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

// VirtlogdSocket is where libvirtd's QEMU driver finds virtlogd (a path
// compiled into libvirt).
const VirtlogdSocket = "/run/libvirt/virtlogd-sock"

// Daemon is a private libvirtd (and virtlogd when none runs) started for a
// lab on a machine without a service manager: its own configuration and
// unix sockets in a directory of its own. It runs as root, so its QEMU
// driver still keeps domain state in libvirt's system paths
// (/etc/libvirt/qemu, /run/libvirt/qemu, /var/lib/libvirt/qemu): do not
// start one next to a system libvirtd.
type Daemon struct {
	dir      string
	socket   string
	libvirtd *exec.Cmd
	virtlogd *exec.Cmd
	done     map[*exec.Cmd]chan struct{}
	ownDir   bool
	log      *slog.Logger
}

// DaemonOptions configure StartDaemon.
type DaemonOptions struct {
	// Dir receives the configuration, logs and sockets; "" makes a
	// temporary directory (removed by Close). Keep it short: unix socket
	// paths are limited to 108 bytes.
	Dir string
	// Logger receives lifecycle messages; nil discards them.
	Logger *slog.Logger
}

// StartDaemon starts libvirtd (and virtlogd unless VirtlogdSocket
// answers) in the foreground as children of this process and waits until
// libvirtd answers on its socket. It needs root and Debian's
// libvirt-daemon-system and libvirt-daemon-driver-qemu. Equivalent to
// `virtlogd -f DIR/virtlogd.conf & libvirtd -f DIR/libvirtd.conf &`.
func StartDaemon(ctx context.Context, o DaemonOptions) (*Daemon, error) {
	for _, bin := range []string{"libvirtd", "virtlogd"} {
		if _, err := exec.LookPath(bin); err != nil {
			return nil, errdefs.NotFound("libvirt: %s not found (apt-get install libvirt-daemon-system libvirt-daemon-driver-qemu)", bin)
		}
	}
	if os.Geteuid() != 0 {
		return nil, errdefs.PermissionDenied("libvirt: a system libvirtd needs root")
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d := &Daemon{dir: o.Dir, log: log.With("component", "libvirtd"), done: map[*exec.Cmd]chan struct{}{}}
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
	if err := os.WriteFile(filepath.Join(d.dir, "libvirtd.conf"), []byte(conf), 0o600); err != nil {
		return nil, fmt.Errorf("libvirt: %w", err)
	}
	if !answers(VirtlogdSocket) {
		vconf := fmt.Sprintf("log_outputs = %q\n", "3:file:"+filepath.Join(d.dir, "virtlogd.log"))
		if err := os.WriteFile(filepath.Join(d.dir, "virtlogd.conf"), []byte(vconf), 0o600); err != nil {
			return nil, fmt.Errorf("libvirt: %w", err)
		}
		cmd, err := d.start("virtlogd", "-f", filepath.Join(d.dir, "virtlogd.conf"), "-p", filepath.Join(d.dir, "virtlogd.pid"))
		if err != nil {
			return nil, err
		}
		d.virtlogd = cmd
		if err := d.wait(ctx, cmd, VirtlogdSocket); err != nil {
			d.Close()
			return nil, err
		}
	}
	cmd, err := d.start("libvirtd", "-f", filepath.Join(d.dir, "libvirtd.conf"), "-p", filepath.Join(d.dir, "libvirtd.pid"))
	if err != nil {
		d.Close()
		return nil, err
	}
	d.libvirtd = cmd
	if err := d.wait(ctx, cmd, d.socket); err != nil {
		d.Close()
		return nil, err
	}
	lv, err := Dial(d.socket, "")
	if err != nil {
		d.Close()
		return nil, err
	}
	_ = lv.Disconnect()
	d.log.Info("libvirtd started", "pid", cmd.Process.Pid, "socket", d.socket)
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

func (d *Daemon) start(name string, args ...string) (*exec.Cmd, error) {
	out, err := os.OpenFile(filepath.Join(d.dir, name+".out"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("libvirt: %w", err)
	}
	defer out.Close()
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("libvirt: start %s: %w", name, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	d.done[cmd] = done
	return cmd, nil
}

// wait waits until socket answers, the process exits or 60 s pass.
func (d *Daemon) wait(ctx context.Context, cmd *exec.Cmd, socket string) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for !answers(socket) {
		select {
		case <-d.done[cmd]:
			return errdefs.Unavailable("libvirt: %s exited: %s", filepath.Base(cmd.Path), d.lastLog(cmd))
		case <-ctx.Done():
			return errdefs.Unavailable("libvirt: %s did not answer on %s: %s", filepath.Base(cmd.Path), socket, d.lastLog(cmd))
		case <-time.After(100 * time.Millisecond):
		}
	}
	return nil
}

// lastLog is the last line of a daemon's own log or output.
func (d *Daemon) lastLog(cmd *exec.Cmd) string {
	name := filepath.Base(cmd.Path)
	for _, f := range []string{name + ".out", name + ".log"} {
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

// Dir is the daemon's directory (configuration, logs, sockets).
func (d *Daemon) Dir() string { return d.dir }

// PID is libvirtd's process ID.
func (d *Daemon) PID() int {
	if d.libvirtd == nil {
		return 0
	}
	return d.libvirtd.Process.Pid
}

// Close stops libvirtd, then virtlogd if it started one: SIGTERM by PID,
// SIGKILL after 10 s. Domains still running keep running (libvirtd does
// not stop them): close the VMs first. A temporary directory made by
// StartDaemon is removed.
func (d *Daemon) Close() error {
	var errs []error
	for _, cmd := range []*exec.Cmd{d.libvirtd, d.virtlogd} {
		if cmd == nil {
			continue
		}
		done := d.done[cmd]
		select {
		case <-done:
			continue
		default:
		}
		_ = syscall.Kill(cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-done
			errs = append(errs, fmt.Errorf("libvirt: %s (pid %d) ignored SIGTERM", filepath.Base(cmd.Path), cmd.Process.Pid))
		}
	}
	d.log.Info("libvirtd stopped")
	if d.ownDir {
		errs = append(errs, os.RemoveAll(d.dir))
	}
	return errors.Join(errs...)
}
