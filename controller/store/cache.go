package store

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/google/btree"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
)

// Cache holds the resources of one kind in memory, fed by a watch: one
// listing (ListAllAt), then every change after it (Watch from the
// listing's revision + 1); a watch that ends (history compacted, etcd
// lost) is followed by a new listing. It is for a reader that would
// otherwise list a whole kind often: the cluster executor reads every
// Host on each reconcile of a cluster, so its cost grew with clusters ×
// hosts; with a Cache each change is decoded once.
//
// What List returns may lag the store by the watch's delay, even behind
// the reader's own writes: read from a Cache only where a stale read is
// caught later by a compare-and-swap (a host taken meanwhile fails the
// bind), never to decide a create. A reader that must see its own write
// waits for the write's revision first (WaitRevision).
type Cache struct {
	st     *Store
	kind   string
	newMsg func() proto.Message

	mu     sync.Mutex
	rev    int64 // the last revision applied
	synced chan struct{}
	once   sync.Once
	// moved is closed (and replaced) whenever rev moves: WaitRevision's
	// broadcast.
	moved chan struct{}
	// watchCtx is the context Run watches with: a progress request must
	// go to the same etcd watch stream (clientv3 picks the stream by the
	// context's metadata).
	watchCtx context.Context
	view     view // the items in name order, snapshots and indexes (cacheview.go)
	// encoded: the items hold their encoding, not a decoded message
	// (KeepEncoded).
	encoded bool
}

// NewCache returns a Cache of kind; it fills once Run runs.
func NewCache(st *Store, kind string, newMsg func() proto.Message) *Cache {
	return &Cache{st: st, kind: kind, newMsg: newMsg, synced: make(chan struct{}), moved: make(chan struct{}), view: newView()}
}

// KeepEncoded makes the Cache hold each resource as etcd stores it, its
// protobuf encoding, and decode it on every read (Get, List, ByIndex,
// ListPage): each reader gets a message of its own. For the kinds a fleet
// has one of per host (Hosts, Machines): a decoded Host is about 4.7
// times its encoding (3,312 against 696 bytes in the simulated fleet),
// so 100,000 of them held 330 MiB decoded and 70 MiB encoded. A read
// costs a decode, so readers of a whole kind that run often read an
// index instead (AddIndex, ByIndex, IndexLen). Call before Run.
func (c *Cache) KeepEncoded() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.encoded = true
}

// Encoded reports whether the Cache keeps encodings (KeepEncoded): then
// every message it returns is the reader's own.
func (c *Cache) Encoded() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.encoded
}

// stored is it as the Cache keeps it: its encoding (KeepEncoded), or its
// decoded message.
func (c *Cache) stored(it Item) Item {
	if c.encoded {
		return Item{Name: it.Name, Rev: it.Rev, raw: it.raw}
	}
	return Item{Name: it.Name, Rev: it.Rev, Msg: it.Msg}
}

// decoded is a kept item as readers get it: decoded, when the Cache keeps
// encodings. The encoding decoded once already (apply, reset), so a
// failure is not expected; it would give an empty message.
func (c *Cache) decoded(it Item) Item {
	if it.Msg != nil {
		return Item{Name: it.Name, Rev: it.Rev, Msg: it.Msg}
	}
	m := c.newMsg()
	if err := proto.Unmarshal(it.raw, m); err != nil {
		c.st.log.Error("cache: kept encoding does not decode", "kind", c.kind, "name", it.Name, "err", err)
	}
	return Item{Name: it.Name, Rev: it.Rev, Msg: m}
}

// cacheRetry is the pause before a failed listing is tried again.
const cacheRetry = time.Second

// Run keeps the Cache filled until ctx ends. It blocks.
func (c *Cache) Run(ctx context.Context) {
	for ctx.Err() == nil {
		items, rev, err := c.st.ListAllAt(ctx, c.kind, c.newMsg)
		if err != nil {
			if ctx.Err() == nil {
				c.st.log.Warn("cache: list, retrying", "kind", c.kind, "err", err)
			}
			select {
			case <-ctx.Done():
			case <-time.After(cacheRetry):
			}
			continue
		}
		c.mu.Lock()
		c.watchCtx = ctx
		c.mu.Unlock()
		c.reset(items, rev)
		for ev := range c.st.watchProgress(ctx, c.kind, rev+1) {
			if ev.Err != nil {
				if ctx.Err() == nil {
					c.st.log.Info("cache: watch ended, listing again", "kind", c.kind, "err", ev.Err)
				}
				break
			}
			if err := c.apply(ev); err != nil {
				c.st.log.Warn("cache: skipping undecodable change", "kind", c.kind, "name", ev.Name, "err", err)
			}
		}
	}
}

func (c *Cache) reset(items []Item, rev int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.view.reset()
	// items come from ListAllAt, which keeps each one's encoding (raw).
	for _, it := range items {
		c.view.put(Item{}, false, it, c.stored(it))
	}
	// Snapshots are of revisions before the new listing; they stay valid
	// (each is an immutable tree of its revision). Watchers may have
	// missed changes.
	c.view.loseAll()
	c.moveTo(rev)
	c.once.Do(func() { close(c.synced) })
}

