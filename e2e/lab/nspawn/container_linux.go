package nspawn

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Container is a system booted by Start. Its methods are safe for
// concurrent use. A reboot inside ends nspawn and with it the Container
// (e2e/lab/netns relaunches for reboots; a Container does not).
type Container struct {
	o       Options
	cg      Cgroups
	console string
	tmp     bool // console is a temporary file of ours
	pid     int
	done    chan struct{}
	exit    error // nspawn's exit status, set before done closes
}

// Start boots o.Dir: it creates the container's cgroups, then starts
// systemd-nspawn in them, in a session of its own, its output appended
// to o.Console. It returns once nspawn has started, not when the system
// is up (see WaitRunning). Should the calling program die, nspawn gets
// SIGTERM and powers the container off. Call Stop to end it and remove
// what it created. Equivalent to:
//
//	mkdir /sys/fs/cgroup/*/NAME
//	setsid sh -c 'for p in /sys/fs/cgroup/*/NAME/cgroup.procs; do echo $$ > "$p"; done
//	  exec env SYSTEMD_NSPAWN_API_VFS_WRITABLE=network systemd-nspawn ARGS...' >>CONSOLE 2>&1
//
// with ARGS from Args(o). It returns InvalidArgument for options without
// a name or directory, FailedPrecondition when not root or
// systemd-nspawn is missing, and the failing step's error otherwise.
func Start(o Options) (*Container, error) {
	if o.Name == "" || o.Dir == "" {
		return nil, errdefs.InvalidArgument("nspawn: a machine name and a root directory are required (name %q, dir %q)", o.Name, o.Dir)
	}
	if os.Geteuid() != 0 {
		return nil, errdefs.FailedPrecondition("nspawn %s: needs root", o.Name)
	}
	nspawn, err := exec.LookPath("systemd-nspawn")
	if err != nil {
		return nil, errdefs.FailedPrecondition("nspawn %s: systemd-nspawn not found (Debian package systemd-container)", o.Name)
	}
	if o.StopTimeout == 0 {
		o.StopTimeout = 45 * time.Second
	}
	c := &Container{o: o, cg: NewCgroups(o.Name), console: o.Console, done: make(chan struct{})}
	var console *os.File
	if c.console == "" {
		console, err = os.CreateTemp("", "kiln-nspawn-"+o.Name+"-*.log")
		c.tmp = true
	} else {
		console, err = os.OpenFile(c.console, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	}
	if err != nil {
		return nil, fmt.Errorf("nspawn %s: console: %w", o.Name, err)
	}
	c.console = console.Name()
	procs, err := c.cg.Create()
	if err != nil {
		console.Close()
		return nil, errors.Join(fmt.Errorf("nspawn %s: %w", o.Name, err), c.cleanup())
	}
	cmd := exec.Command("sh", append([]string{"-c", JoinScript(procs) + `; exec "$0" "$@"`, nspawn}, Args(o)...)...)
	cmd.Env = append(os.Environ(), Env(o)...)
	cmd.Stdout, cmd.Stderr = console, console
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Pdeathsig: syscall.SIGTERM}

	// The parent-death signal follows the thread that forked: fork from a
	// thread that stays ours until nspawn has ended.
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		err := cmd.Start()
		started <- err
		if err == nil {
			c.exit = cmd.Wait()
		}
		console.Close()
		close(c.done)
	}()
	if err := <-started; err != nil {
		<-c.done
		return nil, errors.Join(fmt.Errorf("nspawn %s: start: %w", o.Name, err), c.cleanup())
	}
	c.pid = cmd.Process.Pid
	return c, nil
}

// Name is the machine name.
func (c *Container) Name() string { return c.o.Name }

// PID is the systemd-nspawn process (the shell that became it).
func (c *Container) PID() int { return c.pid }

// Cgroups are the container's cgroups.
func (c *Container) Cgroups() Cgroups { return c.cg }

// ConsoleLog is the file that collects the container's console.
func (c *Container) ConsoleLog() string { return c.console }

// Done is closed when systemd-nspawn has exited.
func (c *Container) Done() <-chan struct{} { return c.done }

func (c *Container) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// Leader is the PID of the container's init (see LeaderOf), 0 before it
// exists and after nspawn has exited.
func (c *Container) Leader() int {
	if c.exited() {
		return 0
	}
	return LeaderOf(c.pid)
}

// ConsoleTail returns the last n lines of the console log.
func (c *Container) ConsoleTail(n int) string {
	b, _ := os.ReadFile(c.console)
	ls := strings.Split(strings.TrimSpace(string(b)), "\n")
	return strings.Join(ls[max(0, len(ls)-n):], "\n")
}

