// Package bootservice runs a controller replica's boot server
// (controller/bootserver: boot media, golden images, per-host iPXE scripts
// and ISOs) over plain HTTP: it mints the one-time, host-bound enrollment
// token of each boot request (rate limited per host and per client
// address), and drops a host's cached ISO once a token of it is used.
// See docs/controller.md and docs/bootmedia.md.
package bootservice

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/bootserver"
	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/limits"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// DefaultTokenTTL is the lifetime of the enrollment token minted for
// each boot of a host's agent media (Config.TokenTTL).
const DefaultTokenTTL = 30 * time.Minute

// DefaultTokenLimit is how many boot tokens one host may be given per
// token lifetime (Config.TokenLimit).
const DefaultTokenLimit = 20

// bootTokenDescription marks the enrollment tokens minted by the boot
// server, so that their use can be told from an operator's token.
const bootTokenDescription = "kiln boot media"

// hostReader reads Hosts from the store.
type hostReader interface {
	Get(ctx context.Context, kind, name string, into proto.Message) (int64, error)
}

// tokenMinter creates enrollment tokens (*enrollment.Service).
type tokenMinter interface {
	CreateToken(ctx context.Context, ttl time.Duration, host, description string) (enrollment.Token, time.Time, error)
}

var _ tokenMinter = (*enrollment.Service)(nil)

// bootTokens implements bootserver.TokenIssuer with enrollment tokens: one
// new token per boot request, bound to the host, valid for ttl, used once.
// It refuses hosts that are not in the inventory (NotFound) and hosts at
// rest, Available or Provisioned (FailedPrecondition): their agent
// identity must not be handed to whoever asks the boot server for it.
//
// Every token is an etcd record until a day after it expires, and the boot
// server answers without authentication, so a host gets at most limit
// tokens per ttl (a bucket of limit, refilled at limit per ttl); beyond
// that it is refused with Unavailable (503) until the bucket refills.
type bootTokens struct {
	hosts   hostReader
	tokens  tokenMinter
	ttl     time.Duration
	limit   int // <= 0: no limit
	perHost *limits.Limiter
}

// newBootTokens returns bootTokens whose per-host buckets (golang.org/x/time/rate
// through limits.Limiter) hold limit tokens and refill at limit per ttl,
// on the clock now.
func newBootTokens(hosts hostReader, tokens tokenMinter, ttl time.Duration, limit int, now func() time.Time) *bootTokens {
	r := limits.Rate{PerSecond: -1}
	if limit > 0 {
		r = limits.Rate{PerSecond: float64(limit) / ttl.Seconds(), Burst: limit}
	}
	return &bootTokens{hosts: hosts, tokens: tokens, ttl: ttl, limit: limit, perHost: limits.NewLimiter(r, now)}
}

// take spends one of host's tokens, or says how long until one is back
// (rounded up to a whole second).
func (b *bootTokens) take(host string) (bool, time.Duration) {
	return b.perHost.Allow(host)
}

var _ bootserver.TokenIssuer = (*bootTokens)(nil)

// BootToken implements bootserver.TokenIssuer. The token is returned,
// never logged.
func (b *bootTokens) BootToken(ctx context.Context, host string) (string, error) {
	h := &typesv1.Host{}
	if _, err := b.hosts.Get(ctx, enrollment.HostsKind, host, h); err != nil {
		if errdefs.IsNotFound(err) {
			return "", errdefs.NotFound("host %q is not in the inventory: apply a Host named %q first", host, host)
		}
		return "", fmt.Errorf("boot token for host %q: %w", host, err)
	}
	switch st := h.GetStatus().GetState(); st {
	case typesv1.HostState_HOST_STATE_AVAILABLE, typesv1.HostState_HOST_STATE_PROVISIONED:
		return "", errdefs.FailedPrecondition("host %q is %s: agent boot media are served only while a host registers, is provisioned, deprovisioned or wiped", host, hostlife.StateName(st))
	}
	// A token for a host whose enrolled agent is alive would let whoever
	// asks replace that agent's identity (issue 12): only while the
	// controller itself boots the host into the agent.
	if conditions.IsTrue(h.GetStatus().GetConditions(), enrollment.ConditionAgentReachable) && !bootingAgent(h) {
		return "", errdefs.FailedPrecondition("host %q has a live agent (AgentReachable): agent boot media are served for it only while the controller boots it into the agent (provisioning or deprovisioning)", host)
	}
	if ok, wait := b.take(host); !ok {
		return "", errdefs.Unavailable("host %q asked for more than %d boot tokens in %v: retry in %v", host, b.limit, b.ttl, wait)
	}
	tok, _, err := b.tokens.CreateToken(ctx, b.ttl, host, bootTokenDescription)
	if err != nil {
		return "", fmt.Errorf("boot token for host %q: %w", host, err)
	}
	return tok.String(), nil
}

