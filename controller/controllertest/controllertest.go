// Package controllertest runs a real Kiln controller for tests: embedded
// etcd in t.TempDir(), the gRPC API on an ephemeral loopback port, a fresh
// CA, and helpers that make operator configs and enrollment tokens. It is
// for the tests of kilnctl, the agent and the controller itself.
//
//	env := controllertest.Start(t)
//	conn := env.Dial(t, env.ConfigFor(t, "reader", "alice"))
package controllertest

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/kilnconfig"
)

// Env is a running controller.
type Env struct {
	// Addr is the API address, "127.0.0.1:<port>".
	Addr string
	// CAHash is the CA pin, "sha256:<hex>".
	CAHash string
	// CAPEM is the CA certificate in PEM.
	CAPEM []byte
	// AdminConfigPath is the admin kilnconfig the controller wrote.
	AdminConfigPath string
	// DataDir is the controller's data directory.
	DataDir string
	// Controller is the running controller.
	Controller *controller.Controller
	// BootURL is the boot server's base URL, "http://127.0.0.1:<port>",
	// when the test turned it on (WithBootServer); "" otherwise.
	BootURL string

	logs *testWriter
	stop func()
}

// Option adjusts the controller's configuration before it starts.
type Option func(*controller.Config)

// WithClock sets the controller's clock (token expiry, heartbeats).
func WithClock(clock func() time.Time) Option {
	return func(c *controller.Config) { c.Clock = clock }
}

// WithConfig lets a test change any field of the configuration.
func WithConfig(fn func(*controller.Config)) Option { return Option(fn) }

// WithBootServer serves the boot server on an ephemeral loopback port
// with the boot media in mediaDir and golden images in imageDir (may be
// ""); Env.BootURL is its base URL.
func WithBootServer(mediaDir, imageDir string) Option {
	return func(c *controller.Config) {
		c.BootListenAddr = "127.0.0.1:0"
		c.BootMediaDir = mediaDir
		c.ImageDir = imageDir
	}
}

// Start runs a controller until the test ends. It fails the test when
// the controller does not come up.
func Start(t testing.TB, opts ...Option) *Env {
	t.Helper()
	dir := t.TempDir()
	cfg := controller.Config{
		DataDir:    dir,
		ListenAddr: "127.0.0.1:0",
		ID:         "controllertest",
	}
	for _, o := range opts {
		o(&cfg)
	}
	w := &testWriter{t: t}
	log := slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelInfo}))
	c, err := controller.New(cfg, log)
	if err != nil {
		t.Fatalf("controllertest: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	stop := sync.OnceFunc(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("controllertest: controller: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("controllertest: controller did not stop within 30s")
		}
		w.stop()
	})
	t.Cleanup(stop)
	select {
	case <-c.Ready():
	case err := <-done:
		t.Fatalf("controllertest: controller stopped before serving: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatalf("controllertest: controller not ready after 60s")
	}
	bootURL := ""
	if a := c.BootAddr(); a != "" {
		bootURL = "http://" + a
	}
	return &Env{
		BootURL:         bootURL,
		logs:            w,
		Addr:            c.Addr(),
		CAHash:          c.CA().Hash(),
		CAPEM:           c.CA().CertPEM(),
		AdminConfigPath: c.AdminConfigPath(),
		DataDir:         cfg.DataDir,
		Controller:      c,
		stop:            stop,
	}
}

// Stop stops the controller and waits for it, as the end of the test
// would; calling it again does nothing.
func (e *Env) Stop() { e.stop() }

// ConfigFor issues a certificate with role ("reader", "operator" or
// "admin") for name and returns the path of a kilnconfig file for it.
func (e *Env) ConfigFor(t testing.TB, role, name string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kilnconfig-"+role+"-"+name+".yaml")
	if err := e.Controller.WriteClientConfig(role, name, path); err != nil {
		t.Fatalf("controllertest: config for %s %q: %v", role, name, err)
	}
	return path
}

// Token creates a one-time enrollment token valid for ttl, bound to host
// unless host is "".
func (e *Env) Token(t testing.TB, host string, ttl time.Duration) string {
	t.Helper()
	tok, _, err := e.Controller.CreateToken(context.Background(), ttl, host, "controllertest")
	if err != nil {
		t.Fatalf("controllertest: token: %v", err)
	}
	return tok
}

// Store is the controller's store, for reading and writing state directly.
func (e *Env) Store() *store.Store { return e.Controller.Store() }

// Dial connects to the API with the kilnconfig at configPath; the
// connection closes when the test ends.
func (e *Env) Dial(t testing.TB, configPath string) *grpc.ClientConn {
	t.Helper()
	cfg, err := kilnconfig.Load(configPath)
	if err != nil {
		t.Fatalf("controllertest: %v", err)
	}
	tc, err := cfg.TLS()
	if err != nil {
		t.Fatalf("controllertest: %v", err)
	}
	return e.dial(t, tc)
}

// DialAnonymous connects to the API trusting the controller's CA but
// presenting no client certificate, as an agent does before enrolling.
func (e *Env) DialAnonymous(t testing.TB) *grpc.ClientConn {
	t.Helper()
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(e.CAPEM)
	return e.dial(t, &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: pool})
}

// DialCert connects presenting the given certificate and key (PEM), for
// example an agent's enrolled identity.
func (e *Env) DialCert(t testing.TB, certPEM, keyPEM []byte) *grpc.ClientConn {
	t.Helper()
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatalf("controllertest: %v", err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(e.CAPEM)
	return e.dial(t, &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: pool, Certificates: []tls.Certificate{pair}})
}

func (e *Env) dial(t testing.TB, tc *tls.Config) *grpc.ClientConn {
	conn, err := grpc.NewClient(e.Addr, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
	if err != nil {
		t.Fatalf("controllertest: dial %s: %v", e.Addr, err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// Logs returns everything the controller has logged so far (slog text
// format), for tests that check what must or must not appear in its logs.
func (e *Env) Logs() string {
	e.logs.mu.Lock()
	defer e.logs.mu.Unlock()
	return e.logs.all.String()
}

// testWriter sends the controller's log lines to t.Log until the test
// ends, then to stderr only when KILN_TEST_LOG is set. It keeps a copy of
// all of them (Env.Logs).
type testWriter struct {
	t       testing.TB
	mu      sync.Mutex
	stopped bool
	all     bytes.Buffer
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.all.Write(p)
	if w.stopped {
		if os.Getenv("KILN_TEST_LOG") != "" {
			return os.Stderr.Write(p)
		}
		return len(p), nil
	}
	w.t.Log(string(trimNewline(p)))
	return len(p), nil
}

func (w *testWriter) stop() {
	w.mu.Lock()
	w.stopped = true
	w.mu.Unlock()
}

func trimNewline(p []byte) []byte {
	if n := len(p); n > 0 && p[n-1] == '\n' {
		return p[:n-1]
	}
	return p
}

var _ io.Writer = (*testWriter)(nil)
