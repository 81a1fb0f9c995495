package events_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/encoding/protodelim"
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
	require.Equal(t, int64(1), keys(t, c, "hosts", "h1"), "stored keys of h1: its log")
	require.Equal(t, int64(1), keys(t, c, "hosts", "h2"))

	// Past the window since its last occurrence, the same event is new.
	clk.Step(events.DefaultWindow)
	rec.Record(ctx, "hosts", "h1", events.Warning, "StepTimedOut", "PowerOn: no result within 3m")
	evs, err = rec.List(ctx, "hosts", "h1", 0)
	require.NoError(t, err)
	require.Len(t, evs, 3)
	last := evs[2]
	require.Equal(t, int32(1), last.GetCount(), "an event after the window: %v", last)
	require.Equal(t, events.Stats{Written: 4, Aggregated: 2, Logged: 6}, rec.Stats())
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
	rec, _, clk := newRecorder(t, events.Config{Burst: 5, Refill: time.Minute})
	ctx := context.Background()
	for i := range 8 {
		rec.Record(ctx, "hosts", "h1", events.Warning, "Flapping", fmt.Sprintf("flap %d", i))
	}
	rec.Record(ctx, "hosts", "h2", events.Normal, "Other", "another object has its own bucket")
	require.Len(t, list(t, rec, "hosts", "h1"), 5, "the burst")
	require.Len(t, list(t, rec, "hosts", "h2"), 1)
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
	rec, c, clk := newRecorder(t, events.Config{Burst: 1000, MaxPerObject: 10})
	ctx := context.Background()
	for i := range 30 {
		rec.Record(ctx, "hosts", "h1", events.Normal, "Step", fmt.Sprintf("step %02d", i))
		if n := len(list(t, rec, "hosts", "h1")); n > 10 {
			t.Fatalf("after %d events: %d stored, want at most 10", i+1, n)
		}
	}
	evs := list(t, rec, "hosts", "h1")
	require.Len(t, evs, 10)
	require.Equal(t, "step 20", evs[0].GetMessage(), "the oldest kept")
	require.Equal(t, "step 29", evs[9].GetMessage(), "the newest")
	require.Equal(t, int64(1), keys(t, c, "hosts", "h1"), "one log")

	require.Zero(t, rec.Stats().Trimmed, "a log is cut, not trimmed")

	// h3 has a log this recorder never held (another controller's, or
	// its own before a restart): it reads the log and adds to it.
	var reads []string
	read := func(ctx context.Context, key string) (*mvccpb.KeyValue, error) {
		reads = append(reads, key)
		resp, err := c.Get(ctx, key)
		if err != nil || len(resp.Kvs) == 0 {
			return nil, err
		}
		return resp.Kvs[0], nil
	}
	other := events.NewWithConfig(c, events.Config{Burst: 1000, MaxPerObject: 10, Clock: clk.Now, Read: read}, slog.New(slog.DiscardHandler))
	rec.Record(ctx, "hosts", "h3", events.Normal, "Step", "before")
	for i := range 5 {
		clk.Step(time.Second)
		other.Record(ctx, "hosts", "h3", events.Normal, "Step", fmt.Sprintf("step %02d", i))
	}
	evs = list(t, other, "hosts", "h3")
	require.Equal(t, []string{"before", "step 00", "step 01", "step 02", "step 03", "step 04"}, messages(evs))
	require.Equal(t, int64(1), keys(t, c, "hosts", "h3"), "one log")
	require.Equal(t, events.Stats{Written: 5, Logged: 5}, other.Stats())
	require.Equal(t, []string{events.LogKey("hosts", "h3")}, reads, "read once (Config.Read), then held")
}

// TestLogOfDottedName: an object whose name has dots keeps its events'
// names and ids through its log.
func TestLogOfDottedName(t *testing.T) {
	rec, _, clk := newRecorder(t, events.Config{})
	ctx := context.Background()
	rec.Record(ctx, "hosts", "rack1.h3.example", events.Normal, "Enrolled", "agent enrolled")
	clk.Step(time.Second)
	rec.Record(ctx, "hosts", "rack1.h3.example", events.Normal, "Available", "host is available")
	evs := list(t, rec, "hosts", "rack1.h3.example")
	require.Equal(t, []string{"agent enrolled", "host is available"}, messages(evs))
	for _, ev := range evs {
		require.Regexp(t, `^rack1\.h3\.example\.[0-9]{20}-[0-9]{6}$`, ev.GetName())
		require.Equal(t, "rack1.h3.example", ev.GetObjectName())
	}
	require.NotEqual(t, evs[0].GetName(), evs[1].GetName())
}

