package store

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"time"

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
// What List returns may lag the store by the watch's delay: read from a
// Cache only where a stale read is caught later by a compare-and-swap
// (a host taken meanwhile fails the bind), never to decide a create.
type Cache struct {
	st     *Store
	kind   string
	newMsg func() proto.Message

	mu     sync.Mutex
	items  map[string]Item
	sorted []Item // items in name order; nil after a change
	rev    int64  // the last revision applied
	synced chan struct{}
	once   sync.Once
	view   view // name-ordered snapshots and indexes (cacheview.go)
}

// NewCache returns a Cache of kind; it fills once Run runs.
func NewCache(st *Store, kind string, newMsg func() proto.Message) *Cache {
	return &Cache{st: st, kind: kind, newMsg: newMsg, items: map[string]Item{}, synced: make(chan struct{}), view: newView()}
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
		c.reset(items, rev)
		for ev := range c.st.Watch(ctx, c.kind, rev+1) {
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
	c.items = make(map[string]Item, len(items))
	for _, it := range items {
		c.items[it.Name] = it
	}
	c.view.reset(items)
	c.sorted, c.rev = nil, rev
	c.once.Do(func() { close(c.synced) })
}

func (c *Cache) apply(ev WatchEvent) error {
	var m proto.Message
	if ev.Type == EventPut {
		m = c.newMsg()
		if err := proto.Unmarshal(ev.Value, m); err != nil {
			return fmt.Errorf("decode: %w", err)
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	prev, had := c.items[ev.Name]
	if ev.Type == EventPut {
		it := Item{Name: ev.Name, Rev: ev.Rev, Msg: m}
		c.items[ev.Name] = it
		c.view.put(prev, had, it)
	} else {
		delete(c.items, ev.Name)
		c.view.del(prev, had)
	}
	c.sorted, c.rev = nil, max(c.rev, ev.Rev)
	return nil
}

// List returns the cached resources in name order, once the first
// listing is in (it waits for it, until ctx ends). The messages are
// shared with other readers: do not change them (proto.Clone first).
func (c *Cache) List(ctx context.Context) ([]Item, error) {
	select {
	case <-c.synced:
	case <-ctx.Done():
		return nil, fmt.Errorf("cache of %s: %w", c.kind, ctx.Err())
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sorted == nil {
		c.sorted = make([]Item, 0, len(c.items))
		for _, it := range c.items {
			c.sorted = append(c.sorted, it)
		}
		sort.Slice(c.sorted, func(i, j int) bool { return c.sorted[i].Name < c.sorted[j].Name })
	}
	return c.sorted, nil
}

// Revision is the last store revision the Cache applied (0 before the
// first listing).
func (c *Cache) Revision() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.rev
}
