// Package events records what happened to resources ("Host rack1-01:
// Enrolled") in etcd with a time-to-live, and lists them by object. Events
// are for people reading `kilnctl describe`; nothing decides on them.
//
// Like Kubernetes' EventCorrelator, a Recorder spends few writes on them:
// an event like a recent one of the same object (same type, reason and
// message within Config.Window) updates that one's count and last time
// instead of adding a key; a token bucket per object (Config.Burst, then
// one per Config.Refill) drops the excess and counts it in the next event
// of the object that is recorded; every event lives Config.TTL after its
// last occurrence (an etcd lease), and an object keeps at most about
// Config.MaxPerObject of them. Events may also ride in another write's
// transaction (Prepare): the host lifecycle stores a step's events with
// the status that records it.
package events

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"golang.org/x/time/rate"
	"google.golang.org/protobuf/encoding/protodelim"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/utils/lru"

	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Prefix is where events live: Prefix + "<kind>/<name>/<time>".
const Prefix = "/kiln/v1/events/"

// Defaults of Config: those of Kubernetes' EventCorrelator (a 10-minute
// aggregation window, a burst of 25 per object then one every 5 minutes,
// 4096 cached entries), an hour to live as before, and a cap per object.
const (
	DefaultTTL          = time.Hour
	DefaultWindow       = 10 * time.Minute
	DefaultBurst        = 25
	DefaultRefill       = 5 * time.Minute
	DefaultMaxPerObject = 50
	DefaultCacheSize    = 4096
	// DefaultLogCacheSize is more than a provisioning wave's hosts in
	// flight (--provision-max-in-flight, 2,000 by default): a log the
	// recorder lost is read again. Logs are kept encoded, about 500
	// bytes for a host's way to Provisioned.
	DefaultLogCacheSize = 16384
)

// Event types.
const (
	Normal  = "Normal"
	Warning = "Warning"
)

// Config tunes a Recorder. Zero fields take the defaults.
type Config struct {
	// TTL is how long an event is kept after its last occurrence.
	TTL time.Duration
	// Window is how recent an alike event must be for a new one to be
	// aggregated into it.
	Window time.Duration
	// Burst and Refill are the token bucket of each object: Burst events
	// at once, then one per Refill; the excess is dropped and counted.
	Burst  int
	Refill time.Duration
	// MaxPerObject bounds the events kept of one object: every
	// MaxPerObject/5 new events of an object, the oldest beyond
	// MaxPerObject are deleted.
	MaxPerObject int
	// CacheSize bounds the objects and the distinct events the recorder
	// remembers (least recently used go first; a forgotten event is
	// written as new, a forgotten object gets a full bucket).
	CacheSize int
	// LogCacheSize bounds the objects' logs the recorder keeps (least
	// recently used go first; a forgotten log is read again).
	LogCacheSize int
	// Clock is the time source (time.Now).
	Clock func() time.Time
	// Read reads an object's log that the recorder does not hold
	// (store.Store.GetKey: grouped with other reads); nil: a Get of its
	// own, serializable.
	Read func(ctx context.Context, key string) (*mvccpb.KeyValue, error)
}

func (c Config) withDefaults() Config {
	if c.TTL <= 0 {
		c.TTL = DefaultTTL
	}
	if c.Window <= 0 {
		c.Window = DefaultWindow
	}
	if c.Burst <= 0 {
		c.Burst = DefaultBurst
	}
	if c.Refill <= 0 {
		c.Refill = DefaultRefill
	}
	if c.MaxPerObject <= 0 {
		c.MaxPerObject = DefaultMaxPerObject
	}
	if c.CacheSize <= 0 {
		c.CacheSize = DefaultCacheSize
	}
	if c.LogCacheSize <= 0 {
		c.LogCacheSize = DefaultLogCacheSize
	}
	if c.Clock == nil {
		c.Clock = time.Now
	}
	return c
}

// Recorder writes and lists events. Events written within one minute share
// an etcd lease, so a burst of events costs one lease.
type Recorder struct {
	client *clientv3.Client
	cfg    Config
	log    *slog.Logger

	mu        sync.Mutex
	lease     clientv3.LeaseID
	leaseFrom time.Time
	seq       uint64
	similar   *lru.Cache // eventKey -> *seen (events stored a key each)
	objects   *lru.Cache // kind/name -> *object
	logs      *lru.Cache // kind/name -> *keptLog
	stats     Stats
}

