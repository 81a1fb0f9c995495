package store

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// EmbeddedConfig configures an etcd member run inside the controller.
type EmbeddedConfig struct {
	// DataDir holds the member's WAL and database. Required.
	DataDir string
	// ClientURL is where clients connect, e.g. "http://127.0.0.1:2379".
	// Empty (the controller's default) serves clients only on a unix
	// socket inside DataDir, which is 0700: only the user running the
	// controller (and root) can connect. A TCP URL has no authentication
	// unless TLS is set: any local user can then read and write every key.
	ClientURL string
	// PeerURL is where other members connect. Empty with an empty
	// InitialCluster (a member alone) opens no peer listener at all; empty
	// in a new multi-member cluster picks a free loopback port.
	PeerURL string
	// Name names the member; default "kiln".
	Name string
	// InitialCluster lists the members of a new cluster as
	// "name=peerURL,name=peerURL"; empty means a cluster of this member
	// alone. Ignored when DataDir already holds a member.
	InitialCluster string
	// ClusterToken keeps separate clusters started from the same
	// InitialCluster apart; default "kiln".
	ClusterToken string
	// HeartbeatInterval and ElectionTimeout tune raft; defaults 100ms and
	// 1s (etcd's). Raise both on slow or shared machines.
	HeartbeatInterval time.Duration
	ElectionTimeout   time.Duration
	// TLS, when set, makes the member serve clients over TLS (ClientURL
	// must then be https://) and require client certificates signed by
	// TLS.TrustedCAFile.
	TLS *EmbeddedTLS
	// ReadyTimeout bounds the wait for the member to join a cluster with a
	// leader; default 60s.
	ReadyTimeout time.Duration
	// MaxTxnOps is the member's --max-txn-ops; 0 means MaxBatchOps. Tests
	// set etcd's default, 128, to stand for an external etcd.
	MaxTxnOps int
	// Compaction bounds the history the member keeps (zero: the
	// defaults, 5 minutes and at most 500,000 revisions).
	Compaction Compaction
	// QuotaBytes is the most the database file may grow to; past it etcd
	// refuses every write (alarm NOSPACE). 0 means DefaultQuotaBytes
	// (etcd's 2 GiB); etcd warns above 8 GiB. The member logs a warning
	// once the file reaches 80 % of it.
	QuotaBytes int64
	// DefragInterval is the least time between two defragmentations of
	// the running member (each blocks it; see maintain.go); 0 means
	// DefaultDefragInterval, < 0 only at start.
	DefragInterval time.Duration
	// maintainEvery is how often the member looks at its size (quota
	// warning, defragmentation); 0 means a minute. Tests shorten it.
	maintainEvery time.Duration
	// Logger receives Kiln's own messages about the member. etcd's own
	// logging goes to stderr at level error, or info when Logger is
	// enabled for debug.
	Logger *slog.Logger
}

// EmbeddedTLS names the PEM files an embedded member serves clients with.
type EmbeddedTLS struct {
	CertFile      string
	KeyFile       string
	TrustedCAFile string
}

// Embedded is an etcd member running in this process.
type Embedded struct {
	etcd      *embed.Etcd
	clientURL string
	log       *slog.Logger
	closing   *atomic.Bool
	// stop ends the maintenance loop; done is closed when it has.
	stop func()
	done chan struct{}
	// sockDir is a private directory made for the client socket when
	// DataDir's path is too long for one; removed at Close.
	sockDir string
}

// clientSocket is the name of the embedded member's client socket in its
// data directory.
const clientSocket = "kiln-client.sock"

// maxSocketPath is the longest unix socket path Linux accepts (sun_path
// holds 108 bytes with the terminating NUL).
const maxSocketPath = 107

// privateSocketURL returns "unix://<dataDir>/kiln-client.sock", or, when
// that path is too long for a socket, a socket in a new 0700 directory
// (returned, for removal) under the system's temporary directory.
func privateSocketURL(dataDir string) (string, string, error) {
	abs, err := filepath.Abs(dataDir)
	if err != nil {
		return "", "", fmt.Errorf("embedded etcd: %w", err)
	}
	if p := filepath.Join(abs, clientSocket); len(p) <= maxSocketPath {
		return "unix://" + p, "", nil
	}
	dir, err := os.MkdirTemp("", "kiln-etcd-")
	if err != nil {
		return "", "", fmt.Errorf("embedded etcd: client socket directory: %w", err)
	}
	return "unix://" + filepath.Join(dir, clientSocket), dir, nil
}

