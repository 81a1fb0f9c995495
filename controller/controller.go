// Package controller is the Kiln controller daemon: it keeps its state in
// etcd (embedded by default), holds the CA that agents and operators trust,
// serves the Resources, Enrollment and Agents gRPC services over mutual TLS
// on every replica, and runs the reconcilers on the one replica that wins
// the leader election.
package controller

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"

	"github.com/kilnhq/kiln/bmc"
	"github.com/kilnhq/kiln/controller/api"
	"github.com/kilnhq/kiln/controller/audit"
	"github.com/kilnhq/kiln/controller/authz"
	"github.com/kilnhq/kiln/controller/bootserver"
	"github.com/kilnhq/kiln/controller/bootservice"
	"github.com/kilnhq/kiln/controller/clusterexec"
	"github.com/kilnhq/kiln/controller/datadir"
	"github.com/kilnhq/kiln/controller/drain"
	"github.com/kilnhq/kiln/controller/election"
	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/gitsource"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/limits"
	"github.com/kilnhq/kiln/controller/liveness"
	"github.com/kilnhq/kiln/controller/metrics"
	"github.com/kilnhq/kiln/controller/operatorcert"
	"github.com/kilnhq/kiln/controller/provision"
	"github.com/kilnhq/kiln/controller/resources"
	"github.com/kilnhq/kiln/controller/rolloutexec"
	"github.com/kilnhq/kiln/controller/shard"
	"github.com/kilnhq/kiln/controller/shardlife"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/sweep"
	"github.com/kilnhq/kiln/controller/topologyexec"
	"github.com/kilnhq/kiln/controller/trust"
	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/kilnconfig"
	"github.com/kilnhq/kiln/internal/pki"
	"github.com/kilnhq/kiln/internal/seal"
)

// Defaults of Config.
const (
	DefaultListenAddr        = ":7443"
	DefaultElectionTTL       = 5 * time.Second
	DefaultReconcileInterval = 5 * time.Second
	// DefaultAgentSilence is how long an agent may miss heartbeats before
	// its Host is marked AgentReachable=False (three heartbeats).
	DefaultAgentSilence = 3 * enrollment.DefaultHeartbeatInterval
)