// keptLog is an object's event log as this recorder last stored it:
// encoded (marshalLog), and the log key's mod revision then.
type keptLog struct {
	val []byte
	at  int64
}

// seen is the last stored occurrence of an event.
type seen struct {
	key string
	ev  *typesv1.Event
}

// object is the rate limit and trim state of one object.
type object struct {
	limiter *rate.Limiter
	dropped int32
	added   int // new keys since the last trim check
}

// Stats counts what a Recorder did with the events it was given.
type Stats struct {
	// Written are new events, Aggregated events folded into an alike
	// one, Dropped events refused by the rate limit, Trimmed events
	// stored a key each deleted by the per-object cap. Logged are the
	// written and aggregated ones stored in their object's log rather
	// than a key each.
	Written, Aggregated, Dropped, Trimmed, Logged int64
}

// New returns a Recorder writing through client with the default Config
// but ttl and clock (DefaultTTL and time.Now when zero).
func New(client *clientv3.Client, ttl time.Duration, clock func() time.Time, log *slog.Logger) *Recorder {
	return NewWithConfig(client, Config{TTL: ttl, Clock: clock}, log)
}

// NewWithConfig returns a Recorder writing through client.
func NewWithConfig(client *clientv3.Client, cfg Config, log *slog.Logger) *Recorder {
	cfg = cfg.withDefaults()
	return &Recorder{
		client: client, cfg: cfg, log: log.With("component", "events"),
		similar: lru.New(cfg.CacheSize), objects: lru.New(cfg.CacheSize), logs: lru.New(cfg.LogCacheSize),
	}
}

// Stats returns the counts so far.
func (r *Recorder) Stats() Stats {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stats
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
	resp, err := r.client.Grant(ctx, int64((r.cfg.TTL+leaseWindow)/time.Second))
	if err != nil {
		return 0, errdefs.Unavailable("event lease: %w", err)
	}
	r.lease, r.leaseFrom = resp.ID, now
	return r.lease, nil
}

// Event is one event to record about an object.
type Event struct {
	// Type is Normal or Warning.
	Type, Reason, Message string
}

// Record stores an event about the object kind/name ("hosts", "rack1-01").
// Failure to record is logged, not returned: an event is never worth
// failing the operation it describes.
func (r *Recorder) Record(ctx context.Context, kind, name, typ, reason, message string) {
	if err := r.record(ctx, kind, name, Event{Type: typ, Reason: reason, Message: message}); err != nil {
		r.log.Warn("event not recorded", "kind", kind, "name", name, "reason", reason, "err", err)
	}
}

func (r *Recorder) record(ctx context.Context, kind, name string, ev Event) error {
	b, err := r.Prepare(ctx, kind, name, []Event{ev})
	if err != nil {
		return err
	}
	if len(b.Ops()) == 0 {
		b.Done(ctx, 0, nil)
		return nil
	}
	resp, err := r.client.Txn(ctx).Then(b.Ops()...).Commit()
	if err != nil {
		b.Done(ctx, 0, nil)
		return errdefs.Unavailable("put event: %w", err)
	}
	b.Done(ctx, resp.Header.Revision, resp.Responses)
	return nil
}

// Batch is events prepared to be stored in one etcd transaction, alone
// or with another write (Ops). Done must be called once, with the
// transaction's outcome.
type Batch struct {
	r        *Recorder
	now      time.Time
	obj      *object
	objKey   string
	ops      []clientv3.Op
	dropped  int32 // events the limit refused in this batch
	resv     []*rate.Reservation
	prefix   string
	carried  bool  // the first stored event carries the object's drops
	consumed int32 // how many (obj.dropped when prepared)

	// The log branch: the object's log with the events (log), and how
	// many of them are new or folded into an alike one.
	log             []*typesv1.Event
	logVal          []byte // log, encoded
	logNew, logAggr int

	// The key-per-event branch: the events as stored, by their
	// similarity key.
	stored  []seen
	keys    []string // similarity keys of stored
	newKeys int
	aggr    int
}

