package enrollment_test

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/store/storetest"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// createAgentHost stores a provisioned Host whose agent holds serial and
// never checked in.
func createAgentHost(t *testing.T, ctx context.Context, st *store.Store, name, serial string) {
	t.Helper()
	_, err := st.Create(ctx, "hosts", name, &typesv1.Host{
		Metadata: &typesv1.ObjectMeta{Name: name},
		Spec:     &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "none"}},
		Status:   &typesv1.HostStatus{State: typesv1.HostState_HOST_STATE_PROVISIONED, Agent: &typesv1.AgentStatus{CertificateSerial: serial}},
	})
	require.NoError(t, err)
}

func revision(t *testing.T, ctx context.Context, st *store.Store) int64 {
	t.Helper()
	rev, err := st.Revision(ctx)
	require.NoError(t, err)
	return rev
}

// An agent's first check-in makes it reachable: its Host and the
// AgentReachable event are one etcd write (one revision), with or without
// the host cache, and with the cache the check-in reads nothing from
// etcd (it writes the cached Host with a compare-and-swap).
func TestFirstCheckInIsOneWrite(t *testing.T) {
	for _, tc := range []struct {
		name      string
		cache     bool
		wantReads int64
	}{
		{name: "from etcd", cache: false, wantReads: 1},
		{name: "from the host cache", cache: true, wantReads: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			st := storetest.New(t)
			cs := &storetest.ReadCounter{Store: st}
			log := slog.New(slog.DiscardHandler)
			rec := events.New(st.Client(), time.Hour, nil, log)
			ca, err := pki.NewCA("test", time.Now())
			require.NoError(t, err)
			svc := enrollment.New(cs, ca, rec, enrollment.Config{Replica: "r1"}, log)
			createAgentHost(t, ctx, st, "h-1", "a1")
			if tc.cache {
				startHostCache(t, ctx, svc, st)
			}

			rev0, reads0 := revision(t, ctx, st), cs.Reads.Load()
			_, err = svc.Heartbeat(ctx, "h-1", "a1", enrollment.HeartbeatRequest{AgentAddress: "10.0.0.1:7444", Version: "v1"})
			require.NoError(t, err)
			require.Equal(t, rev0+1, revision(t, ctx, st), "etcd revisions of a first check-in (Host and event)")
			require.Equal(t, tc.wantReads, cs.Reads.Load()-reads0, "etcd reads of a first check-in")

			h := &typesv1.Host{}
			hostRev, err := st.Get(ctx, "hosts", "h-1", h)
			require.NoError(t, err)
			require.Equal(t, rev0+1, hostRev, "the Host's revision")
			require.Equal(t, "10.0.0.1:7444", h.GetStatus().GetAgent().GetAddress())
			evs, err := rec.List(ctx, "hosts", "h-1", 0)
			require.NoError(t, err)
			require.Len(t, evs, 1, "events of h-1")
			require.Equal(t, "AgentReachable", evs[0].GetReason())
			resp, err := st.Client().Get(ctx, events.Prefix+"hosts/h-1/", clientv3.WithPrefix())
			require.NoError(t, err)
			require.Equal(t, hostRev, resp.Kvs[0].ModRevision, "the event's revision: the Host's")

			// The next heartbeat changes nothing: no write.
			_, err = svc.Heartbeat(ctx, "h-1", "a1", enrollment.HeartbeatRequest{AgentAddress: "10.0.0.1:7444", Version: "v1"})
			require.NoError(t, err)
			require.Equal(t, rev0+1, revision(t, ctx, st), "etcd revisions after an idle heartbeat")
		})
	}
}

// startHostCache runs a host cache for svc until the test ends and waits
// until it is confirmed current.
func startHostCache(t *testing.T, ctx context.Context, svc *enrollment.Service, st *store.Store) {
	t.Helper()
	hosts := store.NewCache(st, "hosts", func() proto.Message { return &typesv1.Host{} })
	startCache(t, ctx, svc, hosts, st)
}

func startCache(t *testing.T, ctx context.Context, svc *enrollment.Service, hosts interface {
	enrollment.HostCache
	Run(context.Context)
}, st *store.Store) {
	t.Helper()
	svc.UseHostCache(hosts, st)
	rctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { hosts.Run(rctx) })
	wg.Go(func() { svc.RunHostCache(rctx) })
	t.Cleanup(func() { stop(); wg.Wait() })
	rev := revision(t, ctx, st)
	require.NoError(t, hosts.WaitRevision(ctx, rev))
	// A confirmation of the cache (RunHostCache checks at once, then
	// every second) after the Host was stored.
	after := time.Now()
	require.Eventually(t, func() bool { return !svc.HostCacheConfirmed().Before(after) }, 5*time.Second, 10*time.Millisecond, "host cache confirmed current")
}

// staleCache is a HostCache that answers one Host as it was at rev,
// whatever etcd holds now: a watch cache that has not caught up.
type staleCache struct {
	h   *typesv1.Host
	rev int64
}

func (c *staleCache) Get(name string) (store.Item, bool) {
	if name != c.h.GetMetadata().GetName() {
		return store.Item{}, false
	}
	return store.Item{Name: name, Rev: c.rev, Msg: c.h}, true
}

func (c *staleCache) WaitRevision(context.Context, int64) error { return nil }

func (c *staleCache) Run(ctx context.Context) { <-ctx.Done() }

