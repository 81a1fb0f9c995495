// Command kiln-agent is Kiln's host daemon: it enrolls the host with a
// controller (enroll), serves the agent API over mTLS and sends heartbeats
// (run), and prints the host's facts (facts). See docs/agent.md.
package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	grpcbackoff "google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/kilnhq/kiln/agent/enroll"
	"github.com/kilnhq/kiln/agent/heartbeat"
	"github.com/kilnhq/kiln/agent/identity"
	"github.com/kilnhq/kiln/agent/journal"
	"github.com/kilnhq/kiln/agent/logring"
	"github.com/kilnhq/kiln/agent/metrics"
	"github.com/kilnhq/kiln/agent/reboot"
	"github.com/kilnhq/kiln/agent/renew"
	"github.com/kilnhq/kiln/agent/server"
	"github.com/kilnhq/kiln/host/command"
	"github.com/kilnhq/kiln/host/systemd"
	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/memtrim"
	"github.com/kilnhq/kiln/internal/units"
	"github.com/kilnhq/kiln/internal/version"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

const (
	defaultDataDir  = units.AgentDataDir
	defaultListen   = units.AgentListen
	defaultUnitPath = "/etc/systemd/system/" + units.AgentName
	// renewCheckInterval is how often run checks whether the certificate
	// has reached the last third of its validity.
	renewCheckInterval = time.Hour
	// journalRetention is how long finished operations stay re-attachable.
	journalRetention = 14 * 24 * time.Hour
	// logRingLines is how many recent log lines the Logs RPC can return.
	logRingLines = 2000
	// memoryTrimFirst and memoryTrimThreshold are how much the agent
	// allocates before its free heap pages go back to the OS, the first
	// time and then each time (docs/bench/agent.md); an idle agent
	// allocates ≈ 150 KiB a minute at the default heartbeat rate.
	memoryTrimFirst     = 1 << 20
	memoryTrimThreshold = 256 << 10
	// controllerReadBuffer is the read buffer of the connection to the
	// controller, which answers heartbeats with a few bytes.
	controllerReadBuffer = 4 << 10
	// defaultMemoryTrimInterval is how often that is checked.
	defaultMemoryTrimInterval = 30 * time.Second
)

func main() {
	if err := newRoot().ExecuteContext(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, "kiln-agent:", err)
		os.Exit(1)
	}
}

type globals struct {
	dataDir  string
	root     string
	logLevel string
}

func (g *globals) logger() *slog.Logger { return g.loggerTo(os.Stderr) }

func (g *globals) loggerTo(w io.Writer) *slog.Logger {
	var level slog.Level
	if err := level.UnmarshalText([]byte(g.logLevel)); err != nil {
		level = slog.LevelInfo
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: level}))
}

