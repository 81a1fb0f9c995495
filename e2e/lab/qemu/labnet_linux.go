package qemu

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/vishvananda/netns"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// LabNetOptions describe a lab network for PXE: a network namespace with
// a bridge and a tap for one VM, isolated from the machine's uplink (the
// namespace has no other interface and no route out).
type LabNetOptions struct {
	// Name of the namespace (default kiln-pxe-<pid>-<random>).
	Name string
	// Bridge and Tap device names (default kbr0, ktap0).
	Bridge, Tap string
	// Address of the bridge in CIDR form (default 10.77.0.1/24) and its
	// IPv6 address (default fd77::1/64, for router advertisements).
	Address, Address6 string
	// Dir keeps dnsmasq's configuration, leases and log; required.
	Dir    string
	Logger *slog.Logger
}

// LabNet is a lab network namespace with a bridge, a tap for a VM, and
// optionally dnsmasq and TCP forwards into the host's loopback.
type LabNet struct {
	o   LabNetOptions
	log *slog.Logger

	mu        sync.Mutex
	dnsmasq   *exec.Cmd
	dnsDone   chan struct{}
	listeners []net.Listener
	conns     sync.WaitGroup
}

// NewLabNet creates the namespace, bridge and tap. Equivalent to:
//
//	ip netns add NAME
//	ip -n NAME link add kbr0 type bridge
//	ip -n NAME addr add 10.77.0.1/24 dev kbr0; ip -n NAME addr add fd77::1/64 dev kbr0 nodad
//	ip -n NAME tuntap add dev ktap0 mode tap; ip -n NAME link set ktap0 master kbr0
//	ip -n NAME link set lo/kbr0/ktap0 up
func NewLabNet(ctx context.Context, o LabNetOptions) (*LabNet, error) {
	if o.Dir == "" {
		return nil, errdefs.InvalidArgument("lab network: a directory is required")
	}
	if os.Geteuid() != 0 {
		return nil, errdefs.PermissionDenied("lab network: creating network namespaces needs root")
	}
	if o.Name == "" {
		o.Name = fmt.Sprintf("kiln-pxe-%d-%s", os.Getpid(), rand.Text()[:6])
	}
	if o.Bridge == "" {
		o.Bridge = "kbr0"
	}
	if o.Tap == "" {
		o.Tap = "ktap0"
	}
	if o.Address == "" {
		o.Address = "10.77.0.1/24"
	}
	if o.Address6 == "" {
		o.Address6 = "fd77::1/64"
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	n := &LabNet{o: o, log: log.With("component", "labnet", "netns", o.Name)}
	if _, err := ipCmd(ctx, "netns", "add", o.Name); err != nil {
		return nil, err
	}
	for _, args := range [][]string{
		{"link", "set", "lo", "up"},
		{"link", "add", o.Bridge, "type", "bridge"},
		{"addr", "add", o.Address, "dev", o.Bridge},
		{"addr", "add", o.Address6, "dev", o.Bridge, "nodad"},
		{"tuntap", "add", "dev", o.Tap, "mode", "tap"},
		{"link", "set", o.Tap, "master", o.Bridge},
		{"link", "set", o.Tap, "up"},
		{"link", "set", o.Bridge, "up"},
	} {
		if _, err := ipCmd(ctx, append([]string{"-n", o.Name}, args...)...); err != nil {
			_ = n.Close()
			return nil, err
		}
	}
	n.log.Info("lab network up", "bridge", o.Bridge, "tap", o.Tap, "address", o.Address)
	return n, nil
}

func ipCmd(ctx context.Context, args ...string) ([]byte, error) {
	out, err := exec.CommandContext(ctx, "ip", args...).CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return out, nil
}

// Name is the network namespace's name.
func (n *LabNet) Name() string { return n.o.Name }

// Tap is the tap device a VM attaches to (Network{Netns: Name(), Tap: Tap()}).
func (n *LabNet) Tap() string { return n.o.Tap }

// Bridge is the bridge's device name.
func (n *LabNet) Bridge() string { return n.o.Bridge }

// IP is the bridge's IPv4 address.
func (n *LabNet) IP() string { ip, _, _ := strings.Cut(n.o.Address, "/"); return ip }

// Listen opens a TCP listener on addr inside the namespace (the socket
// stays in the namespace; the caller's goroutines serve it as usual).
func (n *LabNet) Listen(addr string) (net.Listener, error) {
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("lab network: %w", err)
	}
	defer orig.Close()
	ns, err := netns.GetFromName(n.o.Name)
	if err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("lab network %s: %w", n.o.Name, err)
	}
	defer ns.Close()
	if err := netns.Set(ns); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("lab network %s: setns: %w", n.o.Name, err)
	}
	lis, lerr := net.Listen("tcp", addr)
	if err := netns.Set(orig); err != nil {
		// The thread is in the wrong namespace: let it die with this
		// goroutine instead of unlocking it.
		if lis != nil {
			lis.Close()
		}
		return nil, fmt.Errorf("lab network: restore namespace: %w", err)
	}
	runtime.UnlockOSThread()
	if lerr != nil {
		return nil, fmt.Errorf("lab network %s: %w", n.o.Name, lerr)
	}
	n.mu.Lock()
	n.listeners = append(n.listeners, lis)
	n.mu.Unlock()
	return lis, nil
}