// WaitRunning blocks until the container's systemd reports the system
// running or degraded (the boot is over; degraded means some unit
// failed). It returns FailedPrecondition with the console's tail when
// nspawn exits first, and ctx's error with the last state and the
// console's tail when ctx ends first. Equivalent to: `nsenter -t LEADER
// -a systemctl is-system-running` until it prints running or degraded.
func (c *Container) WaitRunning(ctx context.Context) error {
	state := "no init yet"
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	for {
		if leader := c.Leader(); leader != 0 {
			qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			out, _ := exec.CommandContext(qctx, "nsenter", "-t", strconv.Itoa(leader), "-a", "systemctl", "is-system-running").Output()
			cancel()
			switch s := strings.TrimSpace(string(out)); s {
			case "running", "degraded":
				return nil
			case "":
			default:
				state = s
			}
		}
		select {
		case <-c.done:
			return errdefs.FailedPrecondition("nspawn %s: systemd-nspawn exited (%v) before the system was up; console:\n%s", c.o.Name, c.exit, c.ConsoleTail(20))
		case <-ctx.Done():
			return fmt.Errorf("nspawn %s: waiting for the system to run (last state %q): %w; console:\n%s", c.o.Name, state, ctx.Err(), c.ConsoleTail(20))
		case <-t.C:
		}
	}
}

// Exec runs a command in all the namespaces of the container's init and
// returns its combined output; a failing command's error holds the
// output too. It returns FailedPrecondition when no init runs.
// Equivalent to: `nsenter -t LEADER -a NAME ARGS...`.
func (c *Container) Exec(ctx context.Context, name string, args ...string) (string, error) {
	leader := c.Leader()
	if leader == 0 {
		return "", errdefs.FailedPrecondition("nspawn %s: not running", c.o.Name)
	}
	out, err := exec.CommandContext(ctx, "nsenter", append([]string{"-t", strconv.Itoa(leader), "-a", name}, args...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("nspawn %s: %s %s: %w: %s", c.o.Name, name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return string(out), nil
}

// Poweroff asks the container's systemd to power off and blocks until
// nspawn has exited, or ctx ends (then it returns ctx's error, and the
// container may still be shutting down). When systemctl does not answer
// it sends SIGTERM to nspawn, which nspawn turns into a power-off of the
// container. A container that has already exited is not an error.
// Equivalent to: `nsenter -t LEADER -a systemctl poweroff --no-block`.
func (c *Container) Poweroff(ctx context.Context) error {
	if c.exited() {
		return nil
	}
	ectx, cancel := context.WithTimeout(ctx, 10*time.Second)
	_, err := c.Exec(ectx, "systemctl", "poweroff", "--no-block")
	cancel()
	if err != nil {
		_ = syscall.Kill(c.pid, syscall.SIGTERM)
	}
	select {
	case <-c.done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("nspawn %s: power off: %w", c.o.Name, ctx.Err())
	}
}

// Stop ends the container and removes what it left: a Poweroff bounded
// by ctx and Options.StopTimeout; when that does not end it, SIGTERM to
// nspawn and 15 s; then SIGKILL to its init (which ends its PID
// namespace) and to nspawn, by PID. Then it kills whatever is left in
// the container's cgroups, removes them deepest first, and removes
// nspawn's propagation directory (and the console log when it was a
// temporary one). It blocks until all that is done and returns the
// cleanup's errors. Stop may be called again.
func (c *Container) Stop(ctx context.Context) error {
	if !c.exited() {
		pctx, cancel := context.WithTimeout(ctx, c.o.StopTimeout)
		_ = c.Poweroff(pctx)
		cancel()
	}
	if !c.exited() {
		_ = syscall.Kill(c.pid, syscall.SIGTERM)
		select {
		case <-c.done:
		case <-time.After(15 * time.Second):
		}
	}
	if !c.exited() {
		if l := c.Leader(); l != 0 {
			_ = syscall.Kill(l, syscall.SIGKILL)
		}
		_ = syscall.Kill(c.pid, syscall.SIGKILL)
		<-c.done
	}
	return c.cleanup()
}

// cleanup kills what is left in the cgroups and removes them, the
// propagation directory and a temporary console log.
func (c *Container) cleanup() error {
	c.cg.Kill()
	err := c.cg.Remove()
	if e := os.RemoveAll(PropagateDir(c.o.Name)); e != nil {
		err = errors.Join(err, e)
	}
	if c.tmp {
		_ = os.Remove(c.console)
	}
	return err
}
