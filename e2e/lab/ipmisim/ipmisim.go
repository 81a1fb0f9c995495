// Package ipmisim runs real IPMI BMCs for the lab: OpenIPMI's ipmi_sim
// serving IPMI over LAN on a loopback UDP port, with a chassis_control
// program (kiln-chassis) that drives a machine.Machine. ipmi_sim runs the
// program for every chassis request ("get power", "set power 1", "set boot
// pxe", ...); kiln-chassis forwards the request over a unix socket to this
// package's control server, which answers at once and acts on the
// machine, so ipmi_sim (single-threaded) is never kept waiting and the
// machine's processes never hold ipmi_sim's stdout.
//
// Boot devices set over IPMI apply to the next power-on only (ipmi_sim does
// not pass the persistent flag to the chassis program).
package ipmisim

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// Options configure one simulated BMC.
type Options struct {
	// Name of the ipmi_sim instance (default "kiln-<port>").
	Name string
	// Port is the UDP port on 127.0.0.1 (0 picks a free one).
	Port int
	// User and Password of the only (admin) user; no anonymous user is
	// defined.
	User     string
	Password string
	// ChassisProgram is the kiln-chassis binary (see BuildChassis).
	ChassisProgram string
	// Machine is what the chassis drives; required.
	Machine machine.Machine
	// Dir holds lan.conf, the emu file, state and the control socket
	// (default: a new temporary directory, removed by Stop).
	Dir string
	// IPMISim is the ipmi_sim binary (default: found on PATH).
	IPMISim string
	// Logger receives chassis requests; nil discards them.
	Logger *slog.Logger
}

// Sim is a running ipmi_sim instance.
type Sim struct {
	opts    Options
	log     *slog.Logger
	cmd     *exec.Cmd
	done    chan struct{}
	ln      net.Listener
	ownDir  bool
	stopped sync.Once

	mu    sync.Mutex
	boot  string // ipmi boot device for the next power-on: pxe, cdrom, default, bios
	calls []string
}

// Addr is host:port of the IPMI LAN interface.
func (s *Sim) Addr() string { return fmt.Sprintf("127.0.0.1:%d", s.opts.Port) }

// Port is the UDP port.
func (s *Sim) Port() int { return s.opts.Port }

// Dir is the directory holding the configuration, state and socket.
func (s *Sim) Dir() string { return s.opts.Dir }

// PID is ipmi_sim's process ID.
func (s *Sim) PID() int { return s.cmd.Process.Pid }

// Calls returns the chassis requests received so far ("get power",
// "set power 1", ...), oldest first.
func (s *Sim) Calls() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.calls...)
}