// Config configures a controller replica.
type Config struct {
	// DataDir holds the embedded etcd, the sealing key and the admin
	// kilnconfig. Required.
	DataDir string
	// GitFileRoots are the directories a GitSource's file:// repository
	// may lie under (--gitsource-file-root); none refuses file://.
	GitFileRoots []string
	// ListenAddr is the gRPC API address (DefaultListenAddr). Port 0 picks
	// a free port; Addr reports it.
	ListenAddr string
	// ReservedNetworks are networks no new Cluster's pod or service CIDR
	// may overlap, besides the controller's own subnets (`kiln-controller
	// run --reserved-network`): networks the operator declares, such as a
	// provisioning or BMC network the controller is not on. Networks that
	// agents report only warn.
	ReservedNetworks []netip.Prefix
	// ServerNames are extra DNS names or IPs for the server certificate,
	// besides localhost, loopback, the host name and the listen address.
	ServerNames []string
	// EtcdEndpoints are the client URLs of an external etcd cluster;
	// empty runs a single-member etcd embedded in DataDir/etcd.
	EtcdEndpoints []string
	// EtcdCAFile, EtcdCertFile and EtcdKeyFile are PEM files for an
	// external etcd served over TLS (https:// endpoints), as etcdctl's
	// --cacert, --cert and --key: the CA that signed the members'
	// certificates (empty: the system's roots) and the controller's client
	// certificate and key (both or neither).
	EtcdCAFile, EtcdCertFile, EtcdKeyFile string
	// EtcdCompaction and EtcdQuotaBytes tune the embedded etcd (ignored
	// with EtcdEndpoints): the history it keeps and its database quota
	// (store.EmbeddedConfig; zero values: the defaults).
	EtcdCompaction store.Compaction
	EtcdQuotaBytes int64
	// SecretKeyFile is the AES-256 key sealing secrets at rest (default
	// DataDir/secret.key, created when missing). Replicas sharing one etcd
	// must use the same key.
	SecretKeyFile string
	// ID names this replica in the leader election (default: host name
	// and process id).
	ID string
	// Clock is the time source (time.Now).
	Clock func() time.Time
	// ElectionTTL is the leader lease; a crashed leader is replaced after
	// about this long (DefaultElectionTTL).
	ElectionTTL time.Duration
	// ReconcileInterval is how often the leader's reconcilers run
	// (DefaultReconcileInterval).
	ReconcileInterval time.Duration
	// ClusterWorkers is how many clusters the leader reconciles at once
	// (clusterexec.Config.ClusterWorkers; 0: its default).
	ClusterWorkers int
	// LongActions is how many drains, etcd member removals and machine
	// deletions run at once across clusters, one per cluster
	// (clusterexec.Config.LongActions; 0: its default).
	LongActions int
	// DrainTimeout is the deadline of control-plane drains and of drains
	// of MachineDeployments without nodeDrainTimeout
	// (clusterexec.DefaultDrainTimeout when 0).
	DrainTimeout time.Duration
	// HeartbeatInterval is the interval agents are told to use.
	HeartbeatInterval time.Duration
	// AgentSilence is how long an agent may be silent before its Host gets
	// AgentReachable=False (DefaultAgentSilence).
	AgentSilence time.Duration
	// Lifecycle runs the host lifecycle (controller/provision: power, agent
	// boot media, image laying) and the cluster executor
	// (controller/clusterexec) on the leader. Off in a zero Config, which
	// tests use to keep hosts still; `kiln-controller run` turns it on
	// unless --api-only.
	Lifecycle bool
	// APIOnly serves the API and nothing else: the replica neither runs
	// the lifecycle nor campaigns for leadership, so a replica that does
	// run it always leads (`kiln-controller run --api-only`, see
	// docs/controller.md). Excludes Lifecycle and Simulate.
	APIOnly bool
	// ExpectedBootTime is how long a host normally takes from power on to
	// its boot agent's check-in; past it the host carries
	// BootAgentCheckedIn=False (hostlife.DefaultExpectedBoot when 0).
	ExpectedBootTime time.Duration
	// ProvisionMaxInFlight bounds the hosts provisioning at once, per
	// executor (provision.Config.MaxInFlight: 0 its default, negative no
	// limit; `kiln-controller run --provision-max-in-flight`).
	ProvisionMaxInFlight int
	// StepTimeouts bounds host lifecycle steps, replacing their defaults
	// (hostlife.DefaultTimeouts; `kiln-controller run --step-timeout
	// STEP=DURATION`); steps not named keep theirs.
	StepTimeouts map[hostlife.Step]time.Duration
	// BootURL is the boot server's public URL; the agent ISO of host H is
	// BootURL/boot/iso/H.iso (bootserver.ISOURL).
	BootURL string
	// ControllerURL is the URL installed agents report to, written into
	// each laid image, and boot agents enroll with (default
	// https://<listen address>); without a port, the API's.
	ControllerURL string
	// Simulate, when > 0, creates that many simulated hosts and drives them
	// with simulated BMCs and agents (controller/sim) instead of real ones;
	// implies Lifecycle.
	Simulate int
	// Shards, when > 0, partitions the hosts into that many shards owned
	// by the live replicas through etcd leases (controller/shard,
	// docs/scale.md "Several active controllers"): every replica that
	// runs the lifecycle runs it for the hosts of the shards it holds,
	// fenced on each shard's key; cluster-level reconcilers stay on the
	// elected leader. Every replica must use the same value. 0 (the
	// default): the leader runs the whole lifecycle.
	Shards int
	// BootListenAddr, when set, serves the boot server (controller/bootserver:
	// boot media, golden images, per-host iPXE scripts and ISOs) over plain
	// HTTP on this address (controller/bootservice). Port 0 picks a free port;
	// BootAddr reports it. BootURL defaults to http://<this address> when it
	// names a host.
	BootListenAddr string
	// BootMediaDir holds the agent boot media (kiln-imagebuilder bootmedia
	// -o DIR); required with BootListenAddr.
	BootMediaDir string
	// ImageDir holds the golden images served under /images/; "" serves none.
	ImageDir string
	// BootTokenTTL is the validity of the one-time enrollment token minted
	// for each boot request (bootservice.DefaultTokenTTL).
	BootTokenTTL time.Duration
	// BootTokenLimit is how many boot tokens one host may get per
	// BootTokenTTL (0: bootservice.DefaultTokenLimit; < 0: no limit).
	BootTokenLimit int
	// AuditReaders may read the audit log besides admins: roles
	// ("operator") or roles and certificate names ("reader:alice"); see
	// authz.Authorizer.GrantAuditRead.
	AuditReaders []string
	// AuditMaxAge is how long audit entries are kept (0:
	// audit.DefaultMaxAge; < 0: no age limit).
	AuditMaxAge time.Duration
	// AuditMaxEntries is how many audit entries are kept at most (0:
	// audit.DefaultMaxEntries; < 0: no count limit).
	AuditMaxEntries int64
	// AuditPruneInterval is how often each replica prunes the audit log
	// (audit.DefaultPruneInterval).
	AuditPruneInterval time.Duration
	// Limits are the API's per-caller rate limits and stream bounds (zero
	// fields: the limits package's defaults).
	Limits limits.GRPCConfig
	// MaxMessageBytes is the largest API request read, an apply's size
	// limit (0: limits.DefaultMaxMessageBytes).
	MaxMessageBytes int
	// BootRate is the rate of each client address on the boot server's
	// token-minting paths (zero: limits.DefaultBoot; PerSecond < 0: no
	// limit).
	BootRate limits.Rate
	// MetricsListenAddr, when set, serves Prometheus metrics over plain
	// HTTP at /metrics on this address (controller/metrics,
	// docs/observability.md); "" serves none and records none. Port 0
	// picks a free port; MetricsAddr reports it.
	MetricsListenAddr string
}

// Controller is one controller replica.
type Controller struct {
	cfg Config
	log *slog.Logger

	ready chan struct{}
	mu    sync.Mutex
	addr  string
	cas   *trust.Rotating
	store *store.Store
	// etcdTLSConfig is the external etcd's client TLS, if any.
	etcdTLSConfig *tls.Config
	elector       *election.Elector
	enroll        *enrollment.Service
	sealer        *seal.Sealer
	own           *trust.OwnCert
	// adminMu serialises writes of the admin kilnconfig.
	adminMu sync.Mutex

	bootAddr string

	// metrics is nil unless Config.MetricsListenAddr is set.
	metrics     *metrics.Metrics
	metricsAddr string
	// seen is this replica's liveness tracker, once Run has made it.
	seen *liveness.Tracker
	// caches are this replica's watch caches, once Run has made them:
	// the host lifecycle reads Machines and Images from them.
	caches *resources.Caches
	// shards is the shard manager when Config.Shards > 0, once Run has
	// made it; simFleet the process's simulated fleet in sharded
	// --simulate mode (shared by the shards and the leader).
	shards   *shard.Manager
	simFleet *shardlife.SimFleet
}