// bootingAgent reports whether the controller is booting h into the
// agent: provisioning or deprovisioning, at the steps from inserting the
// boot media to the boot agent's check-in.
func bootingAgent(h *typesv1.Host) bool {
	switch h.GetStatus().GetState() {
	case typesv1.HostState_HOST_STATE_PROVISIONING, typesv1.HostState_HOST_STATE_DEPROVISIONING:
	default:
		return false
	}
	switch hostlife.Step(h.GetStatus().GetProvisioningStep()) {
	case hostlife.StepBootAgentMedia, hostlife.StepPowerOn, hostlife.StepWaitBootAgent:
		return true
	}
	return false
}

// tokenWatcher is what forgetSpentISOs needs of the store.
type tokenWatcher interface {
	Watch(ctx context.Context, kind string, fromRev int64) <-chan store.WatchEvent
}

// isoForgetter drops a host's cached ISO (*bootserver.Server).
type isoForgetter interface {
	Forget(host string)
}

// forgetSpentISOs drops a host's cached ISO as soon as one of its boot
// tokens is used: the agent enrolled, so the token baked into the ISO may
// be spent, and the next boot from virtual media needs an ISO with a fresh
// one. It runs until ctx ends.
func forgetSpentISOs(ctx context.Context, st tokenWatcher, isos isoForgetter, log *slog.Logger) {
	for ctx.Err() == nil {
		for ev := range st.Watch(ctx, enrollment.TokensKind, 0) {
			if ev.Err != nil {
				if ctx.Err() == nil {
					log.Warn("boot server: token watch ended, restarting", "err", ev.Err)
				}
				break
			}
			if ev.Type != store.EventPut {
				continue
			}
			tok := &typesv1.EnrollmentToken{}
			if err := proto.Unmarshal(ev.Value, tok); err != nil {
				log.Warn("boot server: undecodable token record", "token_id", ev.Name, "err", err)
				continue
			}
			if tok.GetUsed() && tok.GetDescription() == bootTokenDescription && tok.GetHost() != "" {
				isos.Forget(tok.GetHost())
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

// Config configures the boot server of a replica.
type Config struct {
	// ListenAddr is the plain HTTP address to serve on; port 0 picks a
	// free port (Service.Addr reports it).
	ListenAddr string
	// MediaDir holds the agent boot media; ImageDir the golden images
	// served under /images/ ("" serves none).
	MediaDir, ImageDir string
	// PublicURL is the boot server's URL as BMCs and hosts reach it; ""
	// takes http://<listen address> when that names a host.
	PublicURL string
	// ControllerURL is the URL installed agents report to; "" has boot
	// agents enroll with APIAddr, the address a local client dials the
	// API on (host:port, loopback when the API listens on all addresses).
	ControllerURL, APIAddr string
	// TokenTTL is the validity of each boot token (DefaultTokenTTL when
	// 0); TokenLimit how many one host may get per TokenTTL (0:
	// DefaultTokenLimit; < 0: no limit).
	TokenTTL   time.Duration
	TokenLimit int
	// Rate is the rate of each client address on the token-minting paths.
	Rate limits.Rate
	// Clock is the time source (time.Now).
	Clock func() time.Time
}

// Store is what the boot server needs of the controller's store: Hosts
// to check a boot request against, and the token watch.
type Store interface {
	hostReader
	tokenWatcher
}

// Deps are the boot server's collaborators.
type Deps struct {
	Store Store
	// Tokens mints enrollment tokens (*enrollment.Service).
	Tokens tokenMinter
	// CAHash is the pin of the CA serving the API now; it changes with a
	// CA rotation.
	CAHash func() string
	// Handler, when not nil, wraps the server's handler (metrics).
	Handler func(http.Handler) http.Handler
	Log     *slog.Logger
}

// Service is the running boot HTTP server of a replica.
type Service struct {
	srv       *http.Server
	bs        *bootserver.Server
	log       *slog.Logger
	addr      string
	publicURL string
	served    chan error
	cancel    context.CancelFunc
	wg        sync.WaitGroup
}

// Start serves the boot server on cfg.ListenAddr until Stop; the token
// watch runs until ctx ends or Stop. It returns InvalidArgument for a
// controller URL without a host, and the errors of listening and of
// bootserver.New. It does not block.
func Start(ctx context.Context, cfg Config, deps Deps) (*Service, error) {
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if cfg.TokenTTL <= 0 {
		cfg.TokenTTL = DefaultTokenTTL
	}
	if cfg.TokenLimit == 0 {
		cfg.TokenLimit = DefaultTokenLimit
	}
	log := deps.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	wrap := deps.Handler
	if wrap == nil {
		wrap = func(h http.Handler) http.Handler { return h }
	}
	ctlAddr, err := AgentControllerAddr(cfg.ControllerURL, cfg.APIAddr)
	if err != nil {
		return nil, err
	}
	lis, err := net.Listen("tcp", cfg.ListenAddr)
	if err != nil {
		return nil, fmt.Errorf("controller: boot server: listen on %s: %w", cfg.ListenAddr, err)
	}
	addr := lis.Addr().String()
	if cfg.PublicURL == "" {
		if host, _, _ := net.SplitHostPort(addr); net.ParseIP(host) != nil && !net.ParseIP(host).IsUnspecified() {
			cfg.PublicURL = "http://" + addr
		} else {
			log.Warn("boot server listens on all addresses: set --boot-url so BMCs get a reachable ISO URL", "addr", addr)
		}
	}
	bs, err := bootserver.New(bootserver.Options{
		MediaDir:       cfg.MediaDir,
		ImagesDir:      cfg.ImageDir,
		ControllerAddr: ctlAddr,
		CAHash:         deps.CAHash(),
		CurrentCAHash:  deps.CAHash,
		PublicURL:      cfg.PublicURL,
		Tokens:         newBootTokens(deps.Store, deps.Tokens, cfg.TokenTTL, cfg.TokenLimit, cfg.Clock),
		// An ISO never outlives half its token's validity, so a BMC that
		// reads a cached ISO still has time to boot it.
		ISOMaxAge: cfg.TokenTTL / 2,
		Log:       log,
	})
	if err != nil {
		lis.Close()
		return nil, fmt.Errorf("controller: %w", err)
	}
	b := &Service{
		srv: &http.Server{
			// Every GET of an iPXE script or ISO mints a token: those
			// paths are rate limited per client address.
			// Metrics (when on) count the bytes of every response, refusals
			// included.
			Handler:           wrap(limits.HTTP(limits.NewLimiter(cfg.Rate, cfg.Clock), mintsToken, bs)),
			ReadHeaderTimeout: 30 * time.Second,
			IdleTimeout:       2 * time.Minute,
			ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		},
		bs:        bs,
		log:       log,
		addr:      addr,
		publicURL: cfg.PublicURL,
		served:    make(chan error, 1),
	}
	wctx, cancel := context.WithCancel(ctx)
	b.cancel = cancel
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		forgetSpentISOs(wctx, deps.Store, bs, log)
	}()
	go func() { b.served <- b.srv.Serve(lis) }()
	log.Info("boot server serving", "addr", addr, "public_url", cfg.PublicURL, "controller_addr", ctlAddr,
		"media_dir", cfg.MediaDir, "image_dir", cfg.ImageDir, "token_ttl", cfg.TokenTTL)
	return b, nil
}

// Addr is the address the boot server listens on.
func (b *Service) Addr() string { return b.addr }

// PublicURL is the boot server's public URL: Config.PublicURL, or the one
// derived from the listen address ("" when it could not be).
func (b *Service) PublicURL() string { return b.publicURL }

// Stop shuts the boot server down (in-flight downloads get 5 s), ends its
// token watch and removes its ISO cache. A nil Service is a no-op.
func (b *Service) Stop() {
	if b == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := b.srv.Shutdown(ctx); err != nil {
		_ = b.srv.Close()
	}
	if err := <-b.served; err != nil && !errors.Is(err, http.ErrServerClosed) {
		b.log.Warn("boot server", "err", err)
	}
	b.cancel()
	b.wg.Wait()
	if err := b.bs.Close(); err != nil {
		b.log.Warn("boot server: remove ISO cache", "err", err)
	}
}

// mintsToken reports whether a boot server request mints an enrollment
// token (an iPXE script or an ISO).
func mintsToken(r *http.Request) bool {
	return strings.HasPrefix(r.URL.Path, "/boot/ipxe/") || strings.HasPrefix(r.URL.Path, "/boot/iso/")
}

// InstalledControllerURL is the controller URL written into each laid
// image's identity (WriteIdentity): the same address boot agents get,
// as https://HOST:PORT. A --controller-url without a port names the
// API's port here too: the installed agent dialled HOST alone, which
// gRPC takes as port 443, and never checked in (found by TestVMEndToEnd,
// whose controller listens on a free port).
func InstalledControllerURL(controllerURL, apiAddr string) (string, error) {
	a, err := AgentControllerAddr(controllerURL, apiAddr)
	if err != nil {
		return "", err
	}
	return "https://" + a, nil
}

// AgentControllerAddr is the API address boot agents enroll with,
// host:port: the host of controllerURL when set (the port of apiAddr when
// it names none), else apiAddr, the API's address for a local client.
func AgentControllerAddr(controllerURL, apiAddr string) (string, error) {
	if controllerURL == "" {
		return apiAddr, nil
	}
	u, err := url.Parse(controllerURL)
	if err != nil || u.Host == "" {
		return "", errdefs.InvalidArgument("controller URL %q: want https://HOST:PORT", controllerURL)
	}
	if u.Port() == "" {
		_, port, err := net.SplitHostPort(apiAddr)
		if err != nil {
			return "", errdefs.InvalidArgument("controller URL %q has no port", controllerURL)
		}
		return net.JoinHostPort(u.Hostname(), port), nil
	}
	return u.Host, nil
}
