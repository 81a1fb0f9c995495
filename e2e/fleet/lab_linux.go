package fleet

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"

	"github.com/kilnhq/kiln/e2e/lab/netns"
	"github.com/kilnhq/kiln/e2e/lab/rack"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/kilnconfig"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// Ports the lab's controller listens on, on the lab bridge's gateway
// address (the only address of this machine the lab hosts can reach).
const (
	APIPort  = 7443
	BootPort = 8080
)

// Config describes a lab: which binaries to run, where to keep state, and
// the rack's shape.
type Config struct {
	// Name of the lab (1-8 lowercase letters or digits; default "kiln").
	Name string
	// Dir keeps everything the lab writes: the controller's data directory
	// and log, the rack's state, the controller's PID file.
	Dir string
	// Bin holds kiln-controller, kilnctl and kiln-agent.
	Bin string
	// Subnet is the lab's IPv4 /24 (default 10.251.250.0/24); the bridge
	// (and the controller) take .1.
	Subnet string
	// Hosts behind Redfish emulators, IPMI behind ipmi_sim (default 3 and 1).
	Hosts, IPMI int
	// RedfishAuth is the authentication mode of each Redfish emulator in
	// host order (kilnctl lab up --redfish-auth): both, basic or session.
	RedfishAuth []string
	// DiskSize of each host's sparse disk (default "8G").
	DiskSize string
	// Backend is the hosts' machine backend (kilnctl lab up --backend):
	// netns (the default), qemu or libvirt.
	Backend string
	// Memory and CPUs of each VM host (kilnctl lab up --memory, --cpus;
	// qemu and libvirt only; "" and 0 keep kilnctl's defaults).
	Memory string
	CPUs   int
	// MediaDir holds the agent boot media (kiln-imagebuilder bootmedia -o).
	MediaDir string
	// ImageDir holds the golden images the controller serves.
	ImageDir string
	// HeartbeatInterval agents are told to use (default 5s).
	HeartbeatInterval time.Duration
	// ControllerArgs are added to `kiln-controller run`.
	ControllerArgs []string
	// Out receives progress lines (default io.Discard).
	Out io.Writer
}

// Lab is a running lab: a rack made by `kilnctl lab up` and a
// kiln-controller serving it, each a process of its own, as a user runs
// them.
type Lab struct {
	cfg     Config
	gateway netip.Addr
	conn    *grpc.ClientConn
	res     controllerv1.ResourcesClient
	// dataDir, when set, replaces Dir/controller (UseDataDir).
	dataDir string
}

func (c *Config) defaults() error {
	if c.Name == "" {
		c.Name = "kiln"
	}
	if c.Dir == "" || c.Bin == "" {
		return errdefs.InvalidArgument("lab: Dir and Bin are required")
	}
	if c.Subnet == "" {
		c.Subnet = "10.251.250.0/24"
	}
	if c.Hosts == 0 && c.IPMI == 0 {
		c.Hosts, c.IPMI = 3, 1
	}
	if c.DiskSize == "" {
		c.DiskSize = "8G"
	}
	if c.HeartbeatInterval == 0 {
		c.HeartbeatInterval = 5 * time.Second
	}
	if c.Out == nil {
		c.Out = io.Discard
	}
	return nil
}

// New checks cfg and returns the lab it describes (nothing is started).
func New(cfg Config) (*Lab, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	pfx, err := netip.ParsePrefix(cfg.Subnet)
	if err != nil || pfx.Bits() != 24 || !pfx.Addr().Is4() {
		return nil, errdefs.InvalidArgument("lab subnet %q: want an IPv4 /24 such as 10.251.250.0/24", cfg.Subnet)
	}
	for _, b := range []string{"kiln-controller", "kilnctl", "kiln-agent"} {
		if _, err := os.Stat(filepath.Join(cfg.Bin, b)); err != nil {
			return nil, errdefs.NotFound("lab: %s not found in %s: run make build", b, cfg.Bin)
		}
	}
	return &Lab{cfg: cfg, gateway: pfx.Masked().Addr().Next()}, nil
}