// New checks cfg and returns a controller ready to Run. It returns
// InvalidArgument for an unusable configuration and FailedPrecondition
// when the sealing key file exists but is unusable.
func New(cfg Config, log *slog.Logger) (*Controller, error) {
	if cfg.DataDir == "" {
		return nil, errdefs.InvalidArgument("controller: data directory is required")
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.ControllerURL != "" {
		if _, err := bootservice.AgentControllerAddr(cfg.ControllerURL, "127.0.0.1:7443"); err != nil {
			return nil, err
		}
	}
	if cfg.ListenAddr == "" {
		cfg.ListenAddr = DefaultListenAddr
	}
	if cfg.SecretKeyFile == "" {
		cfg.SecretKeyFile = filepath.Join(cfg.DataDir, "secret.key")
	}
	if cfg.ID == "" {
		h, _ := os.Hostname()
		cfg.ID = fmt.Sprintf("%s-%d", h, os.Getpid())
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if cfg.ElectionTTL <= 0 {
		cfg.ElectionTTL = DefaultElectionTTL
	}
	if cfg.ReconcileInterval <= 0 {
		cfg.ReconcileInterval = DefaultReconcileInterval
	}
	if cfg.HeartbeatInterval <= 0 {
		cfg.HeartbeatInterval = enrollment.DefaultHeartbeatInterval
	}
	if cfg.AgentSilence <= 0 {
		cfg.AgentSilence = 3 * cfg.HeartbeatInterval
	}
	if _, _, err := net.SplitHostPort(cfg.ListenAddr); err != nil {
		return nil, errdefs.InvalidArgument("controller: listen address %q: %v", cfg.ListenAddr, err)
	}
	if len(cfg.StepTimeouts) > 0 {
		timeouts := make(map[hostlife.Step]time.Duration, len(cfg.StepTimeouts))
		for step, d := range cfg.StepTimeouts {
			s, err := hostlife.ParseStep(string(step))
			if err != nil {
				return nil, fmt.Errorf("controller: step timeouts: %w", err)
			}
			if d <= 0 {
				return nil, errdefs.InvalidArgument("controller: step timeout of %s: %s is not positive", s, d)
			}
			timeouts[s] = d
		}
		cfg.StepTimeouts = timeouts
	}
	if cfg.BootTokenTTL <= 0 {
		cfg.BootTokenTTL = bootservice.DefaultTokenTTL
	}
	if cfg.AuditMaxAge == 0 {
		cfg.AuditMaxAge = audit.DefaultMaxAge
	}
	if cfg.AuditMaxEntries == 0 {
		cfg.AuditMaxEntries = audit.DefaultMaxEntries
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = limits.DefaultMaxMessageBytes
	}
	if cfg.BootRate == (limits.Rate{}) {
		cfg.BootRate = limits.DefaultBoot
	}
	if cfg.AuditPruneInterval <= 0 {
		cfg.AuditPruneInterval = audit.DefaultPruneInterval
	}
	if err := authz.New(nil).GrantAuditRead(cfg.AuditReaders...); err != nil {
		return nil, fmt.Errorf("controller: %w", err)
	}
	if cfg.BootTokenLimit == 0 {
		cfg.BootTokenLimit = bootservice.DefaultTokenLimit
	}
	if cfg.BootListenAddr != "" {
		if _, _, err := net.SplitHostPort(cfg.BootListenAddr); err != nil {
			return nil, errdefs.InvalidArgument("controller: boot listen address %q: %v", cfg.BootListenAddr, err)
		}
		if cfg.BootMediaDir == "" {
			return nil, errdefs.InvalidArgument("controller: the boot server needs a boot media directory (--boot-media-dir)")
		}
	}
	var met *metrics.Metrics
	if cfg.MetricsListenAddr != "" {
		if _, _, err := net.SplitHostPort(cfg.MetricsListenAddr); err != nil {
			return nil, errdefs.InvalidArgument("controller: metrics listen address %q: %v", cfg.MetricsListenAddr, err)
		}
		met = metrics.New()
	}
	if cfg.Shards < 0 {
		return nil, errdefs.InvalidArgument("controller: shards %d: want 0 (off) or more", cfg.Shards)
	}
	if cfg.APIOnly && (cfg.Lifecycle || cfg.Simulate > 0) {
		return nil, errdefs.InvalidArgument("controller: an API-only replica runs no lifecycle: drop --api-only, or --lifecycle and --simulate")
	}
	if err := cfg.dataDir().Check(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return nil, fmt.Errorf("controller: data directory: %w", err)
	}
	sealer, err := seal.LoadOrCreateKey(cfg.SecretKeyFile)
	if err != nil {
		return nil, fmt.Errorf("controller: secret key: %w", err)
	}
	return &Controller{
		cfg:     cfg,
		log:     log.With("component", "controller", "id", cfg.ID),
		ready:   make(chan struct{}),
		sealer:  sealer,
		metrics: met,
	}, nil
}

// Ready is closed once the API serves.
func (c *Controller) Ready() <-chan struct{} { return c.ready }

// Addr is the API's listen address; valid after Ready.
func (c *Controller) Addr() string { c.mu.Lock(); defer c.mu.Unlock(); return c.addr }

// BootAddr is the boot server's listen address, "" when it is off; valid
// after Ready.
func (c *Controller) BootAddr() string { c.mu.Lock(); defer c.mu.Unlock(); return c.bootAddr }

// MetricsAddr is the metrics listen address, "" when metrics are off;
// valid after Ready.
// AgentLastSeen is when this replica last received a heartbeat from the
// agent of host (heartbeats that change nothing are not stored: they
// only move this time); false before Run, or when none arrived here.
func (c *Controller) AgentLastSeen(host string) (time.Time, bool) {
	c.mu.Lock()
	seen := c.seen
	c.mu.Unlock()
	if seen == nil {
		return time.Time{}, false
	}
	return seen.LastSeen(host)
}

func (c *Controller) MetricsAddr() string { c.mu.Lock(); defer c.mu.Unlock(); return c.metricsAddr }

// CA is the controller's certificate authority, the one that signs agent
// and operator certificates now (it changes with kiln-controller
// rotate-ca); valid after Ready.
func (c *Controller) CA() *pki.CA {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cas == nil {
		return nil
	}
	return c.cas.Set().Signer
}

// TrustedCAs is the PEM of every CA the controller accepts certificates
// of: one, or during a CA rotation the old and the new one; valid after
// Ready.
func (c *Controller) TrustedCAs() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cas.CertPEM()
}

// Store is the controller's store; valid after Ready until Run returns.
func (c *Controller) Store() *store.Store { c.mu.Lock(); defer c.mu.Unlock(); return c.store }

// AdminConfigPath is the admin kilnconfig file; valid after Ready.
func (c *Controller) AdminConfigPath() string {
	return filepath.Join(c.cfg.DataDir, operatorcert.AdminConfigName)
}

// Certificate is the controller's own certificate (role controller,
// identity pki.ControllerName), issued at start and renewed when a third
// of its year is left: the API's server certificate and the client
// certificate it presents to agents (see agent/client.Dial). Call it for
// each new connection rather than keeping the result; valid after Ready.
func (c *Controller) Certificate() tls.Certificate {
	c.mu.Lock()
	own := c.own
	c.mu.Unlock()
	if own == nil {
		return tls.Certificate{}
	}
	cert, err := own.Get()
	if err != nil {
		c.log.Error("controller certificate", "err", err)
	}
	return cert
}

// collectOrphanSecrets removes the sealed BMC passwords of hosts that do
// not exist: what a crash between the two writes left behind before a
// Host and its password were written in one transaction. Once per term.
func (c *Controller) collectOrphanSecrets(ctx context.Context, st *store.Store) {
	n, err := st.CollectOrphanSecrets(ctx, "bmc/", "hosts")
	switch {
	case err != nil:
		c.log.Warn("orphaned secrets not collected", "err", err)
	case n > 0:
		c.log.Info("orphaned secrets collected", "secrets", n)
	}
}

// IsLeader reports whether this replica runs the reconcilers now.
func (c *Controller) IsLeader() bool {
	c.mu.Lock()
	e := c.elector
	c.mu.Unlock()
	return e != nil && e.IsLeader()
}

// CreateToken makes an enrollment token as the CreateToken RPC does;
// valid after Ready.
func (c *Controller) CreateToken(ctx context.Context, ttl time.Duration, host, description string) (string, time.Time, error) {
	c.mu.Lock()
	e := c.enroll
	c.mu.Unlock()
	if e == nil {
		return "", time.Time{}, errdefs.Unavailable("controller is not running")
	}
	t, exp, err := e.CreateToken(ctx, ttl, host, description)
	return t.String(), exp, err
}

// Run starts etcd (or connects to it), loads or creates the CA, writes the
// admin kilnconfig, serves the API and campaigns for leadership until ctx
// ends. It returns nil after ctx ends and a shutdown, or the error that
// stopped it. Call it once.
func (c *Controller) Run(ctx context.Context) error {
	client, closeEtcd, err := c.openEtcd(ctx)
	if err != nil {
		return err
	}
	defer closeEtcd()
	opts := []store.Option{store.WithSealer(c.sealer), store.WithLogger(c.log)}
	if len(c.cfg.EtcdEndpoints) == 0 {
		// The embedded member takes --max-txn-ops=MaxBatchOps: grouped
		// writes may fill it (an external etcd keeps etcd's default).
		opts = append(opts, store.WithGroupCommit(store.GroupCommit{MaxOps: store.MaxBatchOps}))
	}
	st := store.New(client, opts...)
	stopMetrics, err := c.serveMetrics(ctx, st)
	if err != nil {
		return err
	}
	defer stopMetrics()

	if _, err := c.waitForCA(ctx, st); err != nil {
		return fmt.Errorf("controller: %w", err)
	}
	set, err := trust.LoadSet(ctx, st)
	if err != nil {
		return fmt.Errorf("controller: %w", err)
	}
	ca := trust.NewRotating(set)
	c.log.Info("controller CA ready", "ca_hash", ca.Hash(), "rotation", set.Phase())

	lis, err := net.Listen("tcp", c.cfg.ListenAddr)
	if err != nil {
		return fmt.Errorf("controller: listen on %s: %w", c.cfg.ListenAddr, err)
	}
	defer lis.Close()
	addr := lis.Addr().String()
	serverTLS, own, err := c.serverTLS(ca, addr)
	if err != nil {
		return err
	}
	if err := c.writeAdminConfig(set, clientAddr(addr)); err != nil {
		return err
	}

	// Event logs the recorder does not hold are read with the store's
	// other Gets, grouped.
	rec := events.NewWithConfig(client, events.Config{Clock: c.cfg.Clock, Read: st.GetKey}, c.log)
	res := resources.New(st, rec, c.cfg.Clock, c.log)
	res.SetOwnNetworks(append(ownNetworks(addr, c.cfg.BootListenAddr), c.cfg.ReservedNetworks...))
	// One watch cache per kind on every replica: the API's List and Watch
	// serve from them (resources.Caches). Run below, stopped before etcd.
	caches := resources.NewCaches(st)
	res.UseCaches(caches)
	// Every replica judges the agents whose heartbeats it receives: their
	// last-seen times live in its memory, not in etcd (controller/liveness).
	seen := liveness.NewTracker()
	c.mu.Lock()
	c.seen = seen
	c.caches = caches
	c.mu.Unlock()
	enr := enrollment.New(st, ca, rec, enrollment.Config{
		HeartbeatInterval: c.cfg.HeartbeatInterval,
		Clock:             c.cfg.Clock,
		Observer:          c.enrollObserver(),
		Replica:           c.cfg.ID,
		Tracker:           seen,
	}, c.log)
	enr.UseHostCache(caches.Kind("hosts"), st) // idle heartbeats read their Host from it
	unregister, err := liveness.Register(ctx, client, c.cfg.ID, c.cfg.AgentSilence)
	if err != nil {
		return fmt.Errorf("controller: %w", err)
	}
	defer unregister()
	az := authz.New(func(cert *x509.Certificate) (string, string, error) {
		role, name, err := pki.Identity(cert)
		return string(role), name, err
	})
	if err := az.GrantAuditRead(c.cfg.AuditReaders...); err != nil {
		return fmt.Errorf("controller: %w", err)
	}
	// The auditor sits outside the authorizer so that it sees refusals.
	aud := api.NewAuditor(st, az.Identify, c.cfg.Clock, c.log)
	// The limits come first: a caller over its rate costs nothing more.
	lim := limits.NewGRPC(c.cfg.Limits, az.Identify, c.cfg.Clock)
	srv := grpc.NewServer(
		grpc.Creds(credentials.NewTLS(serverTLS)),
		grpc.ChainUnaryInterceptor(lim.Unary, aud.Unary, az.Unary),
		grpc.ChainStreamInterceptor(lim.Stream, aud.Stream, az.Stream),
		grpc.MaxRecvMsgSize(c.cfg.MaxMessageBytes),
		grpc.MaxConcurrentStreams(limits.DefaultMaxStreamsPerConnection),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}),
	)
	life, endLife := context.WithCancel(ctx)
	defer endLife()
	cachesDone := make(chan struct{})
	go func() {
		defer close(cachesDone)
		var wg sync.WaitGroup
		wg.Go(func() { enr.RunHostCache(life) })
		caches.Run(life)
		wg.Wait()
	}()
	defer func() { endLife(); <-cachesDone }() // the caches end before etcd closes
	leaderOf := election.New(client, election.DefaultPrefix, c.cfg.ID, 1, nil)
	api.Register(life, srv, res, enr, rec, st, st, func(ctx context.Context) (shard.Overview, error) {
		live, err := liveness.LiveReplicas(ctx, client)
		if err != nil {
			return shard.Overview{}, errdefs.Unavailable("%w", err)
		}
		leader, err := leaderOf.Leader(ctx)
		if err != nil && !errdefs.IsNotFound(err) {
			return shard.Overview{}, err
		}
		ov, err := shard.Observe(ctx, client, live, leader)
		if err != nil {
			return shard.Overview{}, errdefs.Unavailable("%w", err)
		}
		return ov, nil
	})
	api.RegisterMaintenance(srv, st, c.cfg.SecretKeyFile, c.cfg.Clock)
	boot, err := c.startBoot(life, st, enr, ca, addr)
	if err != nil {
		return err
	}
	defer boot.Stop()
	elector := election.New(client, election.DefaultPrefix, c.cfg.ID, int(c.cfg.ElectionTTL/time.Second), c.log)

	c.mu.Lock()
	c.addr, c.cas, c.store, c.elector, c.enroll = addr, ca, st, elector, enr
	c.own = own
	c.mu.Unlock()

	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(lis) }()
	c.log.Info("controller API serving", "addr", addr, "ca_hash", ca.Hash(), "admin_config", c.AdminConfigPath())
	close(c.ready)

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		audit.Prune(ctx, st, audit.Retention{MaxAge: c.cfg.AuditMaxAge, MaxEntries: c.cfg.AuditMaxEntries, Interval: c.cfg.AuditPruneInterval}, c.cfg.Clock, c.log)
	}()
	wg.Add(1)
	go func() {
		defer wg.Done()
		liveness.NewMonitor(st, rec, seen, liveness.MonitorConfig{
			Replica: c.cfg.ID,
			Silence: c.cfg.AgentSilence,
			Clock:   c.cfg.Clock,
			Live:    func(ctx context.Context) (map[string]bool, error) { return liveness.LiveReplicas(ctx, client) },
		}, c.log).Run(ctx)
	}()
	wg.Add(1)
	go func() {
		defer wg.Done()
		// A CA rotation run from anywhere reaches every replica: new
		// connections use the new set at once (serverTLS, the agent pool,
		// enrollment); the admin kilnconfig is renewed onto it.
		ca.Follow(ctx, st, c.log, func(set *trust.Set) {
			if err := c.writeAdminConfig(set, clientAddr(addr)); err != nil {
				c.log.Error("admin kilnconfig not renewed after a CA change", "err", err)
			}
		})
	}()
	if c.cfg.Shards > 0 && c.runsLifecycle() {
		c.startShards(ctx, &wg, client, st, rec, ca, enr, addr)
	}
	wg.Add(1)
	if c.cfg.APIOnly {
		// An API-only replica stays out of the election, so the leader is
		// always a replica that runs the lifecycle; it says so on the hosts
		// when there is none.
		c.log.Info("api-only: serving the API; no lifecycle, no reconcilers")
		go func() {
			defer wg.Done()
			c.sweeper().WatchForLeader(ctx, elector, st, rec)
		}()
	} else {
		go func() {
			defer wg.Done()
			_ = elector.Run(ctx, func(lctx context.Context, term election.Term) {
				c.log.Info("leading: reconcilers started", "term_key", term.Key, "term_rev", term.Rev)
				// Every write of the term is fenced on its election key: once
				// deposed, this replica's writes are refused and it starts no
				// step, even before its own lease deadline passes.
				fenced := st.Fenced(store.Fence{Key: term.Key, Rev: term.Rev})
				// A controller paused for a move (kilnctl move) runs no
				// reconciler until it is resumed; a pause recorded while
				// they run stops them (the store refuses their writes from
				// the pause's revision on either way).
				for lctx.Err() == nil {
					if p, err := st.Paused(lctx); err == nil && p != nil {
						c.log.Warn("paused for a move: reconcilers wait until it is resumed", "moved_to", p.MovedTo, "moved", p.Moved, "by", p.By)
					}
					if err := st.WaitResumed(lctx); err != nil {
						break
					}
					rctx, stop := st.UntilPaused(lctx)
					c.collectOrphanSecrets(rctx, fenced)
					stopLife := c.runLifecycle(rctx, fenced, rec, ca, enr, addr)
					stopGit := c.runGitSources(rctx, fenced, rec, addr)
					stopTopology := c.runTopology(rctx, fenced, rec)
					c.sweeper().Leader(rctx, fenced, rec)
					stopTopology()
					stopGit()
					stopLife()
					stop()
					c.log.Info("reconcilers stopped")
				}
			})
		}()
	}

	select {
	case <-ctx.Done():
		err = nil
	case err = <-serveErr:
		err = fmt.Errorf("controller: serve: %w", err)
	}
	cancel()
	endLife()
	wg.Wait() // resigns leadership before etcd goes away
	stopped := make(chan struct{})
	go func() { srv.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		srv.Stop()
	}
	c.log.Info("controller stopped")
	return err
}