func newRoot() *cobra.Command {
	g := &globals{}
	root := &cobra.Command{
		Use:           "kiln-agent",
		Short:         "Kiln host agent: enrollment, agent API, heartbeats",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().StringVar(&g.dataDir, "data-dir", defaultDataDir, "directory of the agent's identity and operation journal")
	root.PersistentFlags().StringVar(&g.root, "root", "/", "root of the host's filesystem")
	root.PersistentFlags().StringVar(&g.logLevel, "log-level", "info", "debug, info, warn or error")
	root.AddCommand(newEnroll(g), newRun(g), newPreflight(g), newFacts(g), newVersion())
	return root
}

// signalContext is cmd's context, also cancelled by SIGINT and SIGTERM.
func signalContext(cmd *cobra.Command) (context.Context, context.CancelFunc) {
	return signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
}

type enrollFlags struct {
	controller, token, tokenFile, caHash, host string
	installUnit                                bool
	unitPath, listen                           string
}

func (f *enrollFlags) register(cmd *cobra.Command) {
	cmd.Flags().StringVar(&f.controller, "controller", "", "controller API address, host:port (https:// accepted)")
	cmd.Flags().StringVar(&f.token, "token", "", "one-time enrollment token <id>.<secret> (or KILN_TOKEN)")
	cmd.Flags().StringVar(&f.tokenFile, "token-file", "", "read the enrollment token from this file")
	cmd.Flags().StringVar(&f.caHash, "ca-hash", "", "pin of the controller CA, sha256:<hex> (kilnctl token create prints it)")
	cmd.Flags().StringVar(&f.host, "host", "", "host name to enroll as (default: the token's host, or this machine's hostname)")
}

func (f *enrollFlags) options(g *globals, log *slog.Logger) (enroll.Options, error) {
	tok := f.token
	if tok == "" && f.tokenFile != "" {
		b, err := os.ReadFile(f.tokenFile)
		if err != nil {
			return enroll.Options{}, fmt.Errorf("--token-file: %w", err)
		}
		tok = strings.TrimSpace(string(b))
	}
	if tok == "" {
		tok = os.Getenv("KILN_TOKEN")
	}
	return enroll.Options{
		ControllerAddr: f.controller,
		Token:          tok,
		CAHash:         f.caHash,
		Host:           f.host,
		DataDir:        g.dataDir,
		Log:            log,
	}, nil
}

func newEnroll(g *globals) *cobra.Command {
	f := &enrollFlags{}
	cmd := &cobra.Command{
		Use:   "enroll --controller ADDR --token TOKEN --ca-hash sha256:...",
		Short: "Enroll this host with a controller and store the agent's identity",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := signalContext(cmd)
			defer cancel()
			log := g.logger()
			o, err := f.options(g, log)
			if err != nil {
				return err
			}
			o.Facts = gatherFacts(ctx, g.root, log)
			id, err := enroll.Enroll(ctx, o)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "enrolled as host %q with controller %s; identity in %s\n", id.Host(), id.Controller.Address, g.dataDir)
			if f.installUnit {
				return installUnit(ctx, cmd.OutOrStdout(), f.unitPath, unitOptions{DataDir: g.dataDir, Listen: f.listen, Root: g.root}, log)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "start the agent with: kiln-agent run --data-dir %s\n", g.dataDir)
			return nil
		},
	}
	f.register(cmd)
	cmd.Flags().BoolVar(&f.installUnit, "install-unit", false, "write, enable and start the kiln-agent systemd unit")
	cmd.Flags().StringVar(&f.unitPath, "unit-path", defaultUnitPath, "where --install-unit writes the unit")
	cmd.Flags().StringVar(&f.listen, "listen", defaultListen, "agent API address the installed unit listens on")
	return cmd
}

// runOptions are run's flags.
type runOptions struct {
	listen, advertise              string
	heartbeatInterval              time.Duration
	rebootCommand, powerOffCommand string
	memoryTrimInterval             time.Duration
	releaseExecutable              bool
	fileTargets                    bool
	metricsListen                  string
	metricsTLSListen               string
}