// Subnet is the lab network (a /24).
func (l *Lab) Subnet() string { return l.cfg.Subnet }

// HostResource is the Host resource name of the lab's i-th host (1-based):
// hosts 1..Hosts are behind Redfish emulators, the rest behind ipmi_sim.
func (l *Lab) HostResource(i int) string {
	return rack.ResourceName(l.cfg.Name, fmt.Sprintf("h%d", i))
}

// HostAddress is the lab's i-th host's address on the lab network
// (1-based, as HostResource): kilnctl lab up gives host i the gateway's
// address plus i.
func (l *Lab) HostAddress(i int) string {
	a := l.gateway
	for range i {
		a = a.Next()
	}
	return a.String()
}

// APIServerEndpoint is the lab's API load balancer (kilnctl lab up
// --apiserver-lb): the controlPlaneEndpoint of the lab's clusters.
func (l *Lab) APIServerEndpoint() string {
	return net.JoinHostPort(l.Gateway(), strconv.Itoa(rack.APIServerPort))
}

// Gateway is the lab bridge's address, where the controller listens.
func (l *Lab) Gateway() string { return l.gateway.String() }

// APIAddr is the controller's gRPC address.
func (l *Lab) APIAddr() string {
	return net.JoinHostPort(l.Gateway(), strconv.Itoa(APIPort))
}

// BootURL is the controller's boot server as the hosts reach it.
func (l *Lab) BootURL() string {
	return "http://" + net.JoinHostPort(l.Gateway(), strconv.Itoa(BootPort))
}

// StateDir is the rack's state directory (kilnctl lab --state-dir).
func (l *Lab) StateDir() string { return filepath.Join(l.cfg.Dir, "rack") }

// DataDir is the controller's data directory: Dir/controller, or the one
// UseDataDir named.
func (l *Lab) DataDir() string {
	if l.dataDir != "" {
		return l.dataDir
	}
	return filepath.Join(l.cfg.Dir, "controller")
}

// UseDataDir makes dir the controller's data directory from now on (a
// controller restored into a new directory): StartController runs the
// controller on it, with the same flags otherwise, and Kilnctl uses the
// admin kilnconfig written there.
func (l *Lab) UseDataDir(dir string) {
	l.closeClient()
	l.dataDir = dir
}

// Kilnconfig is the admin kilnconfig the controller writes.
func (l *Lab) Kilnconfig() string { return filepath.Join(l.DataDir(), "kilnconfig-admin.yaml") }

func (l *Lab) pidFile() string { return filepath.Join(l.cfg.Dir, "controller.pid") }

// ControllerLog is the controller's log file.
func (l *Lab) ControllerLog() string { return filepath.Join(l.cfg.Dir, "controller.log") }

func (l *Lab) say(format string, args ...any) {
	fmt.Fprintf(l.cfg.Out, "lab: "+format+"\n", args...)
}

// KilnctlPath is the lab's kilnctl binary.
func (l *Lab) KilnctlPath() string { return filepath.Join(l.cfg.Bin, "kilnctl") }

// Kilnctl runs kilnctl against the lab's controller (and rack) and returns
// its standard output; stdin, when not nil, is its input.
func (l *Lab) Kilnctl(ctx context.Context, stdin []byte, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(l.cfg.Bin, "kilnctl"), args...)
	cmd.Env = append(os.Environ(), kilnconfig.EnvVar+"="+l.Kilnconfig())
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("kilnctl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return out.String(), nil
}

func (l *Lab) labArgs(args ...string) []string {
	return append([]string{"lab", "--name", l.cfg.Name, "--state-dir", l.StateDir()}, args...)
}