// Ops are the etcd operations that store the batch (none when every event
// was dropped): one transaction, whose answer Done reads.
func (b *Batch) Ops() []clientv3.Op { return b.ops }

// LogKey is the key of the event log of object kind/name: it sorts after
// the keys of the object's events stored a key each (ids are digits).
func LogKey(kind, name string) string { return Prefix + kind + "/" + name + "/" + logSuffix }

const logSuffix = "log"

// Prepare decides how the events of object kind/name are stored, and
// returns the operations: one etcd transaction that rewrites the object's
// event log (one key: its events, oldest first, at most MaxPerObject) with
// the new events, if the log is still as this recorder last stored or
// read it (a recorder that does not hold it reads it first); else
// (another writer changed it meanwhile) it stores each event under a key
// of its own, as a log-less recorder would: a put of a new event, or the
// delete of an alike recent one and the put of it with its count and last
// time updated (under a new key of now, so keys keep sorting by last
// time). Either way nothing is lost, and the next batch of the object
// reads its log again. Events over the object's rate limit are dropped.
// It returns Unavailable when no lease can be had or the log cannot be
// read.
func (r *Recorder) Prepare(ctx context.Context, kind, name string, evs []Event) (*Batch, error) {
	now := r.cfg.Clock()
	b := &Batch{r: r, now: now, objKey: kind + "/" + name, prefix: Prefix + kind + "/" + name + "/"}
	if len(evs) == 0 {
		return b, nil
	}
	lease, err := r.leaseFor(ctx, now)
	if err != nil {
		return nil, err
	}
	logKey := LogKey(kind, name)
	held, at, err := r.heldLog(ctx, b.objKey, kind, name, logKey)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	b.obj = r.object(b.objKey)
	b.log = held
	var fallback []clientv3.Op
	batchSeen := map[string]int{} // alike events within this batch
	for _, e := range evs {
		res := b.obj.limiter.ReserveN(now, 1)
		if !res.OK() || res.DelayFrom(now) > 0 {
			res.CancelAt(now)
			b.dropped++
			continue
		}
		b.resv = append(b.resv, res)
		r.seq++
		// Ids sort by time: a fixed-width nanosecond stamp and a sequence
		// number to keep events of one nanosecond apart.
		id := fmt.Sprintf("%020d-%06d", now.UnixNano(), r.seq%1000000)
		// The first event stored carries the drops since the object's last
		// recorded event.
		var drops int32
		if !b.carried {
			b.carried, b.consumed = true, b.obj.dropped
			drops = b.consumed
		}
		b.addToLog(kind, name, id, e, drops)

		sk := similarKey(kind, name, e)
		var prev *seen
		if i, ok := batchSeen[sk]; ok {
			prev = &b.stored[i]
		} else if v, ok := r.similar.Get(sk); ok {
			if s := v.(*seen); now.Sub(s.ev.GetLastTime().AsTime()) < r.cfg.Window {
				prev = s
			}
		}
		key := b.prefix + id
		var ev *typesv1.Event
		if prev != nil {
			ev = proto.Clone(prev.ev).(*typesv1.Event)
			ev.Name = name + "." + id
			ev.Count = max(ev.GetCount(), 1) + 1
			ev.LastTime = timestamppb.New(now)
			fallback = append(fallback, clientv3.OpDelete(prev.key))
			b.aggr++
		} else {
			ev = newEvent(kind, name, id, e, now)
			b.newKeys++
		}
		ev.Dropped = drops
		val, err := marshalStored(ev)
		if err != nil {
			return nil, err
		}
		fallback = append(fallback, clientv3.OpPut(key, string(val), clientv3.WithLease(lease)))
		if i, ok := batchSeen[sk]; ok {
			b.stored[i] = seen{key: key, ev: ev}
		} else {
			batchSeen[sk] = len(b.stored)
			b.stored = append(b.stored, seen{key: key, ev: ev})
			b.keys = append(b.keys, sk)
		}
	}
	if len(b.stored) == 0 {
		return b, nil
	}
	if over := len(b.log) - r.cfg.MaxPerObject; over > 0 {
		b.log = slices.Delete(b.log, 0, over)
	}
	val, err := marshalLog(b.log)
	if err != nil {
		return nil, err
	}
	b.logVal = val
	// A missing key's mod revision compares as 0.
	b.ops = []clientv3.Op{clientv3.OpTxn(
		[]clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(logKey), "=", at)},
		[]clientv3.Op{clientv3.OpPut(logKey, string(val), clientv3.WithLease(lease))},
		fallback)}
	return b, nil
}