// StartEmbedded starts an etcd member and blocks until it serves clients
// (its cluster has a leader) or cfg.ReadyTimeout or ctx ends.
//
// Members of a new multi-member cluster must be started concurrently: none
// becomes ready before a quorum of them runs. It returns an Unavailable
// error on timeout and wraps etcd's own error when the member cannot start
// (for example a port in use or a data directory of another cluster).
func StartEmbedded(ctx context.Context, cfg EmbeddedConfig) (*Embedded, error) {
	if cfg.DataDir == "" {
		return nil, errdefs.InvalidArgument("embedded etcd: empty data directory")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("component", "etcd")
	if cfg.Name == "" {
		cfg.Name = "kiln"
	}
	if cfg.ClusterToken == "" {
		cfg.ClusterToken = "kiln"
	}
	if cfg.ReadyTimeout <= 0 {
		cfg.ReadyTimeout = 60 * time.Second
	}
	// A member alone serves clients on a unix socket in its data
	// directory and listens for no peers: nothing on the network can reach
	// it (issue 12: a local user read and wrote every key over loopback).
	alone := cfg.InitialCluster == ""
	sockDir := ""
	if cfg.ClientURL == "" {
		if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
			return nil, fmt.Errorf("embedded etcd: %w", err)
		}
		u, dir, err := privateSocketURL(cfg.DataDir)
		if err != nil {
			return nil, err
		}
		cfg.ClientURL, sockDir = u, dir
	}
	// Ports this function picks may be taken by another process between
	// the pick and etcd's bind: pick again a few times.
	pickPeer, pickCluster := cfg.PeerURL == "" && !alone, alone
	for attempt := 0; ; attempt++ {
		c := cfg
		var err error
		if pickPeer {
			if c.PeerURL, err = FreeLoopbackURL(); err != nil {
				return nil, err
			}
		}
		if pickCluster {
			c.InitialCluster = ""
		}
		e, err := startEmbedded(ctx, c, log)
		if err != nil && pickPeer && attempt < 4 && strings.Contains(err.Error(), "address already in use") {
			log.Info("embedded etcd: a picked port was taken meanwhile, picking again", "error", err)
			continue
		}
		if err != nil {
			if sockDir != "" {
				os.RemoveAll(sockDir)
			}
			return nil, err
		}
		e.sockDir = sockDir
		return e, nil
	}
}