func newRun(g *globals) *cobra.Command {
	f := &enrollFlags{}
	ro := runOptions{}
	cmd := &cobra.Command{
		Use:   "run",
		Short: "Serve the agent API and send heartbeats to the controller",
		Long: "Serve the agent API over mTLS and send heartbeats to the controller.\n\n" +
			"When the data directory holds no identity yet, run enrolls first with\n" +
			"--controller/--token/--ca-hash or, on boot media, with kiln.controller=,\n" +
			"kiln.token=, kiln.ca_hash= and kiln.host= from the kernel command line.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := signalContext(cmd)
			defer cancel()
			ring := logring.New(logRingLines)
			log := g.loggerTo(io.MultiWriter(os.Stderr, ring))
			id, err := identity.Load(g.dataDir)
			if errdefs.IsNotFound(err) {
				id, err = enrollAtBoot(ctx, g, f, log)
			}
			if err != nil {
				return err
			}
			return run(ctx, g, id, ro, ring, log)
		},
	}
	f.register(cmd)
	cmd.Flags().StringVar(&ro.listen, "listen", defaultListen, "address of the agent API")
	cmd.Flags().StringVar(&ro.metricsListen, "metrics-listen", "", "serve Prometheus metrics over plain HTTP at /metrics on this loopback address (127.0.0.1:PORT; off when empty; see docs/observability.md)")
	cmd.Flags().StringVar(&ro.metricsTLSListen, "metrics-tls-listen", "", "serve Prometheus metrics over mTLS at /metrics on this address (e.g. :9102) with the agent's certificate, to callers presenting a controller-CA certificate of role reader, operator, admin or controller (off when empty; see docs/observability.md)")
	cmd.Flags().StringVar(&ro.advertise, "advertise", "", "agent API address to tell the controller (default: the listen address, or the local IP towards the controller)")
	cmd.Flags().DurationVar(&ro.heartbeatInterval, "heartbeat-interval", heartbeat.DefaultInterval, "heartbeat interval until the controller names one")
	cmd.Flags().StringVar(&ro.rebootCommand, "reboot-command", "", `command the Reboot RPC runs, e.g. "systemctl reboot" (default: none, Reboot is refused)`)
	cmd.Flags().StringVar(&ro.powerOffCommand, "poweroff-command", "", `command Reboot with power_off runs, e.g. "systemctl poweroff" (default: none)`)
	cmd.Flags().DurationVar(&ro.memoryTrimInterval, "memory-trim-interval", defaultMemoryTrimInterval, "how often to check whether to return unused heap memory to the OS (after 1 MiB, then every 256 KiB allocated; 0: never)")
	cmd.Flags().BoolVar(&ro.fileTargets, "file-targets", false, "lab only: accept a root-disk hint that names a regular file (outside /dev) and lay images into it; without it only whole block devices are written")
	cmd.Flags().BoolVar(&ro.releaseExecutable, "release-executable-pages", true, "at every memory-trim check (the first 2 s after start), unmap the agent binary's clean read-only pages; they stay in the page cache and the ones still used come back on use")
	return cmd
}

// enrollAtBoot enrolls from flags or the kernel command line when the
// agent has no identity yet (boot media).
func enrollAtBoot(ctx context.Context, g *globals, f *enrollFlags, log *slog.Logger) (*identity.Identity, error) {
	o, err := f.options(g, log)
	if err != nil {
		return nil, err
	}
	if cmdline, err := os.ReadFile(filepath.Join(g.root, "proc/cmdline")); err == nil {
		o = enroll.FromCmdline(o, string(cmdline))
	}
	if o.ControllerAddr == "" || o.Token == "" || o.CAHash == "" {
		return nil, errdefs.FailedPrecondition("agent is not enrolled (no identity in %s): run kiln-agent enroll, or pass --controller, --token and --ca-hash", g.dataDir)
	}
	o.Facts = gatherFacts(ctx, g.root, log)
	// Boot media may start before the network or the controller is up:
	// retry while the controller is unreachable; anything else (a refused
	// token, a pin mismatch) is final.
	policy := backoff.Policy{Base: time.Second, Max: 30 * time.Second, Factor: 2}
	for attempt := 0; ; attempt++ {
		id, err := enroll.Enroll(ctx, o)
		if err == nil || !errdefs.IsUnavailable(err) || ctx.Err() != nil {
			return id, err
		}
		wait := policy.Delay(attempt, nil)
		log.Warn("controller unreachable; retrying enrollment", "error", err, "retry_in", wait)
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(wait):
		}
	}
}