// runsLifecycle reports whether this replica runs the host lifecycle
// when it leads.
func (c *Controller) runsLifecycle() bool { return c.cfg.Lifecycle || c.cfg.Simulate > 0 }

// sweeper runs this replica's sweeps (controller/sweep): the leader's, or
// an API-only replica's watch for a leader.
func (c *Controller) sweeper() *sweep.Sweeper {
	c.mu.Lock()
	hosts := c.caches.Kind("hosts")
	c.mu.Unlock()
	return sweep.New(sweep.Config{ID: c.cfg.ID, Interval: c.cfg.ReconcileInterval, ElectionTTL: c.cfg.ElectionTTL,
		Lifecycle: c.runsLifecycle(), Clock: c.cfg.Clock, Hosts: hosts}, c.log)
}

// startBoot serves the boot server (controller/bootservice) on
// Config.BootListenAddr when it is set (nil, nil otherwise) until the
// returned service stops; apiAddr is the API's listen address. It sets
// Config.BootURL from the listen address when that was left empty and the
// address names a host.
func (c *Controller) startBoot(ctx context.Context, st *store.Store, enr *enrollment.Service, ca *trust.Rotating, apiAddr string) (*bootservice.Service, error) {
	if c.cfg.BootListenAddr == "" {
		return nil, nil
	}
	b, err := bootservice.Start(ctx, bootservice.Config{
		ListenAddr: c.cfg.BootListenAddr, MediaDir: c.cfg.BootMediaDir, ImageDir: c.cfg.ImageDir,
		PublicURL: c.cfg.BootURL, ControllerURL: c.cfg.ControllerURL, APIAddr: clientAddr(apiAddr),
		TokenTTL: c.cfg.BootTokenTTL, TokenLimit: c.cfg.BootTokenLimit, Rate: c.cfg.BootRate, Clock: c.cfg.Clock,
	}, bootservice.Deps{Store: st, Tokens: enr, CAHash: ca.Hash, Handler: c.metrics.BootHandler, Log: c.log})
	if err != nil {
		return nil, err
	}
	c.cfg.BootURL = b.PublicURL()
	c.mu.Lock()
	c.bootAddr = b.Addr()
	c.mu.Unlock()
	return b, nil
}