// heldLog returns the object's log, decoded (oldest first), and the log
// key's mod revision (0: no log): as this recorder last stored it, else as
// etcd has it (Config.Read). A stale read (a serializable one, from the
// local member) is caught by the batch's compare, and its events then go
// a key each.
func (r *Recorder) heldLog(ctx context.Context, objKey, kind, name, logKey string) ([]*typesv1.Event, int64, error) {
	r.mu.Lock()
	v, ok := r.logs.Get(objKey)
	r.mu.Unlock()
	if ok {
		k := v.(*keptLog)
		if evs, err := unmarshalLog(kind, name, k.val); err == nil {
			return evs, k.at, nil
		}
	}
	kv, err := r.readLog(ctx, logKey)
	if err != nil {
		return nil, 0, errdefs.Unavailable("read event log: %w", err)
	}
	if kv == nil {
		return nil, 0, nil
	}
	evs, err := unmarshalLog(kind, name, kv.Value)
	if err != nil {
		// The log is rewritten without what cannot be read.
		r.log.Warn("event log unreadable: rewritten", "object", objKey, "err", err)
	}
	return evs, kv.ModRevision, nil
}

func (r *Recorder) readLog(ctx context.Context, key string) (*mvccpb.KeyValue, error) {
	if r.cfg.Read != nil {
		return r.cfg.Read(ctx, key)
	}
	resp, err := r.client.Get(ctx, key, clientv3.WithSerializable())
	if err != nil || len(resp.Kvs) == 0 {
		return nil, err
	}
	return resp.Kvs[0], nil
}

// object returns the rate limit and trim state of objKey. Call with mu
// held.
func (r *Recorder) object(objKey string) *object {
	if o, ok := r.objects.Get(objKey); ok {
		return o.(*object)
	}
	o := &object{limiter: rate.NewLimiter(rate.Every(r.cfg.Refill), r.cfg.Burst)}
	r.objects.Add(objKey, o)
	return o
}

func newEvent(kind, name, id string, e Event, now time.Time) *typesv1.Event {
	return &typesv1.Event{
		Name:       name + "." + id,
		Time:       timestamppb.New(now),
		LastTime:   timestamppb.New(now),
		Count:      1,
		ObjectKind: kind,
		ObjectName: name,
		Type:       e.Type,
		Reason:     e.Reason,
		Message:    e.Message,
	}
}

// addToLog adds e to b.log: folded into the newest alike event of the
// log within the window (its count and last time updated, moved to the
// end), else new.
func (b *Batch) addToLog(kind, name, id string, e Event, drops int32) {
	var ev *typesv1.Event
	for i := len(b.log) - 1; i >= 0; i-- {
		p := b.log[i]
		if p.GetType() == e.Type && p.GetReason() == e.Reason && p.GetMessage() == e.Message &&
			b.now.Sub(LastTime(p)) < b.r.cfg.Window {
			ev = proto.CloneOf(p)
			ev.Name = name + "." + id
			ev.Count = max(ev.GetCount(), 1) + 1
			ev.LastTime = timestamppb.New(b.now)
			b.log = slices.Delete(b.log, i, i+1)
			b.logAggr++
			break
		}
	}
	if ev == nil {
		ev = newEvent(kind, name, id, e, b.now)
		b.logNew++
	}
	ev.Dropped = drops
	b.log = append(b.log, ev)
}

// marshalStored encodes ev as it is stored: without what its key already
// says (its name, object kind and object name) and without a last time
// equal to its time; List fills them in again (fromStored). A lifecycle
// event's value is 79 bytes smaller, a third to a half of it, and a
// 100,000-host wave stores 700,000.
func marshalStored(ev *typesv1.Event) ([]byte, error) {
	name, kind, obj, last := ev.Name, ev.ObjectKind, ev.ObjectName, ev.LastTime
	defer func() { ev.Name, ev.ObjectKind, ev.ObjectName, ev.LastTime = name, kind, obj, last }()
	ev.Name, ev.ObjectKind, ev.ObjectName = "", "", ""
	if proto.Equal(ev.LastTime, ev.Time) {
		ev.LastTime = nil
	}
	return proto.Marshal(ev)
}

