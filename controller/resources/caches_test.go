package resources

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/store/storetest"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// countingStore is the real store that counts the List calls that reach
// etcd.
type countingStore struct {
	*store.Store
	lists   atomic.Int64
	watches atomic.Int64
}

func (c *countingStore) List(ctx context.Context, kind string, newMsg func() proto.Message, opts store.ListOptions) ([]store.Item, string, error) {
	c.lists.Add(1)
	return c.Store.List(ctx, kind, newMsg, opts)
}

func (c *countingStore) Watch(ctx context.Context, kind string, fromRev int64) <-chan store.WatchEvent {
	c.watches.Add(1)
	return c.Store.Watch(ctx, kind, fromRev)
}

type nopRecorder struct{}

func (nopRecorder) Record(context.Context, string, string, string, string, string) {}

func testHost(name, rack string) *controllerv1.Resource {
	return &controllerv1.Resource{Kind: &controllerv1.Resource_Host{Host: &typesv1.Host{
		ApiVersion: APIVersion, Kind: "Host",
		Metadata: &typesv1.ObjectMeta{Name: name, Labels: map[string]string{"rack": rack}},
		Spec:     &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "none"}},
	}}}
}

// With caches, List reads no page from etcd, shows what an Apply that
// returned stored (no waiting for the watch), and returns copies (a
// caller that changes an item does not change the cache); without a
// synced cache it lists from etcd as before.
func TestListFromCaches(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	st := storetest.New(t)
	cs := &countingStore{Store: st}
	svc := New(cs, nopRecorder{}, nil, slog.New(slog.DiscardHandler))
	var objs []*controllerv1.Resource
	for i := range 12 {
		objs = append(objs, testHost(fmt.Sprintf("h-%02d", i), []string{"r1", "r2", "r3"}[i%3]))
	}
	_, err := svc.Apply(ctx, objs, false)
	require.NoError(t, err)

	caches := NewCaches(st)
	svc.UseCaches(caches)
	// Not running yet: List reads etcd.
	items, _, err := svc.List(ctx, "hosts", nil, 0, "")
	require.NoError(t, err)
	require.Len(t, items, 12)
	require.Positive(t, cs.lists.Load(), "List before the caches are synced reads etcd")

	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); caches.Run(rctx) }()
	t.Cleanup(func() { stop(); <-done })
	require.Eventually(t, func() bool { return caches.Kind("hosts").Synced() }, 10*time.Second, 10*time.Millisecond)
	cs.lists.Store(0)

	list := func(selector map[string]string, limit int64) []string {
		var names []string
		cont := ""
		for {
			items, next, err := svc.List(ctx, "hosts", selector, limit, cont)
			require.NoError(t, err)
			for _, it := range items {
				h := it.GetHost()
				require.Equal(t, "Host", h.GetKind())
				require.NotEmpty(t, h.GetMetadata().GetResourceVersion())
				names = append(names, h.GetMetadata().GetName())
			}
			if cont = next; cont == "" {
				return names
			}
		}
	}
	require.Equal(t, []string{"h-00", "h-03", "h-06", "h-09"}, list(map[string]string{"rack": "r1"}, 3))
	require.Len(t, list(nil, 5), 12)

	// Read-your-writes: an applied host is listed by the next List.
	_, err = svc.Apply(ctx, []*controllerv1.Resource{testHost("h-03a", "r1")}, false)
	require.NoError(t, err)
	require.Equal(t, []string{"h-00", "h-03", "h-03a", "h-06", "h-09"}, list(map[string]string{"rack": "r1"}, 0))
	require.Zero(t, cs.lists.Load(), "List calls that reached etcd with synced caches")

	// Items are copies where the API changes them.
	stored := &typesv1.Host{}
	rev, err := st.Get(ctx, "hosts", "h-00", stored)
	require.NoError(t, err)
	stored.Status = &typesv1.HostStatus{Agent: &typesv1.AgentStatus{Address: "127.0.0.1:7444"}} // as the heartbeat handler writes
	_, err = st.Update(ctx, "hosts", "h-00", stored, rev)
	require.NoError(t, err)
	items, _, err = svc.List(ctx, "hosts", nil, 1, "")
	require.NoError(t, err)
	h := items[0].GetHost()
	h.Metadata.Labels["rack"] = "changed"
	h.Status.Agent.LastHeartbeat = timestamppb.Now()
	it, ok := caches.Kind("hosts").Get("h-00")
	require.True(t, ok)
	cached := it.Msg.(*typesv1.Host)
	require.Equal(t, "r1", cached.GetMetadata().GetLabels()["rack"])
	require.Empty(t, cached.GetMetadata().GetResourceVersion(), "the cache's metadata")
	require.Nil(t, cached.GetStatus().GetAgent().GetLastHeartbeat(), "the cache's agent status")
}