func run(ctx context.Context, g *globals, id *identity.Identity, ro runOptions, logs server.LogSource, log *slog.Logger) error {
	if na := id.Certificate().Leaf.NotAfter; time.Now().After(na) {
		// Neither side accepts it any more, and renewal needs it: only a
		// new enrollment helps.
		return errdefs.FailedPrecondition("the agent certificate of host %q expired at %s: create a token (kilnctl token create --host %s), remove %s and enroll again",
			id.Host(), na.UTC().Format(time.RFC3339), id.Host(), filepath.Join(g.dataDir, identity.ControllerFile))
	}
	var met *metrics.Metrics
	var jopts []journal.Option
	if ro.metricsListen != "" {
		if err := metrics.CheckLoopback(ro.metricsListen); err != nil {
			return err
		}
	}
	if ro.metricsListen != "" || ro.metricsTLSListen != "" {
		met = metrics.New()
		jopts = append(jopts, journal.WithObserver(met))
	}
	j, err := journal.Open(filepath.Join(g.dataDir, "operations"), log, jopts...)
	if err != nil {
		return err
	}
	defer j.Close()
	for _, ml := range []struct {
		addr  string
		serve func(context.Context, net.Listener, *slog.Logger) error
		what  string
	}{
		{ro.metricsListen, met.Serve, "http"},
		{ro.metricsTLSListen, func(ctx context.Context, lis net.Listener, log *slog.Logger) error {
			return met.ServeTLS(ctx, lis, id.ServerTLS(), log)
		}, "https (mTLS)"},
	} {
		if ml.addr == "" {
			continue
		}
		mlis, err := net.Listen("tcp", ml.addr)
		if err != nil {
			return fmt.Errorf("metrics: listen on %s: %w", ml.addr, err)
		}
		mctx, stopMetrics := context.WithCancel(ctx)
		metricsDone := make(chan struct{})
		go func() {
			defer close(metricsDone)
			if err := ml.serve(mctx, mlis, log); err != nil {
				log.Warn("metrics server stopped", "error", err)
			}
		}()
		defer func() { stopMetrics(); <-metricsDone }()
		log.Info("metrics serving", "addr", mlis.Addr().String(), "path", "/metrics", "scheme", ml.what)
	}
	if n, err := j.Prune(time.Now().Add(-journalRetention)); err != nil {
		log.Warn("pruning the operation journal failed", "error", err)
	} else if n > 0 {
		log.Info("pruned old operations", "count", n, "older_than", journalRetention)
	}

	lis, err := net.Listen("tcp", ro.listen)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", ro.listen, err)
	}
	if ro.fileTargets {
		log.Warn("file-target mode: images may be laid into regular files (a lab, not a real host)")
	}
	opts := services(g.root, ro.fileTargets, j, met, log)
	opts.Logs = logs
	opts.Rebooter = &reboot.Commands{RebootCommand: ro.rebootCommand, PowerOffCommand: ro.powerOffCommand, Runner: command.Exec{}, Log: log}
	svc := server.New(opts)
	gs := server.NewGRPCServer(id.ServerTLS(), svc)

	la := &heartbeat.LocalAddr{}
	// The connection carries small heartbeats: a 4 KiB read buffer instead
	// of 32 KiB, and the write buffer goes back to a pool between writes.
	dial := func() (*grpc.ClientConn, error) {
		return grpc.NewClient(id.Address(),
			grpc.WithTransportCredentials(credentials.NewTLS(id.ClientTLS())),
			grpc.WithContextDialer(la.Dialer()),
			grpc.WithReadBufferSize(controllerReadBuffer),
			grpc.WithSharedWriteBuffer(true),
			// A restarted or newly elected controller hears from every agent
			// within seconds: gRPC's default reconnect backoff grows to 2 min.
			grpc.WithConnectParams(grpc.ConnectParams{Backoff: controllerBackoff, MinConnectTimeout: 10 * time.Second}))
	}
	// The connection carries small heartbeats: a 4 KiB read buffer instead
	// of 32 KiB, and the write buffer goes back to a pool between writes.
	ctl, err := newControllerConn(dial)
	if err != nil {
		lis.Close()
		return fmt.Errorf("controller %s: %w", id.Controller.Address, err)
	}
	defer ctl.Close()
	adv := heartbeat.Advertise(lis.Addr().String(), la)
	if ro.advertise != "" {
		adv = func() string { return ro.advertise }
	}
	agents := ctl
	rl := &renew.Loop{Client: agents, Identity: id, Dir: g.dataDir, Interval: renewCheckInterval, Log: log,
		// A TLS connection keeps the certificate it was made with: use
		// the new one at once (a CA rotation waits for it).
		Observe: func(err error) {
			if err == nil {
				if err := ctl.Redial(); err != nil {
					log.Warn("reconnecting with the renewed certificate failed", "error", err)
				}
			}
		}}
	hb := heartbeat.New(heartbeat.Options{
		Client:   agents,
		Address:  adv,
		Facts:    facter{root: g.root},
		Version:  version.Version,
		Interval: ro.heartbeatInterval,
		Log:      log,
		Observe:  observeAll(followRotation(id, g.dataDir, rl, log), followMove(id, g.dataDir, ctl, probeController(id), log)),
	})

	log.Info("agent serving", "listen", lis.Addr().String(), "host", id.Host(), "controller", id.Controller.Address, "version", version.Version)
	ctx, cancel := context.WithCancel(ctx) // the loops also end when serving fails
	defer cancel()
	hbDone, renewDone, trimDone := make(chan struct{}), make(chan struct{}), make(chan struct{})
	go func() {
		defer close(trimDone)
		if ro.memoryTrimInterval > 0 {
			t := memtrim.New(memoryTrimFirst, memoryTrimThreshold)
			t.Executable = ro.releaseExecutable
			t.Run(ctx, ro.memoryTrimInterval)
		}
	}()
	go func() {
		defer close(hbDone)
		_ = hb.Run(ctx)
	}()
	go func() {
		defer close(renewDone)
		_ = rl.Run(ctx)
	}()
	// Type=notify: the listener is bound, so systemd may call the agent
	// started; then keep petting its watchdog (WatchdogSec=) while the
	// agent runs. Both do nothing outside a unit.
	if _, err := systemd.NotifyReady(); err != nil {
		log.Warn("telling systemd the agent is ready failed", "error", err)
	}
	wdDone := make(chan struct{})
	go func() {
		defer close(wdDone)
		if err := systemd.RunWatchdog(ctx); err != nil {
			log.Warn("systemd watchdog stopped", "error", err)
		}
	}()
	err = server.Serve(ctx, gs, lis)
	cancel()
	<-hbDone
	<-renewDone
	<-trimDone
	<-wdDone
	if err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("serve: %w", err)
	}
	log.Info("agent stopped")
	return nil
}

