package machine

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// ProcessOptions configures a Process machine.
type ProcessOptions struct {
	// Command is the program and arguments a power-on starts, for example
	// {"sleep", "infinity"} or the agent binary in boot mode.
	Command []string
	// Env is added to the process environment. The machine also sets
	// KILN_BOOT_DEVICE (pxe, cd, disk), KILN_BOOT_SOURCE (pxe,
	// virtualmedia, disk: the agent's Facts.boot_source) and, when media is
	// inserted, KILN_BOOT_MEDIA (its URL).
	Env []string
	// Dir is the working directory of the process; "" is the current one.
	Dir string
	// GracePeriod bounds a graceful power-off: SIGTERM, then SIGKILL after
	// this long (default 5s).
	GracePeriod time.Duration
	// Logger receives lifecycle messages; nil discards them.
	Logger *slog.Logger
}

// Process is a Machine whose "power on" starts a process (in its own
// process group) and whose "power off" stops that process group by PID. A
// process that exits on its own leaves the machine powered off, like a host
// that halted.
type Process struct {
	opts ProcessOptions
	log  *slog.Logger

	mu    sync.Mutex
	cmd   *exec.Cmd
	done  chan struct{} // closed when cmd has been waited for
	boot  string
	media string
	runs  int
}

var _ Machine = (*Process)(nil)

// NewProcess returns a powered-off Process machine. It returns
// InvalidArgument when opts.Command is empty.
func NewProcess(opts ProcessOptions) (*Process, error) {
	if len(opts.Command) == 0 {
		return nil, errdefs.InvalidArgument("process machine: empty command")
	}
	if opts.GracePeriod <= 0 {
		opts.GracePeriod = 5 * time.Second
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Process{opts: opts, log: log.With("component", "lab-machine")}, nil
}

func bootSourceFact(dev string) string {
	if dev == BootCD {
		return "virtualmedia"
	}
	return dev
}

// PowerOn implements Machine. Equivalent to starting Command with the boot
// environment in a new process group.
func (p *Process) PowerOn(ctx context.Context, bootDevice string) error {
	if err := ValidBootDevice(bootDevice); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.runningLocked() {
		return nil
	}
	return p.startLocked(bootDevice)
}

func (p *Process) startLocked(bootDevice string) error {
	cmd := exec.Command(p.opts.Command[0], p.opts.Command[1:]...)
	cmd.Dir = p.opts.Dir
	cmd.Env = append(os.Environ(), p.opts.Env...)
	cmd.Env = append(cmd.Env,
		"KILN_BOOT_DEVICE="+bootDevice,
		"KILN_BOOT_SOURCE="+bootSourceFact(bootDevice))
	if p.media != "" {
		cmd.Env = append(cmd.Env, "KILN_BOOT_MEDIA="+p.media)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("power on: start %s: %w", p.opts.Command[0], err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	p.cmd, p.done, p.boot = cmd, done, bootDevice
	p.runs++
	p.log.Info("machine powered on", "pid", cmd.Process.Pid, "boot", bootDevice)
	return nil
}

func (p *Process) runningLocked() bool {
	if p.cmd == nil {
		return false
	}
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// PowerOff implements Machine. Equivalent to `kill -TERM -PGID` (graceful,
// then `kill -KILL -PGID` after the grace period or when ctx ends) or
// `kill -KILL -PGID` (hard).
func (p *Process) PowerOff(ctx context.Context, graceful bool) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stopLocked(ctx, graceful)
}

func (p *Process) stopLocked(ctx context.Context, graceful bool) error {
	if !p.runningLocked() {
		return nil
	}
	pid := p.cmd.Process.Pid
	if graceful {
		_ = syscall.Kill(-pid, syscall.SIGTERM)
		t := time.NewTimer(p.opts.GracePeriod)
		defer t.Stop()
		select {
		case <-p.done:
			p.log.Info("machine shut down", "pid", pid)
			return nil
		case <-t.C:
		case <-ctx.Done():
		}
	}
	_ = syscall.Kill(-pid, syscall.SIGKILL)
	<-p.done
	p.log.Info("machine powered off", "pid", pid)
	return nil
}

// Reset implements Machine: the process is killed and started again from
// the same boot device.
func (p *Process) Reset(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.runningLocked() {
		return errdefs.FailedPrecondition("reset: machine is off")
	}
	boot := p.boot
	if err := p.stopLocked(ctx, false); err != nil {
		return err
	}
	return p.startLocked(boot)
}

// State implements Machine.
func (p *Process) State() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.runningLocked()
}

// PID is the process ID of the running machine, 0 when off.
func (p *Process) PID() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.runningLocked() {
		return 0
	}
	return p.cmd.Process.Pid
}

// Runs counts the power-ons (process starts) so far.
func (p *Process) Runs() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.runs
}

// InsertMedia implements Machine; the URL reaches the next boot as
// KILN_BOOT_MEDIA.
func (p *Process) InsertMedia(url string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.media = url
	return nil
}

// BootSource implements Machine.
func (p *Process) BootSource() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.boot
}

// Close powers the machine off hard. Equivalent to `kill -KILL -PGID`.
func (p *Process) Close() error {
	return p.PowerOff(context.Background(), false)
}