func startEmbedded(ctx context.Context, cfg EmbeddedConfig, log *slog.Logger) (*Embedded, error) {
	var err error
	curl, err := url.Parse(cfg.ClientURL)
	if err != nil {
		return nil, errdefs.InvalidArgument("embedded etcd: client URL %q: %w", cfg.ClientURL, err)
	}
	// A member alone with no peer URL listens for no peers; it still
	// needs a peer URL to name itself in its cluster: one that nothing
	// listens on.
	listenPeer := true
	if cfg.PeerURL == "" {
		cfg.PeerURL, listenPeer = "unix://"+filepath.Join(cfg.DataDir, "no-peers.sock"), false
	}
	purl, err := url.Parse(cfg.PeerURL)
	if err != nil {
		return nil, errdefs.InvalidArgument("embedded etcd: peer URL %q: %w", cfg.PeerURL, err)
	}
	alone := cfg.InitialCluster == ""
	if alone {
		cfg.InitialCluster = cfg.Name + "=" + cfg.PeerURL
	}
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return nil, fmt.Errorf("embedded etcd: %w", err)
	}

	ec := embed.NewConfig()
	ec.Name = cfg.Name
	ec.Dir = cfg.DataDir
	ec.ListenClientUrls = []url.URL{*curl}
	ec.AdvertiseClientUrls = []url.URL{*curl}
	ec.ListenPeerUrls = nil
	if listenPeer {
		ec.ListenPeerUrls = []url.URL{*purl}
	}
	ec.AdvertisePeerUrls = []url.URL{*purl}
	// etcd treats an empty CORS list as "allow every origin"; allow one
	// that no browser sends instead, so no web page can script the
	// member even where a browser can reach it.
	ec.CORS = map[string]struct{}{"kiln.invalid": {}}
	ec.InitialCluster = cfg.InitialCluster
	ec.InitialClusterToken = cfg.ClusterToken
	ec.ClusterState = embed.ClusterStateFlagNew
	// A GitSource revision or an apply --prune is one transaction
	// (Store.Batch): allow as many operations as a batch may hold.
	ec.MaxTxnOps = MaxBatchOps
	if cfg.MaxTxnOps > 0 {
		ec.MaxTxnOps = uint(cfg.MaxTxnOps)
	}
	if cfg.HeartbeatInterval > 0 {
		ec.TickMs = uint(cfg.HeartbeatInterval.Milliseconds())
	}
	if cfg.ElectionTimeout > 0 {
		ec.ElectionMs = uint(cfg.ElectionTimeout.Milliseconds())
	}
	if cfg.TLS != nil {
		if curl.Scheme != "https" && curl.Scheme != "unixs" {
			return nil, errdefs.InvalidArgument("embedded etcd: TLS set but client URL %q is not https", cfg.ClientURL)
		}
		ec.ClientTLSInfo = transport.TLSInfo{
			CertFile:       cfg.TLS.CertFile,
			KeyFile:        cfg.TLS.KeyFile,
			TrustedCAFile:  cfg.TLS.TrustedCAFile,
			ClientCertAuth: cfg.TLS.TrustedCAFile != "",
		}
	}
	// The member's own loop compacts (maintain.go); etcd's compactor
	// knows one bound only.
	if cfg.QuotaBytes <= 0 {
		cfg.QuotaBytes = DefaultQuotaBytes
	}
	if cfg.DefragInterval == 0 {
		cfg.DefragInterval = DefaultDefragInterval
	}
	configureMaintenance(ec, cfg.QuotaBytes)
	if alone {
		configureRaftLogAlone(ec)
	}
	// etcd logs through zap; send its errors (everything from info up
	// when the logger is at debug) to our slog logger instead of stderr.
	closing := new(atomic.Bool)
	minLevel := zapcore.ErrorLevel
	if log.Enabled(ctx, slog.LevelDebug) {
		minLevel = zapcore.InfoLevel
	}
	ec.Logger = "zap"
	ec.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.New(&slogCore{log: log, min: minLevel, closing: closing}))

	e, err := embed.StartEtcd(ec)
	if err != nil {
		closing.Store(true)
		return nil, fmt.Errorf("embedded etcd %q in %s: %w", cfg.Name, cfg.DataDir, err)
	}
	timer := time.NewTimer(cfg.ReadyTimeout)
	defer timer.Stop()
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		closing.Store(true)
		e.Close()
		return nil, fmt.Errorf("embedded etcd %q: %w", cfg.Name, err)
	case <-timer.C:
		closing.Store(true)
		e.Close()
		return nil, errdefs.Unavailable("embedded etcd %q: not ready after %v (cluster %s has no quorum?)", cfg.Name, cfg.ReadyTimeout, cfg.InitialCluster)
	case <-ctx.Done():
		closing.Store(true)
		e.Close()
		return nil, fmt.Errorf("embedded etcd %q: %w", cfg.Name, ctx.Err())
	}
	comp := cfg.Compaction.withDefaults()
	log.Info("etcd member ready", "name", cfg.Name, "client_url", cfg.ClientURL, "peer_url", cfg.PeerURL, "data_dir", cfg.DataDir,
		"compaction_retention", comp.Retention, "compaction_max_revisions", comp.MaxRevisions, "compaction_max_history_bytes", comp.MaxHistoryBytes, "quota_bytes", cfg.QuotaBytes)
	mctx, stop := context.WithCancel(context.Background())
	emb := &Embedded{etcd: e, clientURL: cfg.ClientURL, log: log, closing: closing, stop: stop, done: make(chan struct{})}
	go func() {
		defer close(emb.done)
		emb.maintain(mctx, comp, cfg.QuotaBytes, cfg.DefragInterval, cmp.Or(cfg.maintainEvery, maintainEvery))
	}()
	return emb, nil
}

// Endpoints returns the client URLs to pass to clientv3.
func (e *Embedded) Endpoints() []string { return []string{e.clientURL} }

// Close stops the member and waits for it to release its ports and data
// directory.
func (e *Embedded) Close() {
	e.stop()
	<-e.done
	e.closing.Store(true)
	e.etcd.Close()
	<-e.etcd.Server.StopNotify()
	if e.sockDir != "" {
		os.RemoveAll(e.sockDir)
	}
	e.log.Info("etcd member stopped")
}

// FreeLoopbackURL returns "http://127.0.0.1:<port>" for a port that was free
// a moment ago. Another process may take it before it is used; that shows
// as an address-in-use error at start.
func FreeLoopbackURL() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("pick a free loopback port: %w", err)
	}
	defer l.Close()
	return "http://" + l.Addr().String(), nil
}

// InitialCluster formats members (name → peer URL, in order) as etcd's
// --initial-cluster value.
func InitialCluster(names, peerURLs []string) string {
	var b strings.Builder
	for i := range names {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(names[i] + "=" + peerURLs[i])
	}
	return b.String()
}