// Start writes the configuration, serves the chassis control socket and
// runs `ipmi_sim -c lan.conf -f kiln.emu -s state -n`. It returns once the
// simulator answers on its port (checked with ipmitool when present) or
// an error; ctx bounds the wait. It returns FailedPrecondition when
// ipmi_sim is missing.
func Start(ctx context.Context, opts Options) (*Sim, error) {
	if opts.Machine == nil || opts.ChassisProgram == "" || opts.User == "" || opts.Password == "" {
		return nil, errdefs.InvalidArgument("ipmisim: Machine, ChassisProgram, User and Password are required")
	}
	bin := opts.IPMISim
	if bin == "" {
		p, err := exec.LookPath("ipmi_sim")
		if err != nil {
			return nil, errdefs.FailedPrecondition("ipmisim: ipmi_sim not found (Debian package openipmi): %v", err)
		}
		bin = p
	}
	if opts.Port == 0 {
		p, err := freeUDPPort()
		if err != nil {
			return nil, err
		}
		opts.Port = p
	}
	if opts.Name == "" {
		opts.Name = fmt.Sprintf("kiln-%d", opts.Port)
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Sim{opts: opts, log: log.With("component", "ipmisim", "sim", opts.Name), boot: "default", done: make(chan struct{})}
	if s.opts.Dir == "" {
		d, err := os.MkdirTemp("", "kiln-ipmisim-")
		if err != nil {
			return nil, fmt.Errorf("ipmisim: %w", err)
		}
		s.opts.Dir, s.ownDir = d, true
	}
	if err := s.start(ctx, bin); err != nil {
		s.Stop()
		return nil, err
	}
	return s, nil
}

func (s *Sim) start(ctx context.Context, bin string) error {
	dir := s.opts.Dir
	state := filepath.Join(dir, "state")
	if err := os.MkdirAll(state, 0o700); err != nil {
		return fmt.Errorf("ipmisim: %w", err)
	}
	sock := filepath.Join(dir, "chassis.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return fmt.Errorf("ipmisim: control socket: %w", err)
	}
	s.ln = ln
	go s.serve()

	if err := os.WriteFile(filepath.Join(dir, "lan.conf"), []byte(s.lanConf(sock)), 0o600); err != nil {
		return fmt.Errorf("ipmisim: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "kiln.emu"), []byte(emu), 0o600); err != nil {
		return fmt.Errorf("ipmisim: %w", err)
	}
	logf, err := os.Create(filepath.Join(dir, "ipmi_sim.log"))
	if err != nil {
		return fmt.Errorf("ipmisim: %w", err)
	}
	defer logf.Close()
	cmd := exec.Command(bin, "-c", filepath.Join(dir, "lan.conf"), "-f", filepath.Join(dir, "kiln.emu"), "-s", state, "-n")
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("ipmisim: start ipmi_sim: %w", err)
	}
	s.cmd = cmd
	go func() {
		_ = cmd.Wait()
		close(s.done)
	}()
	return s.waitReady(ctx)
}

// waitReady polls `ipmitool ... mc info` until the simulator answers.
func (s *Sim) waitReady(ctx context.Context) error {
	tool, err := exec.LookPath("ipmitool")
	if err != nil {
		// Without ipmitool nobody can talk to it anyway; give it a moment.
		time.Sleep(300 * time.Millisecond)
		return nil
	}
	for {
		select {
		case <-s.done:
			out, _ := os.ReadFile(filepath.Join(s.opts.Dir, "ipmi_sim.log"))
			return fmt.Errorf("ipmisim: ipmi_sim exited: %s", strings.TrimSpace(string(out)))
		default:
		}
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		cmd := exec.CommandContext(cctx, tool, "-I", "lanplus", "-C", "3", "-N", "1", "-R", "1",
			"-H", "127.0.0.1", "-p", fmt.Sprint(s.opts.Port), "-U", s.opts.User, "-E", "mc", "info")
		cmd.Env = []string{"IPMITOOL_PASSWORD=" + s.opts.Password}
		err := cmd.Run()
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("ipmisim: ipmi_sim on port %d not answering: %w", s.opts.Port, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (s *Sim) lanConf(sock string) string {
	return fmt.Sprintf(`# Written by kiln e2e/lab/ipmisim.
name "%s"
set_working_mc 0x20
  startlan 1
    addr 127.0.0.1 %d
    priv_limit admin
    allowed_auths_callback md5
    allowed_auths_user md5
    allowed_auths_operator md5
    allowed_auths_admin md5
    guid %032x
  endlan
  chassis_control "%s %s"
  user 2 true "%s" "%s" admin 10 md5
`, s.opts.Name, s.opts.Port, s.opts.Port, s.opts.ChassisProgram, sock, s.opts.User, s.opts.Password)
}

// emu is the ipmi_sim command file: one BMC at 0x20.
const emu = `mc_setbmc 0x20
mc_add 0x20 0 no-device-sdrs 0x23 9 8 0x9f 0x1291 0xf02 persist_sdr
sel_enable 0x20 1000 0x0a
mc_enable 0x20
`

// Stop kills ipmi_sim by PID, stops the control server and removes the
// directory it created. Safe to call more than once.
func (s *Sim) Stop() {
	s.stopped.Do(func() {
		if s.cmd != nil && s.cmd.Process != nil {
			_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
			<-s.done
		}
		if s.ln != nil {
			_ = s.ln.Close()
		}
		if s.ownDir {
			_ = os.RemoveAll(s.opts.Dir)
		}
	})
}

func freeUDPPort() (int, error) {
	c, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("ipmisim: free port: %w", err)
	}
	defer c.Close()
	return c.LocalAddr().(*net.UDPAddr).Port, nil
}

// --- control server

func (s *Sim) serve() {
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		go s.handle(c)
	}
}

func (s *Sim) handle(c net.Conn) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) && line == "" {
		return
	}
	line = strings.TrimSpace(line)
	s.mu.Lock()
	s.calls = append(s.calls, line)
	s.mu.Unlock()
	s.log.Debug("chassis request", "request", line)
	out, err := s.request(strings.Fields(line))
	if err != nil {
		_, _ = fmt.Fprintf(c, "error: %v\n", err)
		return
	}
	_, _ = c.Write([]byte(out))
}

// ipmiBootToMachine maps ipmi_sim boot values to the lab's devices.
func ipmiBootToMachine(b string) string {
	switch b {
	case "pxe":
		return machine.BootPXE
	case "cdrom":
		return machine.BootCD
	}
	return machine.BootDisk
}

// NextBoot is the device the machine boots from when its OS reboots it
// (the one-time boot device is consumed).
func (s *Sim) NextBoot() string { return s.takeBoot() }

// takeBoot returns the device of the next power-on and clears the
// one-time override.
func (s *Sim) takeBoot() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	dev := ipmiBootToMachine(s.boot)
	s.boot = "default"
	return dev
}

// request answers one chassis program call: "get PARM..." or
// "set PARM VAL [PARM VAL...]".
func (s *Sim) request(args []string) (string, error) {
	if len(args) < 2 {
		return "", fmt.Errorf("short request %q", strings.Join(args, " "))
	}
	m := s.opts.Machine
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var out strings.Builder
	switch args[0] {
	case "get":
		for _, p := range args[1:] {
			switch p {
			case "power":
				v := 0
				if m.State() {
					v = 1
				}
				fmt.Fprintf(&out, "power:%d\n", v)
			case "boot":
				s.mu.Lock()
				fmt.Fprintf(&out, "boot:%s\n", s.boot)
				s.mu.Unlock()
			default:
				return "", fmt.Errorf("get %s: not supported", p)
			}
		}
	case "set":
		rest := args[1:]
		for len(rest) >= 2 {
			p, v := rest[0], rest[1]
			rest = rest[2:]
			var err error
			switch {
			case p == "power" && v == "1":
				if !m.State() {
					err = m.PowerOn(ctx, s.takeBoot())
				}
			case p == "power" && v == "0":
				err = m.PowerOff(ctx, false)
			case p == "shutdown" && v == "1":
				// Graceful: answer now, the OS takes its time.
				go func() {
					ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					defer cancel()
					_ = m.PowerOff(ctx, true)
				}()
			case p == "reset" && v == "1":
				if m.State() {
					if err = m.PowerOff(ctx, false); err == nil {
						err = m.PowerOn(ctx, s.takeBoot())
					}
				}
			case p == "boot":
				s.mu.Lock()
				s.boot = v
				s.mu.Unlock()
			case p == "shutdown" || p == "reset":
			default:
				err = fmt.Errorf("set %s %s: not supported", p, v)
			}
			if err != nil {
				return "", err
			}
		}
	default:
		return "", fmt.Errorf("unknown operation %q", args[0])
	}
	return out.String(), nil
}
