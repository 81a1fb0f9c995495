package clusterexec_test

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/cacheindex"
	"github.com/kilnhq/kiln/controller/clusterexec"
	"github.com/kilnhq/kiln/controller/store"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// heldHosts is a host cache whose watch is held back: it shows the hosts
// as they were when it last caught up (catchUp) and does not move by
// itself. WaitRevision of a revision it has not reached reports that
// revision on waits and blocks until the test lets it catch up: the
// wait a real store.Cache does until its watch delivers the change.
type heldHosts struct {
	st      *store.Store
	waits   chan int64
	mu      sync.Mutex
	items   []store.Item
	rev     int64
	movedCh chan struct{}
}

func newHeldHosts(st *store.Store) *heldHosts {
	return &heldHosts{st: st, waits: make(chan int64, 16), movedCh: make(chan struct{})}
}

func (h *heldHosts) catchUp(t *testing.T, ctx context.Context) {
	t.Helper()
	items, rev, err := h.st.ListAllAt(ctx, clusterexec.HostsKind, func() proto.Message { return &typesv1.Host{} })
	require.NoError(t, err)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.items, h.rev = items, rev
	close(h.movedCh)
	h.movedCh = make(chan struct{})
}

func (h *heldHosts) List(context.Context) ([]store.Item, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.items, nil
}

// RangeIndex serves the State index from what the cache shows.
func (h *heldHosts) RangeIndex(name, value string, fn func(store.Item) bool) {
	if name != cacheindex.State {
		return
	}
	h.mu.Lock()
	items := h.items
	h.mu.Unlock()
	for _, it := range items {
		if it.Msg.(*typesv1.Host).GetStatus().GetState().String() == value && !fn(it) {
			return
		}
	}
}

func (h *heldHosts) WaitRevision(ctx context.Context, rev int64) error {
	reported := false
	for {
		h.mu.Lock()
		cur, moved := h.rev, h.movedCh
		h.mu.Unlock()
		if cur >= rev {
			return nil
		}
		if !reported {
			h.waits <- rev
			reported = true
		}
		select {
		case <-moved:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// TestReconcileSeesItsOwnHostWrites: with the host cache behind, a
// reconcile waits for the executor's own last host write before it plans.
// A control-plane machine is created and bound on the only host h1; the
// machine is deleted through the API, the clean-up releases h1 (unbinds
// it); the cache still shows h1 bound. The next reconcile must wait for
// the cache to hold the release and put a new machine on h1, not plan
// with h1 bound to a machine that is gone ("waiting for a host").
func TestReconcileSeesItsOwnHostWrites(t *testing.T) {
	w := newWorld(t, 0)
	w.apply(0, 1, 0)
	w.create("hosts", "h1", &typesv1.Host{
		Metadata: &typesv1.ObjectMeta{Name: "h1", Generation: 1, CreationTimestamp: timestamppb.Now()},
		Spec:     &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "redfish", Address: "sim://h1"}, RootDiskHint: "/dev/sda", Online: true},
		Status:   &typesv1.HostStatus{State: typesv1.HostState_HOST_STATE_AVAILABLE},
	})
	hosts := newHeldHosts(w.st)
	hosts.catchUp(t, w.ctx)
	ex := clusterexec.New(clusterexec.Deps{Store: w.st, Recorder: w.rec, Agents: clusterexec.AgentDialer(w.kubeadm.AgentDialer()), Hosts: hosts},
		clusterexec.Config{Interval: time.Hour}, slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug})))

	// reconcile runs one reconcile of c1, letting the cache catch up
	// when (and only when) the executor waits for it; it returns the
	// revisions waited for.
	reconcile := func() []int64 {
		t.Helper()
		done := make(chan error, 1)
		go func() { done <- ex.Reconcile(w.ctx, "c1") }()
		var waited []int64
		for {
			select {
			case rev := <-hosts.waits:
				waited = append(waited, rev)
				hosts.catchUp(t, w.ctx)
			case err := <-done:
				require.NoError(t, err)
				return waited
			case <-time.After(time.Minute):
				t.Fatal("reconcile hung")
			}
		}
	}
	hostOf := func() *typesv1.Host {
		h := &typesv1.Host{}
		_, err := w.st.Get(w.ctx, "hosts", "h1", h)
		require.NoError(t, err)
		return h
	}

	require.Empty(t, reconcile(), "nothing written yet: nothing to wait for")
	ms := w.machines()
	require.Len(t, ms, 1)
	m1 := ms[0].GetMetadata().GetName()
	require.Equal(t, "h1", ms[0].GetSpec().GetHost())
	require.Equal(t, m1, hostOf().GetStatus().GetMachine(), "h1 bound")
	hosts.catchUp(t, w.ctx) // the cache shows h1 bound to m1

	require.NoError(t, w.st.Delete(w.ctx, "machines", m1, 0)) // through the API
	require.NoError(t, ex.Collect(w.ctx))
	unbound := &typesv1.Host{}
	unbindRev, err := w.st.Get(w.ctx, "hosts", "h1", unbound)
	require.NoError(t, err)
	require.Empty(t, unbound.GetStatus().GetMachine(), "the clean-up released h1")
	items, _ := hosts.List(w.ctx)
	require.Equal(t, m1, items[0].Msg.(*typesv1.Host).GetStatus().GetMachine(), "the cache is behind: h1 still bound there")

	waited := reconcile()
	require.NotEmpty(t, waited, "the reconcile planned with the cache behind its own unbind (revision %d)", unbindRev)
	require.GreaterOrEqual(t, waited[0], unbindRev, "waited for the release")
	ms = w.machines()
	require.Len(t, ms, 1, "a new machine for the control plane")
	require.Equal(t, "h1", ms[0].GetSpec().GetHost())
	require.Equal(t, ms[0].GetMetadata().GetName(), hostOf().GetStatus().GetMachine(), "h1 bound to the new machine")
}