// Forward accepts TCP connections on addr inside the namespace and
// connects each to target in the host's namespace (e.g. a controller on
// 127.0.0.1), so that VMs on the lab network reach services on loopback.
func (n *LabNet) Forward(addr, target string) error {
	lis, err := n.Listen(addr)
	if err != nil {
		return err
	}
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			n.conns.Add(1)
			go func() {
				defer n.conns.Done()
				defer c.Close()
				t, err := net.DialTimeout("tcp", target, 10*time.Second)
				if err != nil {
					n.log.Warn("forward", "target", target, "error", err)
					return
				}
				defer t.Close()
				done := make(chan struct{}, 2)
				go func() { _, _ = io.Copy(t, c); done <- struct{}{} }()
				go func() { _, _ = io.Copy(c, t); done <- struct{}{} }()
				<-done
			}()
		}
	}()
	return nil
}

// StartDnsmasq runs dnsmasq with conf inside the namespace until Close.
// Equivalent to: `ip netns exec NAME dnsmasq --keep-in-foreground --conf-file=DIR/dnsmasq.conf`.
func (n *LabNet) StartDnsmasq(ctx context.Context, conf string) error {
	if _, err := exec.LookPath("dnsmasq"); err != nil {
		return errdefs.NotFound("dnsmasq not found (apt-get install dnsmasq-base)")
	}
	cf := filepath.Join(n.o.Dir, "dnsmasq.conf")
	if err := os.WriteFile(cf, []byte(conf), 0o644); err != nil {
		return err
	}
	logf, err := os.OpenFile(filepath.Join(n.o.Dir, "dnsmasq.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command("ip", "netns", "exec", n.o.Name, "dnsmasq", "--keep-in-foreground", "--log-facility=-",
		"--conf-file="+cf, "--pid-file="+filepath.Join(n.o.Dir, "dnsmasq.pid"), "--user=root")
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("dnsmasq: %w", err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	n.mu.Lock()
	n.dnsmasq, n.dnsDone = cmd, done
	n.mu.Unlock()
	// dnsmasq exits at once on a bad configuration or a busy port.
	select {
	case <-done:
		b, _ := os.ReadFile(filepath.Join(n.o.Dir, "dnsmasq.log"))
		return fmt.Errorf("dnsmasq exited: %s", strings.TrimSpace(string(b)))
	case <-time.After(500 * time.Millisecond):
	case <-ctx.Done():
		return ctx.Err()
	}
	n.log.Info("dnsmasq started", "pid", cmd.Process.Pid)
	return nil
}

// Close stops dnsmasq by PID, closes listeners and forwards, and deletes
// the namespace with its bridge and tap. Equivalent to `kill PID; ip netns del NAME`.
func (n *LabNet) Close() error {
	n.mu.Lock()
	cmd, done, lis := n.dnsmasq, n.dnsDone, n.listeners
	n.dnsmasq, n.listeners = nil, nil
	n.mu.Unlock()
	if cmd != nil {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
	}
	for _, l := range lis {
		l.Close()
	}
	var errs []error
	if _, err := ipCmd(context.Background(), "netns", "del", n.o.Name); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