// fromStored fills in what marshalStored left out of the event stored at
// key (Prefix + "<kind>/<name>/<id>"). Events stored whole (before it)
// keep what they say.
func fromStored(key string, ev *typesv1.Event) {
	rest, ok := strings.CutPrefix(key, Prefix)
	kind, rest, ok2 := strings.Cut(rest, "/")
	name, id, ok3 := strings.Cut(rest, "/")
	if ok && ok2 && ok3 {
		if ev.ObjectKind == "" {
			ev.ObjectKind = kind
		}
		if ev.ObjectName == "" {
			ev.ObjectName = name
		}
		if ev.Name == "" {
			ev.Name = name + "." + id
		}
	}
	if ev.LastTime == nil && ev.Time != nil {
		ev.LastTime = proto.CloneOf(ev.Time)
	}
}

// marshalLog encodes an object's log: its events as marshalStored
// stores them, but for the name, which keeps only the id, each preceded
// by its size.
func marshalLog(evs []*typesv1.Event) ([]byte, error) {
	var buf bytes.Buffer
	for _, ev := range evs {
		// "<object name>.<id>": the id has no dot, an object's name may.
		id := ev.GetName()[strings.LastIndex(ev.GetName(), ".")+1:]
		e := proto.CloneOf(ev)
		e.Name, e.ObjectKind, e.ObjectName = id, "", ""
		if proto.Equal(e.LastTime, e.Time) {
			e.LastTime = nil
		}
		if _, err := protodelim.MarshalTo(&buf, e); err != nil {
			return nil, fmt.Errorf("event log: encode: %w", err)
		}
	}
	return buf.Bytes(), nil
}

// unmarshalLog decodes the log of object kind/name (marshalLog); on an
// error it returns the events before it.
func unmarshalLog(kind, name string, data []byte) ([]*typesv1.Event, error) {
	var out []*typesv1.Event
	rd := bytes.NewReader(data)
	for rd.Len() > 0 {
		ev := &typesv1.Event{}
		if err := protodelim.UnmarshalFrom(rd, ev); err != nil {
			return out, fmt.Errorf("event log of %s/%s: decode event %d: %w", kind, name, len(out), err)
		}
		ev.ObjectKind, ev.ObjectName, ev.Name = kind, name, name+"."+ev.GetName()
		fromStored("", ev)
		out = append(out, ev)
	}
	return out, nil
}

// similarKey identifies alike events: object, type, reason and message.
func similarKey(kind, name string, e Event) string {
	return kind + "\x00" + name + "\x00" + e.Type + "\x00" + e.Reason + "\x00" + e.Message
}

// Done tells the recorder how the batch's transaction went: rev is the
// revision it committed at, 0 when it was not committed, and answers
// etcd's answers to Ops, in order. When committed, the recorder holds the
// log it wrote, or, when the events went a key each, remembers them for
// aggregation and every MaxPerObject/5 new keys of the object deletes the
// oldest beyond MaxPerObject (a read, and a write only when there are too
// many). When not, the batch's rate-limit tokens are given back.
func (b *Batch) Done(ctx context.Context, rev int64, answers []*etcdserverpb.ResponseOp) {
	r := b.r
	if r == nil || b.obj == nil {
		return
	}
	r.mu.Lock()
	if rev <= 0 {
		for _, res := range b.resv {
			res.CancelAt(b.now)
		}
		// The refused ones were refused all the same.
		b.obj.dropped += b.dropped
		r.stats.Dropped += int64(b.dropped)
		r.mu.Unlock()
		return
	}
	if b.consumed > 0 {
		b.obj.dropped -= b.consumed
	}
	b.obj.dropped += b.dropped
	r.stats.Dropped += int64(b.dropped)
	if len(b.ops) == 0 {
		r.mu.Unlock()
		return
	}
	if len(answers) > 0 && answers[0].GetResponseTxn().GetSucceeded() {
		r.logs.Add(b.objKey, &keptLog{val: b.logVal, at: rev})
		r.stats.Written += int64(b.logNew)
		r.stats.Aggregated += int64(b.logAggr)
		r.stats.Logged += int64(b.logNew + b.logAggr)
		r.mu.Unlock()
		return
	}
	// A key each: the log is not what this recorder holds; the next
	// batch reads it.
	r.logs.Remove(b.objKey)
	for i, s := range b.stored {
		r.similar.Add(b.keys[i], &seen{key: s.key, ev: s.ev})
	}
	r.stats.Written += int64(b.newKeys)
	r.stats.Aggregated += int64(b.aggr)
	b.obj.added += b.newKeys
	trim := b.obj.added >= max(r.cfg.MaxPerObject/5, 1)
	if trim {
		b.obj.added = 0
	}
	keep := r.cfg.MaxPerObject
	r.mu.Unlock()
	if trim {
		n, err := r.trim(ctx, b.prefix, keep)
		if err != nil {
			r.log.Warn("events not trimmed", "object", b.objKey, "err", err)
		}
		r.mu.Lock()
		r.stats.Trimmed += n
		r.mu.Unlock()
	}
}

