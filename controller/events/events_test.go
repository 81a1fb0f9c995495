package events_test

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/store"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Step(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// newRecorder starts an embedded etcd and returns a recorder on it with
// cfg and a clock at a fixed time.
func newRecorder(t *testing.T, cfg events.Config) (*events.Recorder, *clientv3.Client, *clock) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	e, err := store.StartEmbedded(ctx, store.EmbeddedConfig{DataDir: filepath.Join(t.TempDir(), "etcd")})
	require.NoError(t, err)
	t.Cleanup(e.Close)
	c, err := store.Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	clk := &clock{now: time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)}
	cfg.Clock = clk.Now
	return events.NewWithConfig(c, cfg, slog.New(slog.DiscardHandler)), c, clk
}

// keys counts the stored keys of an object.
func keys(t *testing.T, c *clientv3.Client, kind, name string) int64 {
	t.Helper()
	resp, err := c.Get(context.Background(), events.Prefix+kind+"/"+name+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	return resp.Count
}

func TestAggregate(t *testing.T) {
	rec, c, clk := newRecorder(t, events.Config{})
	ctx := context.Background()
	t0 := clk.Now()
	for range 3 {
		rec.Record(ctx, "hosts", "h1", events.Warning, "StepTimedOut", "PowerOn: no result within 3m")
		clk.Step(time.Minute)
	}
	rec.Record(ctx, "hosts", "h1", events.Warning, "StepTimedOut", "PowerOn: no result within 4m") // another message
	rec.Record(ctx, "hosts", "h2", events.Warning, "StepTimedOut", "PowerOn: no result within 3m") // another object

	evs, err := rec.List(ctx, "hosts", "h1", 0)
	require.NoError(t, err)
	require.Len(t, evs, 2, "h1's events: %v", evs)
	require.Equal(t, "PowerOn: no result within 3m", evs[0].GetMessage())
	if evs[0].GetCount() != 3 || !evs[0].GetTime().AsTime().Equal(t0) || !evs[0].GetLastTime().AsTime().Equal(t0.Add(2*time.Minute)) {
		t.Errorf("aggregated event = count %d, first %s, last %s; want 3, %s, %s", evs[0].GetCount(),
			evs[0].GetTime().AsTime(), evs[0].GetLastTime().AsTime(), t0, t0.Add(2*time.Minute))
	}
	require.Equal(t, int32(1), evs[1].GetCount())
	require.Equal(t, int64(2), keys(t, c, "hosts", "h1"), "stored keys of h1: one per distinct event")
	require.Equal(t, int64(1), keys(t, c, "hosts", "h2"))

	// Past the window since its last occurrence, the same event is new.
	clk.Step(events.DefaultWindow)
	rec.Record(ctx, "hosts", "h1", events.Warning, "StepTimedOut", "PowerOn: no result within 3m")
	evs, err = rec.List(ctx, "hosts", "h1", 0)
	require.NoError(t, err)
	require.Len(t, evs, 3)
	last := evs[2]
	require.Equal(t, int32(1), last.GetCount(), "an event after the window: %v", last)
	require.Equal(t, events.Stats{Written: 4, Aggregated: 2}, rec.Stats())
}

func TestAggregatedEventSortsByLastTime(t *testing.T) {
	rec, _, clk := newRecorder(t, events.Config{})
	ctx := context.Background()
	rec.Record(ctx, "hosts", "h1", events.Normal, "A", "first")
	clk.Step(time.Second)
	rec.Record(ctx, "hosts", "h1", events.Normal, "B", "second")
	clk.Step(time.Second)
	rec.Record(ctx, "hosts", "h1", events.Normal, "A", "first") // A again: now the newest
	evs, err := rec.List(ctx, "hosts", "h1", 1)
	require.NoError(t, err)
	require.Len(t, evs, 1)
	if evs[0].GetReason() != "A" || evs[0].GetCount() != 2 {
		t.Errorf("List(limit 1) = %s x%d, want A x2 (the last to happen)", evs[0].GetReason(), evs[0].GetCount())
	}
}

func TestRateLimit(t *testing.T) {
	rec, c, clk := newRecorder(t, events.Config{Burst: 5, Refill: time.Minute})
	ctx := context.Background()
	for i := range 8 {
		rec.Record(ctx, "hosts", "h1", events.Warning, "Flapping", fmt.Sprintf("flap %d", i))
	}
	rec.Record(ctx, "hosts", "h2", events.Normal, "Other", "another object has its own bucket")
	require.Equal(t, int64(5), keys(t, c, "hosts", "h1"), "the burst")
	require.Equal(t, int64(1), keys(t, c, "hosts", "h2"))
	require.Equal(t, int64(3), rec.Stats().Dropped)

	// One token per Refill: the next event says what was dropped.
	clk.Step(time.Minute)
	rec.Record(ctx, "hosts", "h1", events.Warning, "Flapping", "flap 8")
	rec.Record(ctx, "hosts", "h1", events.Warning, "Flapping", "flap 9") // no token yet
	evs, err := rec.List(ctx, "hosts", "h1", 0)
	require.NoError(t, err)
	require.Len(t, evs, 6)
	if got := evs[5]; got.GetMessage() != "flap 8" || got.GetDropped() != 3 {
		t.Errorf("event after the drops = %q dropped %d, want %q dropped 3", got.GetMessage(), got.GetDropped(), "flap 8")
	}
	clk.Step(time.Minute)
	rec.Record(ctx, "hosts", "h1", events.Warning, "Flapping", "flap 10")
	evs, err = rec.List(ctx, "hosts", "h1", 1)
	require.NoError(t, err)
	require.Equal(t, int32(1), evs[0].GetDropped(), "flap 10 carries the one drop since flap 8")
}

func TestMaxPerObject(t *testing.T) {
	rec, c, _ := newRecorder(t, events.Config{Burst: 1000, MaxPerObject: 10})
	ctx := context.Background()
	for i := range 30 {
		rec.Record(ctx, "hosts", "h1", events.Normal, "Step", fmt.Sprintf("step %02d", i))
		if n := keys(t, c, "hosts", "h1"); n > 10+10/5-1 {
			t.Fatalf("after %d events: %d stored, want at most %d", i+1, n, 10+10/5-1)
		}
	}
	evs, err := rec.List(ctx, "hosts", "h1", 0)
	require.NoError(t, err)
	require.Len(t, evs, 10)
	require.Equal(t, "step 20", evs[0].GetMessage(), "the oldest kept")
	require.Equal(t, "step 29", evs[9].GetMessage(), "the newest")
	require.Equal(t, int64(20), rec.Stats().Trimmed)
}

func TestTTL(t *testing.T) {
	rec, c, clk := newRecorder(t, events.Config{TTL: 30 * time.Minute})
	ctx := context.Background()
	rec.Record(ctx, "hosts", "h1", events.Normal, "Enrolled", "agent enrolled")
	leaseOf := func() clientv3.LeaseID {
		resp, err := c.Get(ctx, events.Prefix+"hosts/h1/", clientv3.WithPrefix())
		require.NoError(t, err)
		require.Len(t, resp.Kvs, 1)
		return clientv3.LeaseID(resp.Kvs[0].Lease)
	}
	first := leaseOf()
	require.NotZero(t, first, "events are put with a lease")
	ttl, err := c.TimeToLive(ctx, first)
	require.NoError(t, err)
	if ttl.TTL < int64((30 * time.Minute).Seconds()) {
		t.Errorf("lease TTL = %ds, want at least the configured 30m", ttl.TTL)
	}
	// An aggregated occurrence two minutes later lives from then: the
	// event moves to the lease of that time.
	clk.Step(2 * time.Minute)
	rec.Record(ctx, "hosts", "h1", events.Normal, "Enrolled", "agent enrolled")
	if second := leaseOf(); second == first {
		t.Errorf("aggregated event kept lease %x of its first occurrence, want a newer one", first)
	}
}

// TestBatchRidesWithAnotherWrite: the events of a batch and another put
// in one transaction are one etcd revision; an abandoned batch gives its
// rate-limit tokens back.
func TestBatchRidesWithAnotherWrite(t *testing.T) {
	rec, c, _ := newRecorder(t, events.Config{Burst: 2})
	ctx := context.Background()
	b, err := rec.Prepare(ctx, "hosts", "h1", []events.Event{
		{Type: events.Normal, Reason: "Provisioning", Message: "provisioning"},
		{Type: events.Normal, Reason: "Available", Message: "host is available"},
	})
	require.NoError(t, err)
	b.Done(ctx, false) // its write lost a compare: nothing stored
	require.Zero(t, keys(t, c, "hosts", "h1"))

	b, err = rec.Prepare(ctx, "hosts", "h1", []events.Event{
		{Type: events.Normal, Reason: "Provisioning", Message: "provisioning"},
		{Type: events.Normal, Reason: "Available", Message: "host is available"},
	})
	require.NoError(t, err)
	require.Len(t, b.Ops(), 2, "both tokens were given back")
	before, err := c.Get(ctx, "/kiln/probe")
	require.NoError(t, err)
	_, err = c.Txn(ctx).Then(append([]clientv3.Op{clientv3.OpPut("/kiln/v1/hosts/h1", "status")}, b.Ops()...)...).Commit()
	require.NoError(t, err)
	b.Done(ctx, true)
	after, err := c.Get(ctx, "/kiln/probe")
	require.NoError(t, err)
	require.Equal(t, before.Header.Revision+1, after.Header.Revision, "a status and two events: one write")
	require.Equal(t, int64(2), keys(t, c, "hosts", "h1"))
}

// TestListAcrossObjectsIsNewestFirst: the newest events of a whole kind
// (or of everything) are those last recorded, whatever their objects'
// names: kilnctl get events lists them.
func TestListAcrossObjectsIsNewestFirst(t *testing.T) {
	rec, _, clk := newRecorder(t, events.Config{})
	ctx := context.Background()
	for _, n := range []string{"h9", "h1", "h5", "h2"} {
		rec.Record(ctx, "hosts", n, events.Normal, "Seen", "host "+n)
		clk.Step(time.Second)
	}
	rec.Record(ctx, "clusters", "a", events.Warning, "Stuck", "cluster a")
	clk.Step(time.Second)
	rec.Record(ctx, "hosts", "h9", events.Normal, "Seen", "host h9") // aggregated: newest again

	names := func(evs []*typesv1.Event) []string {
		var out []string
		for _, e := range evs {
			out = append(out, e.GetObjectKind()+"/"+e.GetObjectName())
		}
		return out
	}
	evs, err := rec.List(ctx, "hosts", "", 2)
	require.NoError(t, err)
	require.Equal(t, []string{"hosts/h2", "hosts/h9"}, names(evs), "the 2 newest host events, oldest first")
	evs, err = rec.List(ctx, "", "", 3)
	require.NoError(t, err)
	require.Equal(t, []string{"hosts/h2", "clusters/a", "hosts/h9"}, names(evs), "the 3 newest events of all kinds")
}

// An event is stored without what its key says (name, object kind and
// name) and without a last time equal to its time; List gives it whole.
// An aggregated event keeps its last time, and an event stored whole
// (before) lists as it was.
func TestStoredEventIsSlim(t *testing.T) {
	r, c, clk := newRecorder(t, events.Config{})
	ctx := context.Background()
	r.Record(ctx, "hosts", "rack1-01", events.Normal, "Registering", "host registered")
	resp, err := c.Get(ctx, events.Prefix+"hosts/rack1-01/", clientv3.WithPrefix())
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1)
	key := string(resp.Kvs[0].Key)
	stored := &typesv1.Event{}
	require.NoError(t, proto.Unmarshal(resp.Kvs[0].Value, stored))
	require.Empty(t, stored.GetName())
	require.Empty(t, stored.GetObjectKind())
	require.Empty(t, stored.GetObjectName())
	require.Nil(t, stored.GetLastTime())
	require.Equal(t, "Registering", stored.GetReason())

	evs, err := r.List(ctx, "hosts", "rack1-01", 0)
	require.NoError(t, err)
	require.Len(t, evs, 1)
	ev := evs[0]
	require.Equal(t, "rack1-01."+key[strings.LastIndex(key, "/")+1:], ev.GetName())
	require.Equal(t, "hosts", ev.GetObjectKind())
	require.Equal(t, "rack1-01", ev.GetObjectName())
	require.Equal(t, clk.Now(), ev.GetTime().AsTime())
	require.Equal(t, clk.Now(), ev.GetLastTime().AsTime())
	require.LessOrEqual(t, len(resp.Kvs[0].Value), proto.Size(ev)-50, "stored %d bytes, whole %d", len(resp.Kvs[0].Value), proto.Size(ev))

	clk.Step(time.Minute)
	r.Record(ctx, "hosts", "rack1-01", events.Normal, "Registering", "host registered")
	evs, err = r.List(ctx, "hosts", "rack1-01", 0)
	require.NoError(t, err)
	require.Len(t, evs, 1, "aggregated")
	require.EqualValues(t, 2, evs[0].GetCount())
	require.Equal(t, clk.Now(), evs[0].GetLastTime().AsTime(), "the last time of an aggregated event is stored")
	require.Equal(t, clk.Now().Add(-time.Minute), evs[0].GetTime().AsTime())

	whole := &typesv1.Event{Name: "old.1", ObjectKind: "hosts", ObjectName: "old", Type: events.Normal, Reason: "Available",
		Time: timestamppb.New(clk.Now()), LastTime: timestamppb.New(clk.Now()), Count: 1}
	b, err := proto.Marshal(whole)
	require.NoError(t, err)
	_, err = c.Put(ctx, events.Prefix+"hosts/old/00000000000000000001-000001", string(b))
	require.NoError(t, err)
	evs, err = r.List(ctx, "hosts", "old", 0)
	require.NoError(t, err)
	require.Len(t, evs, 1)
	require.True(t, proto.Equal(whole, evs[0]), "an event stored whole: %v", evs[0])
}