// moveTo sets the revision applied and wakes WaitRevision; c.mu held.
func (c *Cache) moveTo(rev int64) {
	if rev == c.rev {
		return
	}
	c.rev = rev
	close(c.moved)
	c.moved = make(chan struct{})
}

func (c *Cache) apply(ev WatchEvent) error {
	if ev.Type == eventProgress {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.moveTo(max(c.rev, ev.Rev))
		return nil
	}
	var m proto.Message
	if ev.Type == EventPut {
		m = c.newMsg()
		if err := proto.Unmarshal(ev.Value, m); err != nil {
			return fmt.Errorf("decode: %w", err)
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	prev, had := c.view.get(ev.Name)
	if ev.Type == EventPut {
		it := Item{Name: ev.Name, Rev: ev.Rev, Msg: m, raw: ev.Value}
		c.view.put(prev, had, it, c.stored(it))
	} else {
		c.view.del(prev, had)
	}
	c.view.notify(ev)
	done := ev.Rev
	if ev.revMore {
		done-- // more changes of this revision (one transaction) follow
	}
	c.moveTo(max(c.rev, done))
	return nil
}

// List returns the cached resources in name order, once the first
// listing is in (it waits for it, until ctx ends). The messages are
// shared with other readers: do not change them (proto.Clone first). Of
// an encoded Cache (KeepEncoded) it decodes every resource at once: walk
// it with Range, or read an index, where a kind is large or read often.
func (c *Cache) List(ctx context.Context) ([]Item, error) {
	t, err := c.kept(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]Item, 0, t.Len())
	t.Ascend(func(it Item) bool {
		out = append(out, c.decoded(it))
		return true
	})
	return out, nil
}

// Range calls fn with each cached resource in name order, once the first
// listing is in (it waits for it, until ctx ends), until fn returns
// false. It walks the resources as they were when it was called. Of an
// encoded Cache it decodes one resource at a time, so a walk of a large
// kind holds one decoded resource, not all. The messages are shared, as
// List's: do not change them.
func (c *Cache) Range(ctx context.Context, fn func(Item) bool) error {
	t, err := c.kept(ctx)
	if err != nil {
		return err
	}
	t.Ascend(func(it Item) bool { return fn(c.decoded(it)) })
	return nil
}

// kept returns the items as the Cache keeps them, in name order, once
// the first listing is in: a clone of its tree (O(1); later changes copy
// what they touch), which the caller reads without the lock.
func (c *Cache) kept(ctx context.Context) (*btree.BTreeG[Item], error) {
	select {
	case <-c.synced:
	case <-ctx.Done():
		return nil, fmt.Errorf("cache of %s: %w", c.kind, ctx.Err())
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.view.tree.Clone(), nil
}

// Revision is the last store revision the Cache applied (0 before the
// first listing).
func (c *Cache) Revision() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.rev
}

// progressRetry is the first pause before WaitRevision asks etcd again for
// a progress notification (doubling each time): etcd answers one only
// when every watch of the stream is current, else drops it.
const progressRetry = 100 * time.Millisecond

// WaitRevision returns once the Cache has applied revision rev or a later
// one (and its first listing is in), or with ctx's error when ctx ends
// first. Read-your-writes: after a write that returned revision rev, a
// List following WaitRevision(ctx, rev) shows that write, or a later
// change of the same resource. rev may be of any kind's write: when no
// change of the Cache's kind follows it, etcd's progress notification
// (asked for here) tells the Cache it is current. A new listing (after
// the watch history was compacted) reaches its listing's revision.
func (c *Cache) WaitRevision(ctx context.Context, rev int64) error {
	select {
	case <-c.synced:
	case <-ctx.Done():
		return c.waitErr(ctx, rev)
	}
	var retry *time.Timer
	pause := progressRetry
	for {
		c.mu.Lock()
		cur, moved, wctx := c.rev, c.moved, c.watchCtx
		c.mu.Unlock()
		if cur >= rev {
			return nil
		}
		if retry == nil {
			c.requestProgress(ctx, wctx)
			retry = time.NewTimer(pause)
			defer retry.Stop()
		}
		select {
		case <-moved:
			// Something was applied: look again.
		case <-retry.C:
			c.requestProgress(ctx, wctx)
			pause = min(2*pause, 5*time.Second)
			retry.Reset(pause)
		case <-ctx.Done():
			return c.waitErr(ctx, rev)
		}
	}
}

func (c *Cache) waitErr(ctx context.Context, rev int64) error {
	return fmt.Errorf("cache of %s at revision %d, waiting for revision %d: %w", c.kind, c.Revision(), rev, ctx.Err())
}

// requestProgress asks etcd for a progress notification on the watch
// stream of the Cache's watch (watched with wctx); a failure only means
// WaitRevision waits for the next change or retry.
func (c *Cache) requestProgress(ctx, wctx context.Context) {
	if wctx == nil {
		return
	}
	md, _ := metadata.FromOutgoingContext(clientv3.WithRequireLeader(wctx))
	if err := c.st.client.RequestProgress(metadata.NewOutgoingContext(ctx, md)); err != nil && ctx.Err() == nil {
		c.st.log.Debug("cache: progress request", "kind", c.kind, "err", err)
	}
}
