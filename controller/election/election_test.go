package election

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
)

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(string(bytes.TrimRight(p, "\n")))
	return len(p), nil
}

func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, nil))
}

// startEtcd runs an embedded etcd in t.TempDir() and returns its endpoints.
func startEtcd(t testing.TB) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e, err := store.StartEmbedded(ctx, store.EmbeddedConfig{DataDir: filepath.Join(t.TempDir(), "etcd")})
	require.NoError(t, err)
	t.Cleanup(e.Close)
	return e.Endpoints()
}

// dial returns a client of its own, as each controller replica has.
func dial(t testing.TB, endpoints []string) *clientv3.Client {
	t.Helper()
	c, err := store.Dial(endpoints, nil)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

// replica is one controller replica running an Elector. lead records
// when it starts leading and how many replicas lead at once.
type replica struct {
	id      string
	el      *Elector
	leading chan time.Time
	ended   chan struct{}
	done    chan error
}

func startReplica(t *testing.T, ctx context.Context, client *clientv3.Client, id string, ttl int, active *atomic.Int32) *replica {
	r := &replica{
		id:      id,
		el:      New(client, DefaultPrefix, id, ttl, testLogger(t).With("replica", id)),
		leading: make(chan time.Time, 16),
		ended:   make(chan struct{}, 16),
		done:    make(chan error, 1),
	}
	go func() {
		r.done <- r.el.Run(ctx, func(lctx context.Context, _ Term) {
			if n := active.Add(1); n > 1 {
				t.Errorf("%d replicas lead at once", n)
			}
			r.leading <- time.Now()
			<-lctx.Done()
			active.Add(-1)
			r.ended <- struct{}{}
		})
	}()
	return r
}

func waitLeading(t *testing.T, r *replica) time.Time {
	t.Helper()
	select {
	case at := <-r.leading:
		return at
	case <-time.After(2 * time.Minute):
		t.Fatalf("replica %s did not become leader", r.id)
		return time.Time{}
	}
}

func TestOneLeaderAndTakeoverAfterCrash(t *testing.T) {
	endpoints := startEtcd(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var active atomic.Int32
	const ttl = 2

	clientA := dial(t, endpoints)
	a := startReplica(t, ctx, clientA, "controller-a", ttl, &active)
	waitLeading(t, a)
	b := startReplica(t, ctx, dial(t, endpoints), "controller-b", ttl, &active)

	got, err := b.el.Leader(ctx)
	require.NoError(t, err)
	if got != "controller-a" {
		t.Errorf("Leader() = %q, want %q", got, "controller-a")
	}
	if !a.el.IsLeader() || b.el.IsLeader() {
		t.Errorf("IsLeader() a=%v b=%v, want true, false", a.el.IsLeader(), b.el.IsLeader())
	}
	select {
	case <-b.leading:
		t.Fatal("stand-by became leader while the leader is alive")
	default:
	}

	// Crash a: its client goes away without resigning or revoking its lease.
	crashed := time.Now()
	require.NoError(t, clientA.Close())
	select {
	case <-a.ended:
	case <-time.After(time.Minute):
		t.Fatal("crashed leader's lead context was not cancelled")
	}
	took := waitLeading(t, b).Sub(crashed)
	t.Logf("lease TTL %ds: stand-by took over %v after the leader crashed", ttl, took.Round(10*time.Millisecond))
	got, err = b.el.Leader(ctx)
	require.NoError(t, err)
	if got != "controller-b" {
		t.Errorf("Leader() after takeover = %q, want %q", got, "controller-b")
	}
	if a.el.IsLeader() {
		t.Error("crashed replica still reports IsLeader() = true")
	}

	cancel()
	for _, r := range []*replica{a, b} {
		if err := <-r.done; !errors.Is(err, context.Canceled) {
			t.Errorf("Run(%s) = %v, want context.Canceled", r.id, err)
		}
	}
}

// TestShutdownHandsOverAtOnce checks that a leader stopping cleanly
// resigns, so the stand-by does not wait for the lease to expire.
func TestShutdownHandsOver(t *testing.T) {
	endpoints := startEtcd(t)
	var active atomic.Int32
	// A long TTL: if the handover waited for it, the test would time out
	// waiting long before the lease expired.
	const ttl = 600
	ctxA, cancelA := context.WithCancel(context.Background())
	defer cancelA()
	ctxB, cancelB := context.WithCancel(context.Background())
	defer cancelB()
	a := startReplica(t, ctxA, dial(t, endpoints), "controller-a", ttl, &active)
	waitLeading(t, a)
	b := startReplica(t, ctxB, dial(t, endpoints), "controller-b", ttl, &active)

	cancelA()
	if err := <-a.done; !errors.Is(err, context.Canceled) {
		t.Errorf("Run(a) = %v, want context.Canceled", err)
	}
	waitLeading(t, b)
	cancelB()
	<-b.done
}

func TestLeaderWithoutCandidates(t *testing.T) {
	endpoints := startEtcd(t)
	el := New(dial(t, endpoints), DefaultPrefix, "controller-a", 2, nil)
	if _, err := el.Leader(context.Background()); !errdefs.IsNotFound(err) {
		t.Errorf("Leader() with no candidates = %v, want NotFound", err)
	}
	if el.IsLeader() {
		t.Error("IsLeader() before Run = true, want false")
	}
}

// TestLeadReturningCampaignsAgain checks that when lead returns on its own
// the replica resigns and stands again, and can lead again.
func TestLeadReturningCampaignsAgain(t *testing.T) {
	endpoints := startEtcd(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	terms := make(chan struct{}, 8)
	el := New(dial(t, endpoints), DefaultPrefix, "controller-a", 2, testLogger(t))
	done := make(chan error, 1)
	go func() {
		done <- el.Run(ctx, func(context.Context, Term) { terms <- struct{}{} })
	}()
	for i := range 2 {
		select {
		case <-terms:
		case <-time.After(2 * time.Minute):
			t.Fatalf("term %d did not start", i+1)
		}
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("Run() = %v, want context.Canceled", err)
	}
}

// BenchmarkCrashTakeover measures how long a stand-by takes to lead after
// the leader crashes, for a lease TTL of 2 s. Run with -benchtime=3x.
func BenchmarkCrashTakeover(b *testing.B) {
	endpoints := startEtcd(b)
	const ttl = 2
	var total time.Duration
	for b.Loop() {
		ctx, cancel := context.WithCancel(context.Background())
		clientA, err := store.Dial(endpoints, nil)
		require.NoError(b, err)
		leadingA := make(chan struct{}, 1)
		leadingB := make(chan time.Time, 1)
		prefix := DefaultPrefix + "-bench"
		go New(clientA, prefix, "a", ttl, nil).Run(ctx, func(l context.Context, _ Term) { leadingA <- struct{}{}; <-l.Done() })
		<-leadingA
		clientB := dial(b, endpoints)
		go New(clientB, prefix, "b", ttl, nil).Run(ctx, func(l context.Context, _ Term) { leadingB <- time.Now(); <-l.Done() })
		time.Sleep(200 * time.Millisecond) // Let b campaign and wait.
		crashed := time.Now()
		clientA.Close()
		total += (<-leadingB).Sub(crashed)
		cancel()
	}
	b.ReportMetric(total.Seconds()/float64(b.N), "s/takeover")
}