// The caches index what planners look objects up by.
func TestCachesIndexes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	st := storetest.New(t)
	for _, m := range []*typesv1.Machine{
		{Metadata: &typesv1.ObjectMeta{Name: "c1-cp-0"}, Spec: &typesv1.MachineSpec{Cluster: "c1", Host: "h-1", Owner: "ControlPlane/c1"}},
		{Metadata: &typesv1.ObjectMeta{Name: "c1-md-0"}, Spec: &typesv1.MachineSpec{Cluster: "c1", Host: "h-2", Owner: "MachineDeployment/c1-md"}},
		{Metadata: &typesv1.ObjectMeta{Name: "c2-cp-0"}, Spec: &typesv1.MachineSpec{Cluster: "c2", Host: "h-3", Owner: "ControlPlane/c2"}},
	} {
		_, err := st.Create(ctx, "machines", m.GetMetadata().GetName(), m)
		require.NoError(t, err)
	}
	for _, h := range []*typesv1.Host{
		{Metadata: &typesv1.ObjectMeta{Name: "h-2"}, Status: &typesv1.HostStatus{Machine: "c1-md-0", State: typesv1.HostState_HOST_STATE_PROVISIONED}},
		{Metadata: &typesv1.ObjectMeta{Name: "h-4"}, Status: &typesv1.HostStatus{State: typesv1.HostState_HOST_STATE_AVAILABLE, Conditions: []*typesv1.Condition{
			{Type: "LifecycleRunning", Status: "False"}, {Type: "BMCReachable", Status: "True"}, {Type: "AgentReachable", Status: "Unknown"}}}},
		{Metadata: &typesv1.ObjectMeta{Name: "h-5"}, Status: &typesv1.HostStatus{State: typesv1.HostState_HOST_STATE_AVAILABLE}},
	} {
		_, err := st.Create(ctx, "hosts", h.GetMetadata().GetName(), h)
		require.NoError(t, err)
	}
	caches := NewCaches(st)
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); caches.Run(rctx) }()
	t.Cleanup(func() { stop(); <-done })
	m, h := caches.Kind("machines"), caches.Kind("hosts")
	require.Eventually(t, func() bool { return m.Synced() && h.Synced() }, 10*time.Second, 10*time.Millisecond)

	names := func(items []store.Item) []string {
		var out []string
		for _, it := range items {
			out = append(out, it.Name)
		}
		return out
	}
	tests := []struct {
		cache        *store.Cache
		index, value string
		want         []string
	}{
		{m, IndexCluster, "c1", []string{"c1-cp-0", "c1-md-0"}},
		{m, IndexOwner, "ControlPlane/c2", []string{"c2-cp-0"}},
		{m, IndexHost, "h-2", []string{"c1-md-0"}},
		{h, IndexMachine, "c1-md-0", []string{"h-2"}},
		{caches.Kind("controlplanes"), IndexCluster, "c1", nil},
		{h, IndexState, "HOST_STATE_AVAILABLE", []string{"h-4", "h-5"}},
		{h, IndexState, "HOST_STATE_PROVISIONED", []string{"h-2"}},
		{h, IndexConditionNotTrue, "LifecycleRunning", []string{"h-4"}},
		{h, IndexConditionNotTrue, "AgentReachable", []string{"h-4"}},
		{h, IndexConditionNotTrue, "BMCReachable", nil},
	}
	for _, tt := range tests {
		if got := names(tt.cache.ByIndex(tt.index, tt.value)); !slices.Equal(got, tt.want) {
			t.Errorf("ByIndex(%q, %q) = %v, want %v", tt.index, tt.value, got, tt.want)
		}
	}
	require.Nil(t, h.ByIndex(IndexCluster, "c1"), "hosts have no spec.cluster index")
	require.Equal(t, 2, h.IndexLen(IndexState, "HOST_STATE_AVAILABLE"))
	require.True(t, h.Encoded() && m.Encoded(), "a fleet has a Host and a Machine per host: kept encoded")
	require.False(t, caches.Kind("clusters").Encoded())
	require.Nil(t, caches.Kind("gadgets"))
}

// With synced caches, API watches are fed from the kind's cache: no etcd
// watch per watcher, and the same events (ADDED, MODIFIED, DELETED).
func TestWatchFromCaches(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	st := storetest.New(t)
	cs := &countingStore{Store: st}
	svc := New(cs, nopRecorder{}, nil, slog.New(slog.DiscardHandler))
	caches := NewCaches(st)
	svc.UseCaches(caches)
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); caches.Run(rctx) }()
	t.Cleanup(func() { stop(); <-done })
	require.Eventually(t, func() bool { return caches.Kind("hosts").Synced() }, 10*time.Second, 10*time.Millisecond)

	type seen struct{ typ, name string }
	const watchers = 3
	var got [watchers]chan seen
	wctx, wcancel := context.WithCancel(ctx)
	var running sync.WaitGroup
	for i := range watchers {
		got[i] = make(chan seen, 1000)
		running.Go(func() {
			_ = svc.Watch(wctx, "hosts", "", func(ev *controllerv1.WatchEvent) error {
				got[i] <- seen{ev.GetType(), ev.GetResource().GetHost().GetMetadata().GetName()}
				return nil
			})
		})
	}
	// Every watcher is subscribed once a change reached it.
	warm := 0
	require.Eventually(t, func() bool {
		if _, err := svc.Apply(ctx, []*controllerv1.Resource{testHost(fmt.Sprintf("warm-%d", warm), "r1")}, false); err != nil {
			t.Errorf("Apply(warm-%d) = %v", warm, err)
			return false
		}
		warm++
		for i := range got {
			if len(got[i]) == 0 {
				return false
			}
		}
		return true
	}, 10*time.Second, 50*time.Millisecond)

	_, err := svc.Apply(ctx, []*controllerv1.Resource{testHost("w-0", "r1")}, false)
	require.NoError(t, err)
	_, err = svc.Apply(ctx, []*controllerv1.Resource{testHost("w-0", "r2")}, false)
	require.NoError(t, err)
	require.NoError(t, svc.Delete(ctx, "hosts", "w-0"))
	for i := range got {
		var w0 []seen
		for len(w0) < 3 {
			select {
			case ev := <-got[i]:
				if ev.name == "w-0" {
					w0 = append(w0, ev)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("watcher %d: changes of w-0 %v, want 3", i, w0)
			}
		}
		require.Equal(t, []seen{{"ADDED", "w-0"}, {"MODIFIED", "w-0"}, {"DELETED", "w-0"}}, w0, "watcher %d", i)
	}
	wcancel()
	running.Wait()
	require.Zero(t, cs.watches.Load(), "etcd watches opened for %d API watchers", watchers)
}
