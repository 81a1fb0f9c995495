// Package events records what happened to resources ("Host rack1-01:
// Enrolled") in etcd with a time-to-live, and lists them by object. Events
// are for people reading `kilnctl describe`; nothing decides on them.
package events

import (
	"context"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Prefix is where events live: Prefix + "<kind>/<name>/<time>".
const Prefix = "/kiln/v1/events/"

// DefaultTTL is how long an event is kept.
const DefaultTTL = time.Hour

// Event types.
const (
	Normal  = "Normal"
	Warning = "Warning"
)

// Recorder writes and lists events. Events written within one minute share
// an etcd lease, so a burst of events costs one lease.
type Recorder struct {
	client *clientv3.Client
	ttl    time.Duration
	clock  func() time.Time
	log    *slog.Logger

	mu        sync.Mutex
	lease     clientv3.LeaseID
	leaseFrom time.Time
	seq       uint64
}

// New returns a Recorder writing through client. Events live for ttl
// (DefaultTTL when 0).
func New(client *clientv3.Client, ttl time.Duration, clock func() time.Time, log *slog.Logger) *Recorder {
	if ttl <= 0 {
		ttl = DefaultTTL
	}
	if clock == nil {
		clock = time.Now
	}
	return &Recorder{client: client, ttl: ttl, clock: clock, log: log.With("component", "events")}
}

// leaseWindow is how long one lease is reused for new events.
const leaseWindow = time.Minute

func (r *Recorder) leaseFor(ctx context.Context, now time.Time) (clientv3.LeaseID, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.lease != 0 && now.Sub(r.leaseFrom) < leaseWindow && now.Sub(r.leaseFrom) >= 0 {
		return r.lease, nil
	}
	// The lease outlives the window so the last event of it still lives
	// for ttl.
	resp, err := r.client.Grant(ctx, int64((r.ttl+leaseWindow)/time.Second))
	if err != nil {
		return 0, errdefs.Unavailable("event lease: %w", err)
	}
	r.lease, r.leaseFrom = resp.ID, now
	return r.lease, nil
}

// Record stores an event about the object kind/name ("hosts", "rack1-01").
// Failure to record is logged, not returned: an event is never worth
// failing the operation it describes.
func (r *Recorder) Record(ctx context.Context, kind, name, typ, reason, message string) {
	if err := r.record(ctx, kind, name, typ, reason, message); err != nil {
		r.log.Warn("event not recorded", "kind", kind, "name", name, "reason", reason, "err", err)
	}
}

func (r *Recorder) record(ctx context.Context, kind, name, typ, reason, message string) error {
	now := r.clock()
	lease, err := r.leaseFor(ctx, now)
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.seq++
	seq := r.seq
	r.mu.Unlock()
	// Keys sort by time: a fixed-width nanosecond stamp and a sequence
	// number to keep events of one nanosecond apart.
	id := fmt.Sprintf("%020d-%06d", now.UnixNano(), seq%1000000)
	ev := &typesv1.Event{
		Name:       name + "." + id,
		Time:       timestamppb.New(now),
		ObjectKind: kind,
		ObjectName: name,
		Type:       typ,
		Reason:     reason,
		Message:    message,
	}
	b, err := proto.Marshal(ev)
	if err != nil {
		return err
	}
	if _, err := r.client.Put(ctx, Prefix+kind+"/"+name+"/"+id, string(b), clientv3.WithLease(lease)); err != nil {
		// The lease may have been revoked or expired behind our back: drop
		// it so the next event takes a new one.
		r.mu.Lock()
		r.lease = 0
		r.mu.Unlock()
		return errdefs.Unavailable("put event: %w", err)
	}
	return nil
}

// List returns the events of kind/name, oldest first, at most limit of the
// newest (all when limit <= 0). An empty name lists every object of kind;
// an empty kind lists everything.
func (r *Recorder) List(ctx context.Context, kind, name string, limit int64) ([]*typesv1.Event, error) {
	prefix := Prefix
	if kind != "" {
		prefix += kind + "/"
		if name != "" {
			prefix += name + "/"
		}
	}
	opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortDescend)}
	if limit > 0 {
		opts = append(opts, clientv3.WithLimit(limit))
	}
	resp, err := r.client.Get(ctx, prefix, opts...)
	if err != nil {
		return nil, errdefs.Unavailable("list events: %w", err)
	}
	out := make([]*typesv1.Event, len(resp.Kvs))
	for i, kv := range resp.Kvs {
		ev := &typesv1.Event{}
		if err := proto.Unmarshal(kv.Value, ev); err != nil {
			return nil, fmt.Errorf("event %s: decode: %w", kv.Key, err)
		}
		out[len(out)-1-i] = ev
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].GetTime().AsTime().Before(out[j].GetTime().AsTime()) })
	return out, nil
}
