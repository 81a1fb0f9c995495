package bmc_test

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/bmc"
	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/e2e/lab/redfish"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
)

type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func TestCircuitBreakerOpensAndRecovers(t *testing.T) {
	m := &machine.Memory{}
	e := startEmulator(t, redfish.Config{Systems: oneSystem(m)})
	clock := &fakeClock{now: time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)}
	opts := fastOpts("rack2-u7")
	opts.MaxAttempts = 2
	opts.BreakerThreshold = 3
	opts.BreakerCooldown = time.Minute
	opts.Now = clock.Now
	b := dialEmulator(t, e, opts)

	e.FailNext(1_000_000, 500)
	for i := range 3 {
		_, err := b.PowerState(ctxTimeout(t, 10*time.Second))
		require.Error(t, err, "call %d against a failing bmc", i)
	}
	if !b.CircuitOpen() {
		t.Fatalf("CircuitOpen() = false after 3 failed calls, want true")
	}
	before := e.Stats().Requests
	_, err := b.PowerState(ctxTimeout(t, 10*time.Second))
	if !errdefs.IsUnavailable(err) || !strings.HasPrefix(err.Error(), "circuit open for bmc rack2-u7: 3 consecutive failures, last: ") {
		t.Fatalf("PowerState() with the circuit open: error = %v, want Unavailable circuit open ...", err)
	}
	if after := e.Stats().Requests; after != before {
		t.Fatalf("open circuit still sent %d requests to the bmc", after-before)
	}
	c := b.Condition()
	if c.GetStatus() != conditions.False || c.GetReason() != bmc.ReasonCircuitOpen {
		t.Fatalf("Condition() = %v, want False/CircuitOpen", c)
	}

	// The BMC recovers, but the circuit stays open until the cool-down ends.
	e.ClearFaults()
	_, err = b.PowerState(ctxTimeout(t, 10*time.Second))
	require.True(t, errdefs.IsUnavailable(err), "call during cool-down: %v", err)

	clock.Advance(61 * time.Second)
	state, err := b.PowerState(ctxTimeout(t, 10*time.Second))
	require.NoError(t, err, "trial call after the cool-down")
	if state != bmc.PowerOff {
		t.Fatalf("PowerState() = %q, want off", state)
	}
	if b.CircuitOpen() {
		t.Fatalf("CircuitOpen() = true after a successful trial call")
	}
	if c := b.Condition(); c.GetStatus() != conditions.True {
		t.Fatalf("Condition() after recovery = %v, want True", c)
	}
}

func TestCircuitTrialFailureReopens(t *testing.T) {
	m := &machine.Memory{}
	e := startEmulator(t, redfish.Config{Systems: oneSystem(m)})
	clock := &fakeClock{now: time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)}
	opts := fastOpts("flappy")
	opts.MaxAttempts = 1
	opts.BreakerThreshold = 1
	opts.Now = clock.Now
	b := dialEmulator(t, e, opts)
	e.FailNext(1_000_000, 502)
	_, err := b.PowerState(ctxTimeout(t, 10*time.Second))
	require.Error(t, err)
	clock.Advance(2 * time.Minute)
	_, err = b.PowerState(ctxTimeout(t, 10*time.Second))
	require.Error(t, err)
	if !b.CircuitOpen() {
		t.Fatalf("CircuitOpen() = false after the trial call failed, want true")
	}
}