// runGitSources starts the GitSource executor (controller/gitsource) and
// returns a function that waits for it to end (after lctx ends). Its
// writes go through a resources service on the term's fenced store, so a
// deposed leader applies no revision.
func (c *Controller) runGitSources(lctx context.Context, st *store.Store, rec *events.Recorder, addr string) func() {
	res := resources.New(st, rec, c.cfg.Clock, c.log)
	res.SetOwnNetworks(append(ownNetworks(addr, c.cfg.BootListenAddr), c.cfg.ReservedNetworks...))
	ex := gitsource.New(gitsource.Deps{Store: st, Resources: res, Recorder: rec}, gitsource.Config{Clock: c.cfg.Clock, FileRoots: c.cfg.GitFileRoots}, c.log)
	done := make(chan struct{})
	go func() { defer close(done); _ = ex.Run(lctx) }()
	return func() { <-done }
}

// runLifecycle starts the host lifecycle executor when configured and
// returns a function that waits for it to end (after lctx ends).
func (c *Controller) runLifecycle(lctx context.Context, st *store.Store, rec *events.Recorder, ca *trust.Rotating, enr *enrollment.Service, addr string) func() {
	if !c.runsLifecycle() {
		return func() {}
	}
	deps, cfg, closeDeps := c.hostDeps(lctx, st, rec, ca, enr, addr)
	var ex *provision.Executor
	if c.cfg.Shards == 0 {
		ex = provision.New(deps, cfg, c.log)
	}
	// The cluster executor bootstraps the Machines of each Cluster on the
	// hosts the lifecycle provisions (controller/clusterexec); sharded, it
	// stays on the leader.
	// Each cluster reconcile reads the Available Hosts from the
	// replica's Host cache (its State index), which it waits on to hold
	// the executor's own host writes (read-your-writes). It had a cache
	// of its own before: every Host held decoded twice.
	cxDeps := clusterexec.Deps{Store: st, Recorder: rec, Agents: clusterexec.AgentDialer(deps.Agents), Drain: drain.Drain, DeleteNode: drain.DeleteNode}
	c.mu.Lock()
	if h := c.caches.Kind("hosts"); h != nil {
		cxDeps.Hosts = h
	}
	c.mu.Unlock()
	if c.metrics != nil {
		cxDeps.Observer = c.metrics
	}
	cx := clusterexec.New(cxDeps,
		clusterexec.Config{Interval: c.cfg.ReconcileInterval, Clock: c.cfg.Clock,
			ClusterWorkers: c.cfg.ClusterWorkers, LongActions: c.cfg.LongActions, DrainTimeout: c.cfg.DrainTimeout}, c.log)
	done := make(chan struct{})
	// The rollout executor carries Rollouts to the clusters wave by wave
	// (controller/rolloutexec); the cluster executor then rolls them.
	rx := rolloutexec.New(rolloutexec.Deps{Store: st, Events: rec},
		rolloutexec.Config{Interval: c.cfg.ReconcileInterval, Clock: c.cfg.Clock}, c.log)
	cxDone := make(chan struct{})
	rxDone := make(chan struct{})
	go func() {
		defer close(done)
		if ex != nil {
			_ = ex.Run(lctx)
		}
	}()
	go func() { defer close(cxDone); _ = cx.Run(lctx) }()
	go func() { defer close(rxDone); _ = rx.Run(lctx) }()
	return func() {
		<-done
		<-cxDone
		<-rxDone
		closeDeps()
	}
}