// controllerConn is the agent's connection to the controller, replaced
// after a renewal so that the new certificate is presented at once.
type controllerConn struct {
	dial func() (*grpc.ClientConn, error)
	mu   sync.Mutex
	conn *grpc.ClientConn
}

func newControllerConn(dial func() (*grpc.ClientConn, error)) (*controllerConn, error) {
	conn, err := dial()
	if err != nil {
		return nil, err
	}
	return &controllerConn{dial: dial, conn: conn}, nil
}

func (c *controllerConn) client() controllerv1.AgentsClient {
	c.mu.Lock()
	defer c.mu.Unlock()
	return controllerv1.NewAgentsClient(c.conn)
}

// Heartbeat is controllerv1.AgentsClient's.
func (c *controllerConn) Heartbeat(ctx context.Context, in *controllerv1.HeartbeatRequest, opts ...grpc.CallOption) (*controllerv1.HeartbeatResponse, error) {
	return c.client().Heartbeat(ctx, in, opts...)
}

// Renew is controllerv1.AgentsClient's.
func (c *controllerConn) Renew(ctx context.Context, in *controllerv1.RenewRequest, opts ...grpc.CallOption) (*controllerv1.RenewResponse, error) {
	return c.client().Renew(ctx, in, opts...)
}

// Redial replaces the connection with a new one (a new TLS handshake) and
// closes the old one.
func (c *controllerConn) Redial() error {
	conn, err := c.dial()
	if err != nil {
		return err
	}
	c.mu.Lock()
	old := c.conn
	c.conn = conn
	c.mu.Unlock()
	return old.Close()
}