// Up creates the rack, starts the controller on the lab bridge and
// registers the rack's hosts as Host resources. On error, what was created
// stays for Down (which is always safe to call).
func (l *Lab) Up(ctx context.Context) error {
	if err := l.UpRack(ctx); err != nil {
		return err
	}
	if err := l.StartController(ctx); err != nil {
		return err
	}
	return l.RegisterHosts(ctx)
}

// UpRack creates the rack (kilnctl lab up): hosts powered off behind their
// BMCs.
func (l *Lab) UpRack(ctx context.Context) error {
	if err := os.MkdirAll(l.cfg.Dir, 0o700); err != nil {
		return fmt.Errorf("lab: %w", err)
	}
	l.say("creating the rack: %d Redfish and %d IPMI %s hosts on %s (kilnctl lab up)", l.cfg.Hosts, l.cfg.IPMI, cmp.Or(l.cfg.Backend, "netns"), l.cfg.Subnet)
	args := l.labArgs("up", "--hosts", strconv.Itoa(l.cfg.Hosts), "--ipmi", strconv.Itoa(l.cfg.IPMI),
		"--subnet", l.cfg.Subnet, "--agent", filepath.Join(l.cfg.Bin, "kiln-agent"), "--boot-url", l.BootURL()+"/boot/ipxe/{host}",
		"--disk-size", l.cfg.DiskSize, "--apiserver-lb", "--redfish-auth", strings.Join(l.cfg.RedfishAuth, ","))
	if l.cfg.Backend != "" {
		args = append(args, "--backend", l.cfg.Backend)
	}
	if l.cfg.Memory != "" {
		args = append(args, "--memory", l.cfg.Memory)
	}
	if l.cfg.CPUs > 0 {
		args = append(args, "--cpus", strconv.Itoa(l.cfg.CPUs))
	}
	out, err := l.Kilnctl(ctx, nil, args...)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(l.cfg.Dir, "rack.txt"), []byte(out), 0o600); err != nil {
		return fmt.Errorf("lab: %w", err)
	}
	return nil
}

// RegisterHosts applies the rack's hosts as Host resources (kilnctl lab
// hosts | kilnctl apply -f -).
func (l *Lab) RegisterHosts(ctx context.Context) error {
	l.say("registering the rack's hosts (kilnctl lab hosts | kilnctl apply -f -)")
	hosts, err := l.HostsYAML(ctx)
	if err != nil {
		return err
	}
	if _, err := l.Kilnctl(ctx, []byte(hosts), "apply", "-f", "-"); err != nil {
		return err
	}
	return nil
}

// HostsYAML is the rack's hosts as Host resources (kilnctl lab hosts),
// for a caller that labels them before it applies them.
func (l *Lab) HostsYAML(ctx context.Context) (string, error) {
	return l.Kilnctl(ctx, nil, l.labArgs("hosts")...)
}