// hostDeps builds the host lifecycle executor's collaborators and
// configuration on st (fenced by the caller): simulated BMCs and agents
// with --simulate, real ones otherwise. The returned function releases
// them once the executors using them ended.
func (c *Controller) hostDeps(lctx context.Context, st *store.Store, rec *events.Recorder, ca *trust.Rotating, enr *enrollment.Service, addr string) (provision.Deps, provision.Config, func()) {
	cfg := provision.Config{
		Clock:  c.cfg.Clock,
		ISOURL: func(h string) string { return bootserver.ISOURL(c.cfg.BootURL, h) },
		Plan:   hostlife.Config{ExpectedBoot: c.cfg.ExpectedBootTime, Timeouts: c.cfg.StepTimeouts},

		MaxInFlight: c.cfg.ProvisionMaxInFlight,
	}
	deps := provision.Deps{Store: st, Recorder: rec}
	if c.metrics != nil {
		deps.Observer = c.metrics
	}
	c.mu.Lock()
	caches := c.caches
	c.mu.Unlock()
	if m, i := caches.Kind("machines"), caches.Kind("images"); m != nil && i != nil {
		// What each host wants, without two etcd reads per reconcile
		// (provision.CachedDesired says why no wait is needed).
		deps.Desired = provision.CachedDesired(st, m, i)
	}
	if h := caches.Kind("hosts"); h != nil {
		// The resync reads the hosts from the cache, not from etcd
		// (provision.Deps.Hosts).
		deps.Hosts = h
	}
	var pool *provision.AgentPool
	if c.simFleet != nil {
		// Sharded: one simulated fleet for the process, made by Run.
		deps.BMCs, deps.Agents = c.simFleet.Fleet.BMCDialer(), c.simFleet.Kubeadm.AgentDialer()
	} else if c.cfg.Simulate > 0 {
		// A rack's timings scaled down 20 times, for demos.
		fleet := sim.NewFleet(lctx, sim.Config{
			BMCLatency: 25 * time.Millisecond, BootDelay: 3 * time.Second, LayDuration: 6 * time.Second,
			WipeDuration: time.Second, HeartbeatInterval: c.cfg.HeartbeatInterval, Jitter: 0.5,
		}, sim.EnrollmentCheckIn(enr))
		kubeadm := sim.NewKubeadm(fleet, 2*time.Second)
		if _, err := sim.Populate(lctx, st, c.cfg.Simulate, "sim"); err != nil {
			c.log.Error("simulation: create hosts", "err", err)
		}
		deps.BMCs, deps.Agents = fleet.BMCDialer(), kubeadm.AgentDialer()
		c.log.Info("simulating hosts", "hosts", c.cfg.Simulate)
	} else {
		pool = provision.NewAgentPool(ca.Pool, c.Certificate)
		bmcOpts := bmc.Options{Logger: c.log}
		if c.metrics != nil {
			bmcOpts.Observer = c.metrics
		}
		deps.BMCs = provision.ManagerDialer(bmc.NewManager(bmc.ManagerOptions{Defaults: bmcOpts}), st)
		deps.Agents = pool.Dial
		url, err := bootservice.InstalledControllerURL(c.cfg.ControllerURL, clientAddr(addr))
		if err != nil {
			// New refused such a URL already.
			c.log.Error("controller URL for installed agents", "error", err)
			url = c.cfg.ControllerURL
		}
		deps.Identity = provision.CAIdentity(ca, url, 30*24*time.Hour, c.cfg.Clock)
	}
	return deps, cfg, func() {
		if pool != nil {
			pool.Close()
		}
	}
}

