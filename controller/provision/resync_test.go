package provision

import (
	"context"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/store/storetest"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// countingStore is a real store that counts the requests the executor
// sends etcd, by kind: single-object reads (Get) and list pages (List).
// With blind set, its Watch delivers no event (a watch that missed every
// change) until ctx ends.
type countingStore struct {
	*store.Store
	blind bool

	mu          sync.Mutex
	gets, lists map[string]int
	hostGets    map[string]int // by host name, never reset
}

func newCountingStore(st *store.Store) *countingStore {
	return &countingStore{Store: st, gets: map[string]int{}, lists: map[string]int{}, hostGets: map[string]int{}}
}

func (s *countingStore) Get(ctx context.Context, kind, name string, into proto.Message) (int64, error) {
	s.mu.Lock()
	s.gets[kind]++
	if kind == HostsKind {
		s.hostGets[name]++
	}
	s.mu.Unlock()
	return s.Store.Get(ctx, kind, name, into)
}

func (s *countingStore) List(ctx context.Context, kind string, newMsg func() proto.Message, opts store.ListOptions) ([]store.Item, string, error) {
	s.mu.Lock()
	s.lists[kind]++
	s.mu.Unlock()
	return s.Store.List(ctx, kind, newMsg, opts)
}

func (s *countingStore) Watch(ctx context.Context, kind string, fromRev int64) <-chan store.WatchEvent {
	if !s.blind {
		return s.Store.Watch(ctx, kind, fromRev)
	}
	ch := make(chan store.WatchEvent)
	go func() { <-ctx.Done(); close(ch) }()
	return ch
}

// hostReads returns the Gets of host name so far.
func (s *countingStore) hostReads(name string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.hostGets[name]
}

// listCounter is a HostCache that counts its listings (resyncs).
type listCounter struct {
	HostCache
	n atomic.Int64
}

func (c *listCounter) Range(ctx context.Context, fn func(store.Item) bool) error {
	c.n.Add(1)
	return c.HostCache.Range(ctx, fn)
}

// counts returns the Gets and Lists of kind so far and resets them.
func (s *countingStore) counts(kind string) (gets, lists int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	gets, lists = s.gets[kind], s.lists[kind]
	s.gets[kind], s.lists[kind] = 0, 0
	return gets, lists
}

// resyncFleet stores an image, machines and hosts without a BMC (no
// power or imaging steps) in the states a resync meets:
//
//   - rest-1..rest-3: Provisioned with the image their Machine wants;
//   - idle: Available, no Machine;
//   - broken: in Error, its Machine still wanting the image;
//   - gone: Provisioned, its Machine deleted (must deprovision);
//   - wants: Available, bound to a Machine that wants the image (must
//     start provisioning);
//   - busy: Provisioning.
//
// It returns the watch caches of hosts, machines and images, synced.
func resyncFleet(t *testing.T, ctx context.Context, st *store.Store) (hosts, machines, images *store.Cache) {
	t.Helper()
	_, err := st.Create(ctx, "images", "img", image("img", "http://images.test/img.raw"))
	require.NoError(t, err)
	host := func(name string, state typesv1.HostState, machine, img string) {
		h := &typesv1.Host{Metadata: &typesv1.ObjectMeta{Name: name}, Spec: &typesv1.HostSpec{},
			Status: &typesv1.HostStatus{State: state, Machine: machine, Image: img}}
		if state == typesv1.HostState_HOST_STATE_ERROR {
			h.Status.ErrorReason = "LayFailed"
		}
		_, err := st.Create(ctx, "hosts", name, h)
		require.NoError(t, err)
		if machine != "" && name != "gone" {
			_, err = st.Create(ctx, "machines", machine, machine_(machine, name, "img"))
			require.NoError(t, err)
		}
	}
	for _, n := range []string{"rest-1", "rest-2", "rest-3"} {
		host(n, stProvisioned, "m-"+n, "img")
	}
	host("idle", stAvailable, "", "")
	host("broken", typesv1.HostState_HOST_STATE_ERROR, "m-broken", "img")
	host("gone", stProvisioned, "m-gone", "img")
	host("wants", stAvailable, "m-wants", "")
	host("busy", stProvisioning, "m-busy", "img")

	hosts = store.NewCache(st, "hosts", func() proto.Message { return &typesv1.Host{} })
	machines = store.NewCache(st, "machines", func() proto.Message { return &typesv1.Machine{} })
	images = store.NewCache(st, "images", func() proto.Message { return &typesv1.Image{} })
	var wg sync.WaitGroup
	cctx, cancel := context.WithCancel(ctx)
	t.Cleanup(func() { cancel(); wg.Wait() })
	for _, c := range []*store.Cache{hosts, machines, images} {
		wg.Go(func() { c.Run(cctx) })
		_, err := c.List(ctx) // waits for the first listing
		require.NoError(t, err)
	}
	return hosts, machines, images
}

// machine_ is a Machine bound to host wanting img.
func machine_(name, host, img string) *typesv1.Machine { return machine(name, host, img) }

// drain takes everything queued, in name order, without reconciling.
func drain(e *Executor) []string {
	var got []string
	for e.q.Len() > 0 {
		n, _ := e.q.Get()
		e.q.Done(n)
		got = append(got, n)
	}
	slices.Sort(got)
	return got
}

// TestResyncQueuesOnlyHostsThatNeedWork: after the first listing (from
// etcd, every host queued: it tells admission what is in flight), a
// resync reads the hosts from the Host cache, sends etcd no request for
// the hosts at rest, and queues only the hosts whose plan would do
// something; a host changed behind the executor's back (no watch runs
// here) is found by the next resync; the periodic full pass lists from
// etcd and queues the same; a host waiting for a slot is queued only
// once its Machine is gone (to leave the line).
func TestResyncQueuesOnlyHostsThatNeedWork(t *testing.T) {
	ctx := t.Context()
	st := newCountingStore(storetest.New(t))
	hosts, machines, images := resyncFleet(t, ctx, st.Store)
	// One slot, taken by busy (Provisioning): a host put in the line
	// stays there.
	e := New(Deps{Store: st, Hosts: hosts, Desired: CachedDesired(st, machines, images)}, Config{MaxInFlight: 1}, nil)
	all := []string{"broken", "busy", "gone", "idle", "rest-1", "rest-2", "rest-3", "wants"}
	needy := []string{"busy", "gone", "wants"}

	e.resync(ctx, true)
	require.Equal(t, all, drain(e), "the first listing queues every host")
	gets, lists := st.counts("hosts")
	require.Equal(t, 1, lists, "the first listing is one page from etcd")
	require.Zero(t, gets)

	e.resync(ctx, false)
	require.Equal(t, needy, drain(e), "a resync from the cache queues the hosts that need work")
	gets, lists = st.counts("hosts")
	if gets != 0 || lists != 0 {
		t.Errorf("resync from the Host cache: %d Gets and %d Lists of hosts sent to etcd, want none", gets, lists)
	}
	// The Machine the cache misses is confirmed gone by etcd (one read),
	// the others come from the cache.
	mgets, _ := st.counts("machines")
	require.Equal(t, 1, mgets, "machine reads: only m-gone's, from etcd")

	// Unbound behind the executor's back: rest-1 no longer wants its
	// image, so it must deprovision.
	h := &typesv1.Host{}
	rev, err := st.Store.Get(ctx, "hosts", "rest-1", h)
	require.NoError(t, err)
	h.Status.Machine = ""
	rev, err = st.Store.Update(ctx, "hosts", "rest-1", h, rev)
	require.NoError(t, err)
	require.NoError(t, hosts.WaitRevision(ctx, rev))
	st.counts("hosts")
	e.resync(ctx, false)
	require.Equal(t, []string{"busy", "gone", "rest-1", "wants"}, drain(e), "the changed host is found by the resync")
	gets, lists = st.counts("hosts")
	require.Zero(t, gets+lists, "still no etcd request for hosts")

	e.resync(ctx, true)
	require.Equal(t, []string{"busy", "gone", "rest-1", "wants"}, drain(e), "the full pass queues the same hosts")
	gets, lists = st.counts("hosts")
	require.Equal(t, 1, lists, "the full pass lists from etcd")
	require.Zero(t, gets)

	// wants waits for a slot: the line wakes it, the resync does not
	// queue it, until its Machine is deleted (no write of the host):
	// then it is queued, to leave the line.
	e.adm.wait("wants")
	e.resync(ctx, false)
	require.Equal(t, []string{"busy", "gone", "rest-1"}, drain(e), "a host waiting for a slot is not queued")
	require.NoError(t, st.Store.Delete(ctx, "machines", "m-wants", 0))
	rev, err = st.Store.Revision(ctx)
	require.NoError(t, err)
	require.NoError(t, machines.WaitRevision(ctx, rev))
	e.resync(ctx, false)
	require.Equal(t, []string{"busy", "gone", "rest-1", "wants"}, drain(e), "a waiting host whose Machine is gone is queued")
	require.False(t, e.adm.skip("wants"), "and planned by the worker, though in the line")
}

// TestResyncFindsMissedChange runs the executor on a watch that misses
// every change: a host unbound after the start is found by a resync from
// the Host cache, and the executor deprovisions it (a host without a BMC
// goes back to Available at once). The hosts at rest are read from etcd
// by the first listing's reconciles only, not by the resyncs.
func TestResyncFindsMissedChange(t *testing.T) {
	ctx := t.Context()
	st := newCountingStore(storetest.New(t))
	st.blind = true
	hosts, machines, images := resyncFleet(t, ctx, st.Store)
	cache := &listCounter{HostCache: hosts}
	e := New(Deps{Store: st, Hosts: cache, Desired: CachedDesired(st, machines, images)},
		Config{ResyncInterval: 20 * time.Millisecond, FullResyncInterval: time.Hour, MaxInFlight: -1}, nil)
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = e.Run(rctx) }()
	defer func() { stop(); <-done }()

	status := func(name string) *typesv1.HostStatus {
		h := &typesv1.Host{}
		_, err := st.Store.Get(ctx, "hosts", name, h)
		require.NoError(t, err)
		return h.GetStatus()
	}
	rest := []string{"rest-1", "rest-3", "idle", "broken"}
	require.Eventually(t, func() bool {
		for _, n := range rest {
			if st.hostReads(n) == 0 {
				return false
			}
		}
		return true
	}, time.Minute, 10*time.Millisecond, "the first listing's reconciles read every host")

	h := &typesv1.Host{}
	rev, err := st.Store.Get(ctx, "hosts", "rest-2", h)
	require.NoError(t, err)
	h.Status.Machine = ""
	_, err = st.Store.Update(ctx, "hosts", "rest-2", h, rev)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		s := status("rest-2")
		return s.GetState() == stAvailable && s.GetImage() == ""
	}, time.Minute, 10*time.Millisecond, "rest-2, unbound with no watch event, deprovisioned by a resync")
	require.Equal(t, stProvisioned, status("rest-1").GetState(), "rest-1 stays Provisioned")

	before := map[string]int{}
	for _, n := range rest {
		before[n] = st.hostReads(n)
	}
	resyncs := cache.n.Load()
	require.Eventually(t, func() bool { return cache.n.Load() >= resyncs+5 }, time.Minute, 10*time.Millisecond, "five more resyncs")
	for _, n := range rest {
		if got := st.hostReads(n) - before[n]; got != 0 {
			t.Errorf("host %s at rest: read %d times from etcd over five resyncs, want 0", n, got)
		}
	}
}

// TestIdleExecutorHoldsFewGoroutines: a worker is a goroutine only while
// it works. An executor with 5,000 workers and nothing to do (each of a
// sharded controller's executors defaults to the admission limit + 64)
// holds a handful of goroutines, not 5,000 idle ones.
func TestIdleExecutorHoldsFewGoroutines(t *testing.T) {
	st := storetest.New(t)
	e := New(Deps{Store: st}, Config{Workers: 5000}, nil)
	before := runtime.NumGoroutine()
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); _ = e.Run(ctx) }()
	defer func() { cancel(); <-done }()
	time.Sleep(500 * time.Millisecond) // started, and idle: no hosts
	if n := runtime.NumGoroutine() - before; n > 50 {
		t.Errorf("an idle executor with 5,000 workers holds %d goroutines, want at most 50", n)
	}
}