// StartController starts kiln-controller in the background (its own
// session, log in ControllerLog) and waits until its API answers. The
// controller keeps its state in DataDir, so a restart after KillController
// picks up where the last one stopped.
func (l *Lab) StartController(ctx context.Context) error {
	if id, err := os.ReadFile(l.pidFile()); err == nil && netns.ProcessAlive(strings.TrimSpace(string(id))) {
		return errdefs.AlreadyExists("lab: a controller already runs (%s)", strings.TrimSpace(string(id)))
	}
	args := []string{"run", "--data-dir", l.DataDir(), "--listen", l.APIAddr(), "--server-name", l.Gateway(),
		"--boot-listen", net.JoinHostPort(l.Gateway(), strconv.Itoa(BootPort)),
		"--boot-url", l.BootURL(), "--boot-media-dir", l.cfg.MediaDir, "--image-dir", l.cfg.ImageDir,
		"--controller-url", "https://" + l.APIAddr(), "--heartbeat-interval", l.cfg.HeartbeatInterval.String()}
	args = append(args, l.cfg.ControllerArgs...)
	logf, err := os.OpenFile(l.ControllerLog(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("lab: controller log: %w", err)
	}
	defer logf.Close()
	fmt.Fprintf(logf, "---- %s kiln-controller %s\n", time.Now().UTC().Format(time.RFC3339), strings.Join(args, " "))
	cmd := exec.Command(filepath.Join(l.cfg.Bin, "kiln-controller"), args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("lab: start kiln-controller: %w", err)
	}
	id := netns.ProcessID(cmd.Process.Pid)
	// Reap it when it ends while we run; others find it by PID file.
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	if err := os.WriteFile(l.pidFile(), []byte(id+"\n"), 0o600); err != nil {
		_ = netns.KillProcess(id)
		return fmt.Errorf("lab: %w", err)
	}
	l.say("controller started (PID %d): API %s, boot server %s, log %s", cmd.Process.Pid, l.APIAddr(), l.BootURL(), l.ControllerLog())
	deadline := time.NewTimer(2 * time.Minute)
	defer deadline.Stop()
	for {
		select {
		case err := <-exited:
			return fmt.Errorf("lab: kiln-controller exited: %v; last lines of %s:\n%s", err, l.ControllerLog(), tailFile(l.ControllerLog(), 20))
		case <-deadline.C:
			return fmt.Errorf("lab: kiln-controller did not answer within 2m; last lines of %s:\n%s", l.ControllerLog(), tailFile(l.ControllerLog(), 20))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(300 * time.Millisecond):
		}
		if _, err := os.Stat(l.Kilnconfig()); err != nil {
			continue
		}
		if _, err := l.Kilnctl(ctx, nil, "get", "hosts"); err == nil {
			return nil
		}
	}
}

// KillController kills the controller with SIGKILL (a crash), by PID.
func (l *Lab) KillController() error {
	b, err := os.ReadFile(l.pidFile())
	if err != nil {
		return fmt.Errorf("lab: no controller PID file: %w", err)
	}
	l.closeClient()
	return netns.KillProcess(strings.TrimSpace(string(b)))
}

// StopController stops the controller: SIGTERM, then SIGKILL after 30 s.
func (l *Lab) StopController() error {
	b, err := os.ReadFile(l.pidFile())
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	l.closeClient()
	id := strings.TrimSpace(string(b))
	if netns.ProcessAlive(id) {
		pid, _ := strconv.Atoi(strings.SplitN(id, ":", 2)[0])
		_ = syscall.Kill(pid, syscall.SIGTERM)
		for i := 0; i < 300 && netns.ProcessAlive(id); i++ {
			time.Sleep(100 * time.Millisecond)
		}
		if err := netns.KillProcess(id); err != nil {
			return err
		}
	}
	return os.Remove(l.pidFile())
}

// Client returns a client of the controller's resources API (admin).
func (l *Lab) Client(ctx context.Context) (controllerv1.ResourcesClient, error) {
	if l.res != nil {
		return l.res, nil
	}
	cfg, err := kilnconfig.Load(l.Kilnconfig())
	if err != nil {
		return nil, err
	}
	conn, err := kilnconfig.Dial(ctx, cfg)
	if err != nil {
		return nil, err
	}
	l.conn, l.res = conn, controllerv1.NewResourcesClient(conn)
	return l.res, nil
}

func (l *Lab) closeClient() {
	if l.conn != nil {
		_ = l.conn.Close()
	}
	l.conn, l.res = nil, nil
}

// Down stops the controller and removes the rack (kilnctl lab down). It
// works after a crash of either, and can be run again.
func (l *Lab) Down(ctx context.Context) error {
	var errs []error
	if err := l.StopController(); err != nil {
		errs = append(errs, fmt.Errorf("stop controller: %w", err))
	}
	if _, err := os.Stat(l.StateDir()); err == nil {
		if _, err := l.Kilnctl(ctx, nil, l.labArgs("down")...); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// tailFile returns the last n lines of a file.
func tailFile(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	ls := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(ls[max(0, len(ls)-n):], "\n")
}