// TestTwoRecordersOneObject: two controllers record events of one object
// by turns; each finds the log changed by the other now and then and
// stores those events a key each. No recent event is lost, and the keys
// stay bounded.
func TestTwoRecordersOneObject(t *testing.T) {
	a, c, clk := newRecorder(t, events.Config{Burst: 1000, MaxPerObject: 10})
	b := events.NewWithConfig(c, events.Config{Burst: 1000, MaxPerObject: 10, Clock: clk.Now}, slog.New(slog.DiscardHandler))
	ctx := context.Background()
	var want []string
	for i := range 60 {
		rec := a
		if i%2 == 1 {
			rec = b
		}
		msg := fmt.Sprintf("event %02d", i)
		rec.Record(ctx, "hosts", "h1", events.Normal, "Step", msg)
		want = append(want, msg)
		clk.Step(time.Second)
		require.LessOrEqual(t, keys(t, c, "hosts", "h1"), int64(1+10+10/5-1), "after %d events", i+1)
		got := messages(list(t, a, "hosts", "h1"))
		for _, m := range want[max(len(want)-5, 0):] {
			require.Contains(t, got, m, "after %d events", i+1)
		}
	}
	sa, sb := a.Stats(), b.Stats()
	require.Equal(t, int64(60), sa.Written+sb.Written)
	require.Positive(t, sa.Logged+sb.Logged, "most go to the log")
	require.Less(t, sa.Logged+sb.Logged, int64(60), "some find the log changed")
	require.Positive(t, sa.Trimmed+sb.Trimmed, "events stored alone are trimmed")
}

func messages(evs []*typesv1.Event) []string {
	var out []string
	for _, e := range evs {
		out = append(out, e.GetMessage())
	}
	return out
}

// list is rec.List of every event of kind/name.
func list(t *testing.T, rec *events.Recorder, kind, name string) []*typesv1.Event {
	t.Helper()
	evs, err := rec.List(context.Background(), kind, name, 0)
	require.NoError(t, err)
	return evs
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
	b.Done(ctx, 0, nil) // its write lost a compare: nothing stored
	require.Zero(t, keys(t, c, "hosts", "h1"))

	b, err = rec.Prepare(ctx, "hosts", "h1", []events.Event{
		{Type: events.Normal, Reason: "Provisioning", Message: "provisioning"},
		{Type: events.Normal, Reason: "Available", Message: "host is available"},
	})
	require.NoError(t, err)
	before, err := c.Get(ctx, "/kiln/probe")
	require.NoError(t, err)
	resp, err := c.Txn(ctx).Then(append([]clientv3.Op{clientv3.OpPut("/kiln/v1/hosts/h1", "status")}, b.Ops()...)...).Commit()
	require.NoError(t, err)
	b.Done(ctx, resp.Header.Revision, resp.Responses[1:])
	after, err := c.Get(ctx, "/kiln/probe")
	require.NoError(t, err)
	require.Equal(t, before.Header.Revision+1, after.Header.Revision, "a status and two events: one write")
	require.Equal(t, int64(1), keys(t, c, "hosts", "h1"), "the object's log")
	require.Equal(t, []string{"provisioning", "host is available"}, messages(list(t, rec, "hosts", "h1")), "both tokens were given back")
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

// An event is stored in its object's log without what the log's key
// says (object kind and name, and the name's object part) and without a
// last time equal to its time; List gives it whole. An aggregated event
// keeps its last time, and events stored a key each, slim or whole
// (before), list as they were.
func TestStoredEventIsSlim(t *testing.T) {
	r, c, clk := newRecorder(t, events.Config{})
	ctx := context.Background()
	r.Record(ctx, "hosts", "rack1-01", events.Normal, "Registering", "host registered")
	resp, err := c.Get(ctx, events.Prefix+"hosts/rack1-01/", clientv3.WithPrefix())
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1)
	require.Equal(t, events.LogKey("hosts", "rack1-01"), string(resp.Kvs[0].Key))
	stored := &typesv1.Event{}
	require.NoError(t, protodelim.UnmarshalFrom(bytes.NewReader(resp.Kvs[0].Value), stored))
	id := stored.GetName()
	require.Regexp(t, `^[0-9]{20}-[0-9]{6}$`, id, "the name keeps its id only")
	require.Empty(t, stored.GetObjectKind())
	require.Empty(t, stored.GetObjectName())
	require.Nil(t, stored.GetLastTime())
	require.Equal(t, "Registering", stored.GetReason())

	evs, err := r.List(ctx, "hosts", "rack1-01", 0)
	require.NoError(t, err)
	require.Len(t, evs, 1)
	ev := evs[0]
	require.Equal(t, "rack1-01."+id, ev.GetName())
	require.Equal(t, "hosts", ev.GetObjectKind())
	require.Equal(t, "rack1-01", ev.GetObjectName())
	require.Equal(t, clk.Now(), ev.GetTime().AsTime())
	require.Equal(t, clk.Now(), ev.GetLastTime().AsTime())
	require.LessOrEqual(t, len(resp.Kvs[0].Value), proto.Size(ev)-25, "stored %d bytes, whole %d", len(resp.Kvs[0].Value), proto.Size(ev))

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

	slim := &typesv1.Event{Type: events.Normal, Reason: "Enrolled", Time: timestamppb.New(clk.Now()), Count: 1}
	b, err = proto.Marshal(slim)
	require.NoError(t, err)
	_, err = c.Put(ctx, events.Prefix+"hosts/old/00000000000000000002-000002", string(b))
	require.NoError(t, err)
	evs, err = r.List(ctx, "hosts", "old", 0)
	require.NoError(t, err)
	require.Len(t, evs, 2)
	require.Equal(t, "old.00000000000000000002-000002", evs[1].GetName(), "a slim event stored alone")
	require.Equal(t, "old", evs[1].GetObjectName())
}