// trim deletes the oldest events under prefix beyond the newest keep, in
// one write; it returns how many it deleted.
func (r *Recorder) trim(ctx context.Context, prefix string, keep int) (int64, error) {
	resp, err := r.client.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly(),
		clientv3.WithSort(clientv3.SortByKey, clientv3.SortDescend), clientv3.WithLimit(int64(keep)+1))
	if err != nil {
		return 0, errdefs.Unavailable("list events to trim: %w", err)
	}
	if len(resp.Kvs) <= keep {
		return 0, nil
	}
	// Everything from the prefix up to and including the newest key too
	// many.
	end := string(resp.Kvs[keep].Key) + "\x00"
	del, err := r.client.Delete(ctx, prefix, clientv3.WithRange(end))
	if err != nil {
		return 0, errdefs.Unavailable("trim events: %w", err)
	}
	return del.Deleted, nil
}

// List returns the events of kind/name, oldest first by last occurrence,
// at most limit of the newest (all when limit <= 0). An empty name lists
// every object of kind; an empty kind lists everything. Across objects
// the newest are the last written (etcd sorts by mod revision and sends
// only limit of them), since keys sort by object first.
func (r *Recorder) List(ctx context.Context, kind, name string, limit int64) ([]*typesv1.Event, error) {
	prefix := Prefix
	if kind != "" {
		prefix += kind + "/"
		if name != "" {
			prefix += name + "/"
		}
	}
	opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortDescend)}
	if name == "" {
		opts[1] = clientv3.WithSort(clientv3.SortByModRevision, clientv3.SortDescend)
	}
	if limit > 0 {
		opts = append(opts, clientv3.WithLimit(limit))
	}
	resp, err := r.client.Get(ctx, prefix, opts...)
	if err != nil {
		return nil, errdefs.Unavailable("list events: %w", err)
	}
	out := make([]*typesv1.Event, 0, len(resp.Kvs))
	for _, kv := range slices.Backward(resp.Kvs) {
		key := string(kv.Key)
		if rest, ok := strings.CutSuffix(key, "/"+logSuffix); ok {
			k, n, _ := strings.Cut(strings.TrimPrefix(rest, Prefix), "/")
			evs, err := unmarshalLog(k, n, kv.Value)
			if err != nil {
				return nil, err
			}
			out = append(out, evs...)
			continue
		}
		ev := &typesv1.Event{}
		if err := proto.Unmarshal(kv.Value, ev); err != nil {
			return nil, fmt.Errorf("event %s: decode: %w", kv.Key, err)
		}
		fromStored(key, ev)
		out = append(out, ev)
	}
	sort.SliceStable(out, func(i, j int) bool { return LastTime(out[i]).Before(LastTime(out[j])) })
	if limit > 0 && int64(len(out)) > limit {
		out = out[int64(len(out))-limit:]
	}
	return out, nil
}

// LastTime is when ev last happened (its time for an event stored before
// aggregation).
func LastTime(ev *typesv1.Event) time.Time {
	if ev.GetLastTime() != nil {
		return ev.GetLastTime().AsTime()
	}
	return ev.GetTime().AsTime()
}
