// Package dashboard is `kilnctl dashboard`: a read-only web view of a
// Kiln fleet that kilnctl serves on a loopback port. kilnctl holds the
// operator's kilnconfig credentials and reads the controller's gRPC API
// with them (List and Watch of every kind, ListEvents), so the
// controller's roles apply as they do to `kilnctl get`: a reader's
// dashboard sees what the reader may see, and the dashboard calls nothing
// but the four methods a reader may call (API).
//
// Pages are rendered here with html/template from an in-memory copy of
// the fleet that one Watch per kind keeps current; htmx and its SSE
// extension (vendored from the npm registry, static/vendor) swap in the
// fragments the server pushes when the fleet changes, with no reload.
//
// Any local user can connect to a loopback port, so every request must
// carry a per-start secret: the printed URL holds a one-time token that
// the first request exchanges for an HttpOnly, SameSite=Strict session
// cookie. Requests without it get 401 and an empty body; requests whose
// Host or Origin is not this loopback address (DNS rebinding) get 403;
// every method but GET gets 405. docs/dashboard.md is the user's guide.
package dashboard

import (
	"context"
	"errors"
	"html/template"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"time"

	"google.golang.org/grpc"

	"github.com/kilnhq/kiln/internal/errdefs"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// API is what the dashboard calls on the controller: the Resources
// methods a reader certificate may call, and no other. A
// controllerv1.ResourcesClient is one.
type API interface {
	Get(ctx context.Context, in *controllerv1.GetRequest, opts ...grpc.CallOption) (*controllerv1.Resource, error)
	List(ctx context.Context, in *controllerv1.ListRequest, opts ...grpc.CallOption) (*controllerv1.ListResponse, error)
	Watch(ctx context.Context, in *controllerv1.WatchRequest, opts ...grpc.CallOption) (grpc.ServerStreamingClient[controllerv1.WatchEvent], error)
	ListEvents(ctx context.Context, in *controllerv1.ListEventsRequest, opts ...grpc.CallOption) (*controllerv1.ListEventsResponse, error)
}

var _ API = controllerv1.ResourcesClient(nil)

// Config configures a Server.
type Config struct {
	// API is the controller's API, dialled with the operator's kilnconfig.
	API API
	// Controller is the controller's address, shown on every page.
	Controller string
	// Identity is who the dashboard reads as ("reader alice"), shown on
	// every page; may be "".
	Identity string
	// Log receives the dashboard's logs; never the token or the cookie.
	Log *slog.Logger
	// Now is the clock for ages and ETAs (default time.Now).
	Now func() time.Time
	// CallTimeout bounds each unary call to the controller (default 30s).
	CallTimeout time.Duration
	// Resync is how often every kind is listed again, to correct what a
	// watch may have missed (default 1m).
	Resync time.Duration
	// PushInterval is the shortest time between two updates pushed to
	// one page (default 500ms); pages are also re-pushed every
	// RefreshInterval (default 10s) so that ages move.
	PushInterval, RefreshInterval time.Duration
	// Events is how many recent events the cluster and host pages show
	// (default 20).
	Events int64
	// Token, when not "", is the one-time login token instead of a random
	// one (tests).
	Token string
}

func (c *Config) defaults() {
	if c.Log == nil {
		c.Log = slog.New(slog.DiscardHandler)
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.CallTimeout <= 0 {
		c.CallTimeout = 30 * time.Second
	}
	if c.Resync <= 0 {
		c.Resync = time.Minute
	}
	if c.PushInterval <= 0 {
		c.PushInterval = 500 * time.Millisecond
	}
	if c.RefreshInterval <= 0 {
		c.RefreshInterval = 10 * time.Second
	}
	if c.Events <= 0 {
		c.Events = 20
	}
}

// Server is the dashboard: the fleet cache and the HTTP handler.
type Server struct {
	cfg    Config
	log    *slog.Logger
	cache  *cache
	auth   *auth
	pages  *template.Template
	static fs.FS
	events *eventCache
}

// New returns a dashboard reading cfg.API. It starts nothing: Run keeps
// the cache current and Serve answers browsers.
func New(cfg Config) (*Server, error) {
	cfg.defaults()
	if cfg.API == nil {
		return nil, errors.New("dashboard: no API")
	}
	a, err := newAuth(cfg.Token)
	if err != nil {
		return nil, err
	}
	t, err := parseTemplates()
	if err != nil {
		return nil, err
	}
	static, err := fs.Sub(assets, "static")
	if err != nil {
		return nil, err
	}
	log := cfg.Log.With("component", "dashboard")
	return &Server{
		cfg:    cfg,
		log:    log,
		cache:  newCache(cfg.API, cfg.CallTimeout, cfg.Resync, log),
		auth:   a,
		pages:  t,
		static: static,
		events: newEventCache(cfg.API, cfg.CallTimeout, cfg.Now, log),
	}, nil
}

// Run lists and watches every kind until ctx ends, reconnecting with
// backoff when a watch breaks. It returns nil when ctx ends.
func (s *Server) Run(ctx context.Context) error {
	s.cache.run(ctx)
	return nil
}

// Synced is closed once every kind has been listed once.
func (s *Server) Synced() <-chan struct{} { return s.cache.synced }

// Bind makes the dashboard answer as ln's address (the Host and Origin
// checks) and returns the URL to open, which carries the one-time token.
// ln must be a loopback listener (InvalidArgument otherwise).
func (s *Server) Bind(ln net.Listener) (string, error) {
	addr, ok := ln.Addr().(*net.TCPAddr)
	if !ok || !addr.IP.IsLoopback() {
		return "", errdefs.InvalidArgument("dashboard: %s is not a loopback address", ln.Addr())
	}
	s.auth.bind(addr)
	return s.auth.loginURL(), nil
}

// Serve answers HTTP on ln until ctx ends, after Bind(ln). It returns
// http.Server's error, or nil after ctx ended.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	if _, err := s.Bind(ln); err != nil {
		return err
	}
	srv := &http.Server{
		Handler:           s.Handler(),
		ReadHeaderTimeout: 10 * time.Second,
		BaseContext:       func(net.Listener) context.Context { return ctx },
	}
	done := make(chan struct{})
	defer close(done)
	go func() {
		select {
		case <-ctx.Done():
			sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			_ = srv.Shutdown(sctx)
		case <-done:
		}
	}()
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// Handler is the dashboard's HTTP handler, every request behind the
// guard: Host and Origin, the session, GET only.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", s.page(viewOverviewPage))
	mux.HandleFunc("GET /hosts", s.page(viewHosts))
	mux.HandleFunc("GET /hosts/{name}", s.page(viewHost))
	mux.HandleFunc("GET /clusters/{name}", s.page(viewCluster))
	mux.HandleFunc("GET /live/{$}", s.live(viewOverviewPage))
	mux.HandleFunc("GET /live/hosts", s.live(viewHosts))
	mux.HandleFunc("GET /live/hosts/{name}", s.live(viewHost))
	mux.HandleFunc("GET /live/clusters/{name}", s.live(viewCluster))
	files := http.FileServerFS(s.static)
	mux.Handle("GET /static/", http.StripPrefix("/static/", cacheStatic(files)))
	return s.auth.guard(mux)
}

func cacheStatic(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The files are compiled in: they change only with kilnctl.
		w.Header().Set("Cache-Control", "private, max-age=3600")
		h.ServeHTTP(w, r)
	})
}