// runTopology starts the topology executor (controller/topologyexec),
// which derives the ControlPlane, MachineDeployments and HealthChecks of
// clusters with spec.topology and records cluster class revisions; it
// needs no hosts, so it runs on every leader. It returns a function that
// waits for it to end (after lctx ends).
func (c *Controller) runTopology(lctx context.Context, st *store.Store, rec *events.Recorder) func() {
	tx := topologyexec.New(st, rec, topologyexec.Config{Interval: c.cfg.ReconcileInterval, Clock: c.cfg.Clock}, c.log)
	done := make(chan struct{})
	go func() { defer close(done); _ = tx.Run(lctx) }()
	return func() { <-done }
}

// waitForCA loads or creates the CA, waiting (with backoff) while etcd is
// unavailable, as it is when replicas start before their etcd cluster has
// a quorum.
func (c *Controller) waitForCA(ctx context.Context, st *store.Store) (*pki.CA, error) {
	retry := backoff.Policy{Base: 500 * time.Millisecond, Max: 10 * time.Second, Factor: 2, Jitter: 0.2}
	rnd := rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
	for attempt := 0; ; attempt++ {
		octx, cancel := context.WithTimeout(ctx, 5*time.Second)
		ca, err := trust.LoadOrCreate(octx, st, c.sealer, c.cfg.Clock())
		cancel()
		if err == nil || ctx.Err() != nil || !(errdefs.IsUnavailable(err) || errors.Is(err, context.DeadlineExceeded)) {
			return ca, err
		}
		if c.etcdTLSConfig != nil {
			// The etcd client reports a refused certificate as a timeout.
			if why := store.CheckTLS(ctx, c.cfg.EtcdEndpoints, c.etcdTLSConfig); why != nil {
				err = fmt.Errorf("%w; %v: check --etcd-cacert, --etcd-cert and --etcd-key", err, why)
			}
		}
		d := retry.Delay(attempt, rnd)
		c.log.Warn("etcd unavailable, retrying", "err", err, "retry_in", d)
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(d):
		}
	}
}