// echoServer is a misbehaving BMC that answers every request with a 500
// whose body echoes the request, credentials included.
func echoServer(t *testing.T) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		u, p, _ := r.BasicAuth()
		if r.URL.Path == "/redfish/v1/" || r.URL.Path == "/redfish/v1" {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"@odata.id":"/redfish/v1/","Systems":{"@odata.id":"/redfish/v1/Systems"},"Links":{"Sessions":{"@odata.id":"/redfish/v1/SessionService/Sessions"}}}`)
			return
		}
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = io.WriteString(w, "request was: "+string(body)+" basic="+u+":"+p)
	}))
	t.Cleanup(srv.Close)
	return srv
}

func TestPasswordNeverInErrors(t *testing.T) {
	srv := echoServer(t)
	b, err := bmc.Dial(context.Background(), bmc.Endpoint{
		Protocol: bmc.ProtocolRedfish, Address: srv.URL, Username: testUser, Password: testPassword,
	}, fastOpts("echo"))
	require.NoError(t, err)

	calls := map[string]func(context.Context) error{
		"PowerState": func(ctx context.Context) error { _, err := b.PowerState(ctx); return err },
		"PowerOn":    b.PowerOn,
		"PowerCycle": b.PowerCycle,
		"SetBoot":    func(ctx context.Context) error { return b.SetBootDevice(ctx, bmc.BootPXE, false, true) },
		"Insert":     func(ctx context.Context) error { return b.InsertVirtualMedia(ctx, "http://127.0.0.1:9/x.iso") },
		"Inventory":  func(ctx context.Context) error { _, err := b.Inventory(ctx); return err },
	}
	for name, call := range calls {
		err := call(ctxTimeout(t, 10*time.Second))
		require.Error(t, err, name)
		if !strings.Contains(err.Error(), "<redacted>") {
			t.Errorf("%s() error = %q: the echoed password was expected to show as <redacted>", name, err)
		}
		if strings.Contains(err.Error(), testPassword) {
			t.Errorf("%s() error contains the password: %q", name, err)
		}
	}
	if c := b.Condition(); strings.Contains(c.GetMessage(), testPassword) {
		t.Errorf("Condition() message contains the password: %q", c.GetMessage())
	}
}

// syncBuffer is a log sink safe for concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestPasswordNeverLogged(t *testing.T) {
	srv := echoServer(t)
	var logs syncBuffer
	opts := fastOpts("echo-logged")
	opts.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	b, err := bmc.Dial(context.Background(), bmc.Endpoint{
		Protocol: bmc.ProtocolRedfish, Address: srv.URL, Username: testUser, Password: testPassword,
	}, opts)
	require.NoError(t, err)
	require.Error(t, b.PowerOn(ctxTimeout(t, 10*time.Second)))
	out := logs.String()
	if !strings.Contains(out, "bmc call failed") {
		t.Fatalf("no failure logged; logs: %q", out)
	}
	if strings.Contains(out, testPassword) {
		t.Fatalf("logs contain the password: %q", out)
	}
}

// TestHungBMCDetectedFast: a BMC that accepts connections and never
// answers costs one response timeout per attempt, is tried twice per
// call, and every timed-out attempt counts toward the breaker.
func TestHungBMCDetectedFast(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	var (
		mu    sync.Mutex
		conns []net.Conn
	)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c) // held open, never answered
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})

	opts := fastOpts("hung")
	opts.ResponseTimeout = 200 * time.Millisecond
	b, err := bmc.Dial(context.Background(), bmc.Endpoint{
		Protocol: bmc.ProtocolRedfish, Address: "http://" + ln.Addr().String(), Username: testUser, Password: testPassword,
	}, opts)
	require.NoError(t, err)

	start := time.Now()
	_, err = b.PowerState(ctxTimeout(t, 30*time.Second))
	took := time.Since(start)
	if !errdefs.IsUnavailable(err) || !strings.Contains(err.Error(), "the bmc gave no answer") {
		t.Fatalf("PowerState() on a hung bmc = %v, want Unavailable ... gave no answer", err)
	}
	t.Logf("PowerState() = %v after %v", err, took)
	if st := b.Stats(); st.Attempts != 2 || took > 2*time.Second {
		t.Fatalf("PowerState() on a hung bmc: %d attempts in %v, want 2 attempts in well under 2s", st.Attempts, took)
	}
	if c := b.Condition(); c.GetStatus() != conditions.False {
		t.Fatalf("Condition() after one hung call = %s, want False", c.GetStatus())
	}
	// Each call counts both timed-out attempts: the third call opens the
	// circuit (threshold 5).
	for range 2 {
		_, _ = b.PowerState(ctxTimeout(t, 30*time.Second))
	}
	if !b.CircuitOpen() {
		t.Fatalf("CircuitOpen() = false after 3 calls (6 timed-out attempts) to a hung bmc, want true")
	}
}