// A first check-in decided on a stale cached Host writes nothing the
// store does not hold: the compare-and-swap on the cached revision fails,
// and the heartbeat is decided again on etcd's Host. The attack: the host
// was enrolled again (serial b2) after the cached version, and the old
// certificate (a1) checks in: refused, nothing written.
func TestCheckInFromStaleCache(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st := storetest.New(t)
	log := slog.New(slog.DiscardHandler)
	rec := events.New(st.Client(), time.Hour, nil, log)
	ca, err := pki.NewCA("test", time.Now())
	require.NoError(t, err)
	svc := enrollment.New(st, ca, rec, enrollment.Config{Replica: "r1"}, log)
	createAgentHost(t, ctx, st, "h-1", "a1")
	old := &typesv1.Host{}
	oldRev, err := st.Get(ctx, "hosts", "h-1", old)
	require.NoError(t, err)
	startCache(t, ctx, svc, &staleCache{h: old, rev: oldRev}, st)

	setSerial(t, ctx, st, "h-1", "b2")
	rev0 := revision(t, ctx, st)
	_, err = svc.Heartbeat(ctx, "h-1", "a1", enrollment.HeartbeatRequest{AgentAddress: "10.0.0.9:7444", Version: "v1"})
	require.True(t, errdefs.IsPermissionDenied(err), "Heartbeat(replaced serial a1) from a stale cache = %v, want PermissionDenied", err)
	require.Equal(t, rev0, revision(t, ctx, st), "etcd revision after the refused check-in")
	evs, err := rec.List(ctx, "hosts", "h-1", 0)
	require.NoError(t, err)
	require.Empty(t, evs, "events of the refused check-in")

	// The current certificate checks in: the stale cached Host refuses
	// it, so it is decided on etcd's and written once, with its event.
	_, err = svc.Heartbeat(ctx, "h-1", "b2", enrollment.HeartbeatRequest{AgentAddress: "10.0.0.2:7444", Version: "v1"})
	require.NoError(t, err)
	require.Equal(t, rev0+1, revision(t, ctx, st), "etcd revisions of the check-in")
	h := &typesv1.Host{}
	_, err = st.Get(ctx, "hosts", "h-1", h)
	require.NoError(t, err)
	require.Equal(t, "b2", h.GetStatus().GetAgent().GetCertificateSerial())
	require.Equal(t, "10.0.0.2:7444", h.GetStatus().GetAgent().GetAddress())
}

// gatedStore is a Store whose Host writes wait for a gate and count how
// many wait at once.
type gatedStore struct {
	*store.Store
	gate          chan struct{}
	now, max, all atomic.Int64
}

func (g *gatedStore) UpdateWith(ctx context.Context, kind, name string, m proto.Message, expectRev int64, ops []clientv3.Op) (int64, []*etcdserverpb.ResponseOp, error) {
	n := g.now.Add(1)
	for {
		m := g.max.Load()
		if n <= m || g.max.CompareAndSwap(m, n) {
			break
		}
	}
	g.all.Add(1)
	defer g.now.Add(-1)
	select {
	case <-g.gate:
	case <-ctx.Done():
		return 0, nil, ctx.Err()
	}
	return g.Store.UpdateWith(ctx, kind, name, m, expectRev, ops)
}

// At most Config.MaxInFlight heartbeats are at etcd at once: the first
// check-ins of 12 agents with MaxInFlight 3 reach the store 3 at a time
// and all complete; a heartbeat whose caller gives up while waiting for a
// turn returns Unavailable and writes nothing.
func TestMaxInFlight(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st := storetest.New(t)
	gs := &gatedStore{Store: st, gate: make(chan struct{})}
	log := slog.New(slog.DiscardHandler)
	rec := events.New(st.Client(), time.Hour, nil, log)
	ca, err := pki.NewCA("test", time.Now())
	require.NoError(t, err)
	svc := enrollment.New(gs, ca, rec, enrollment.Config{Replica: "r1", MaxInFlight: 3}, log)
	const n = 12
	names := make([]string, n)
	for i := range names {
		names[i] = "h-" + string(rune('a'+i))
		createAgentHost(t, ctx, st, names[i], "a1")
	}
	errs := make(chan error, n)
	for _, name := range names {
		go func() {
			_, err := svc.Heartbeat(ctx, name, "a1", enrollment.HeartbeatRequest{AgentAddress: "10.0.0.1:7444"})
			errs <- err
		}()
	}
	require.Eventually(t, func() bool { return gs.now.Load() == 3 }, 10*time.Second, 5*time.Millisecond, "heartbeats at the store")

	// One more, whose caller gives up while all turns are taken.
	wctx, wcancel := context.WithTimeout(ctx, 100*time.Millisecond)
	_, err = svc.Heartbeat(wctx, "h-a", "a1", enrollment.HeartbeatRequest{AgentAddress: "10.0.0.1:7444"})
	wcancel()
	require.True(t, errdefs.IsUnavailable(err), "Heartbeat waiting for a turn past its deadline = %v, want Unavailable", err)

	for range n {
		gs.gate <- struct{}{}
	}
	for range n {
		require.NoError(t, <-errs)
	}
	require.Equal(t, int64(3), gs.max.Load(), "most heartbeats at the store at once")
	require.Equal(t, int64(n), gs.all.Load(), "Host writes")
}