// Close closes the connection.
func (c *controllerConn) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.conn.Close()
}

// observeAll calls each of fs with every heartbeat answer.
func observeAll(fs ...func(*controllerv1.HeartbeatResponse, error)) func(*controllerv1.HeartbeatResponse, error) {
	return func(resp *controllerv1.HeartbeatResponse, err error) {
		for _, f := range fs {
			f(resp, err)
		}
	}
}

// probeController checks that a controller at addr holds a certificate of
// a CA the identity trusts, with the controller role (a TLS handshake, as
// every call to it makes).
func probeController(id *identity.Identity) func(ctx context.Context, addr string) error {
	return func(ctx context.Context, addr string) error {
		conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
		if err != nil {
			return err
		}
		defer conn.Close()
		return tls.Client(conn, id.ClientTLS()).HandshakeContext(ctx)
	}
}

// followMove follows a move of the fleet (kilnctl move): when the
// controller answers with the address it moved to, and a controller
// there holds a certificate of a CA this agent trusts, the agent stores
// the new address and heartbeats there from then on. A controller there
// that cannot be reached or is not trusted leaves everything as it was
// (tried again on the next answer).
func followMove(id *identity.Identity, dir string, ctl *controllerConn, probe func(context.Context, string) error, log *slog.Logger) func(*controllerv1.HeartbeatResponse, error) {
	return func(resp *controllerv1.HeartbeatResponse, err error) {
		to := resp.GetMovedTo()
		if err != nil || to == "" || to == id.Address() {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := probe(ctx, to); err != nil {
			log.Warn("controller says the fleet moved; not following", "from", id.Address(), "to", to, "error", err)
			return
		}
		from := id.Address()
		if _, err := id.SetAddress(dir, to); err != nil {
			log.Warn("controller says the fleet moved; not following", "from", from, "to", to, "error", err)
			return
		}
		if err := ctl.Redial(); err != nil {
			log.Warn("redial after the move", "to", to, "error", err)
		}
		log.Info("controller moved: heartbeats go to the new controller", "from", from, "to", to)
	}
}

// followRotation follows a CA rotation (kiln-controller rotate-ca)
// through heartbeat answers: it trusts the CAs the controller names and
// renews at once when the controller asks.
func followRotation(id *identity.Identity, dir string, rl *renew.Loop, log *slog.Logger) func(*controllerv1.HeartbeatResponse, error) {
	return func(resp *controllerv1.HeartbeatResponse, err error) {
		if err != nil {
			return
		}
		if b := resp.GetCaBundlePem(); len(b) > 0 {
			changed, err := id.SetTrust(dir, b)
			switch {
			case err != nil:
				log.Warn("controller CAs not taken", "error", err)
			case changed:
				log.Info("controller CAs changed", "cas", len(id.CAs()), "ca_hash", id.Controller.CAHash)
			}
		}
		if resp.GetRenewCertificate() {
			rl.RenewNow()
		}
	}
}

func newFacts(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "facts",
		Short: "Print this host's facts as JSON",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := signalContext(cmd)
			defer cancel()
			f, err := facter{root: g.root}.Facts(ctx)
			if err != nil {
				return err
			}
			b, err := protojson.MarshalOptions{Multiline: true, Indent: "  "}.Marshal(f)
			if err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), string(b))
			return nil
		},
	}
}

func newVersion() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the agent's version",
		Args:  cobra.NoArgs,
		Run: func(cmd *cobra.Command, _ []string) {
			fmt.Fprintln(cmd.OutOrStdout(), version.Version)
		},
	}
}

// controllerBackoff is how the agent reconnects to the controller: from
// 1 s up to 10 s between attempts.
var controllerBackoff = grpcbackoff.Config{BaseDelay: time.Second, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 10 * time.Second}