// openEtcd connects to the external etcd or starts the embedded one.
func (c *Controller) openEtcd(ctx context.Context) (*clientv3.Client, func(), error) {
	if len(c.cfg.EtcdEndpoints) > 0 {
		cl, tlsCfg, err := datadir.DialExternal(c.cfg.dataDir(), c.etcdDialOptions()...)
		if err != nil {
			return nil, nil, err
		}
		c.etcdTLSConfig = tlsCfg
		c.log.Info("using external etcd", "endpoints", strings.Join(c.cfg.EtcdEndpoints, ","), "tls", c.cfg.dataDir().TLS())
		return cl, func() { cl.Close() }, nil
	}
	emb, err := store.StartEmbedded(ctx, store.EmbeddedConfig{
		DataDir:    c.cfg.dataDir().EtcdDir(),
		Compaction: c.cfg.EtcdCompaction,
		QuotaBytes: c.cfg.EtcdQuotaBytes,
		Logger:     c.log,
	})
	if err != nil {
		return nil, nil, fmt.Errorf("controller: %w", err)
	}
	urlFile := filepath.Join(c.cfg.DataDir, datadir.URLFile)
	if err := os.WriteFile(urlFile, []byte(strings.Join(emb.Endpoints(), ",")), 0o600); err != nil {
		emb.Close()
		return nil, nil, fmt.Errorf("controller: %w", err)
	}
	cl, err := datadir.Dial(emb.Endpoints(), nil, c.etcdDialOptions()...)
	if err != nil {
		emb.Close()
		return nil, nil, err
	}
	return cl, func() {
		cl.Close()
		os.Remove(urlFile)
		emb.Close()
	}, nil
}

// dataDir names this controller's state for controller/datadir.
func (cfg Config) dataDir() datadir.Config {
	return datadir.Config{DataDir: cfg.DataDir, SecretKeyFile: cfg.SecretKeyFile, EtcdEndpoints: cfg.EtcdEndpoints,
		EtcdCAFile: cfg.EtcdCAFile, EtcdCertFile: cfg.EtcdCertFile, EtcdKeyFile: cfg.EtcdKeyFile}
}

// serverTLS issues the controller's certificate for this start
// (trust.OwnCert, for the names this replica is reached by) and returns
// the server TLS configuration.
func (c *Controller) serverTLS(ca *trust.Rotating, addr string) (*tls.Config, *trust.OwnCert, error) {
	names := []string{"localhost", "127.0.0.1", "::1"}
	if h, err := os.Hostname(); err == nil && h != "" {
		names = append(names, h)
	}
	if host, _, err := net.SplitHostPort(addr); err == nil {
		if ip := net.ParseIP(host); ip == nil || !ip.IsUnspecified() {
			names = append(names, host)
		}
	}
	names = append(names, c.cfg.ServerNames...)
	own := trust.NewOwnCert(ca, dedupe(names), c.cfg.Clock, c.log)
	if _, err := own.Get(); err != nil {
		return nil, nil, err
	}
	return own.ServerTLS(), own, nil
}

// clientAddr turns a listen address into one a local client can dial.
func clientAddr(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, port)
}

// writeAdminConfig writes the admin kilnconfig and bundle into DataDir
// (operatorcert.WriteAdmin), one start or CA change at a time.
func (c *Controller) writeAdminConfig(set *trust.Set, server string) error {
	c.adminMu.Lock()
	defer c.adminMu.Unlock()
	return operatorcert.WriteAdmin(c.cfg.DataDir, set, server, c.cfg.Clock(), c.log)
}

// WriteClientConfig issues a certificate with role (reader, operator or
// admin) for name and writes a kilnconfig for it to path; valid after
// Ready.
func (c *Controller) WriteClientConfig(role, name, path string) error {
	r, err := pki.ParseRole(role)
	if err != nil {
		return err
	}
	c.mu.Lock()
	set := c.cas.Set()
	c.mu.Unlock()
	cfg, err := operatorcert.Issue(set, r, name, clientAddr(c.Addr()), c.cfg.Clock())
	if err != nil {
		return err
	}
	return kilnconfig.Write(path, cfg)
}

func dedupe(in []string) []string {
	seen := map[string]bool{}
	var out []string
	for _, s := range in {
		if s != "" && !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	return out
}
