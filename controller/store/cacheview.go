package store

import (
	"sort"
	"strings"
	"time"

	"github.com/google/btree"
	"google.golang.org/protobuf/proto"
)

// IndexFunc returns the values under which an item is found in one index
// of a Cache (none: it is in no set of that index). It must not change
// the item.
type IndexFunc func(Item) []string

// view is what a Cache keeps besides its map, for readers that page or
// filter: the items in name order in a copy-on-write B-tree (a listing's
// snapshot is a clone, O(1), that later changes do not touch), the
// snapshots still in use, and the indexes. A Cache changes it under its
// mu.
type view struct {
	tree     *btree.BTreeG[Item]
	indexers map[string]IndexFunc
	// index is index name -> value -> item names.
	index map[string]map[string]map[string]struct{}
	snaps map[int64]*snapshot
	now   func() time.Time
	// watchers are the Cache's Watch streams (cachewatch.go).
	watchers map[*cacheWatcher]struct{}
}

// snapshot is the tree as of one revision, kept while a paged listing
// may still ask for its next page.
type snapshot struct {
	tree *btree.BTreeG[Item]
	used time.Time
}

// snapshotTTL is how long a listing's snapshot is kept after its last
// page was served; a continue token of an older one is served by etcd
// (at the same revision, so still consistent) instead.
const snapshotTTL = 90 * time.Second

// maxSnapshots bounds the snapshots kept at once (each shares what has
// not changed since with the live tree).
const maxSnapshots = 64

func lessByName(a, b Item) bool { return a.Name < b.Name }

func newView() view {
	return view{
		tree:     btree.NewG(32, lessByName),
		indexers: map[string]IndexFunc{},
		index:    map[string]map[string]map[string]struct{}{},
		snaps:    map[int64]*snapshot{},
		now:      time.Now,
		watchers: map[*cacheWatcher]struct{}{},
	}
}

func (v *view) reset(items []Item) {
	v.tree = btree.NewG(32, lessByName)
	for name := range v.index {
		v.index[name] = map[string]map[string]struct{}{}
	}
	for _, it := range items {
		v.put(Item{}, false, it)
	}
	// Snapshots are of revisions before the new listing; they stay valid
	// (each is an immutable tree of its revision). Watchers may have
	// missed changes.
	v.loseAll()
}

// put records it, which replaces prev when had.
func (v *view) put(prev Item, had bool, it Item) {
	v.tree.ReplaceOrInsert(it)
	for name, fn := range v.indexers {
		if had {
			v.unindex(name, fn, prev)
		}
		for _, val := range fn(it) {
			set := v.index[name][val]
			if set == nil {
				set = map[string]struct{}{}
				v.index[name][val] = set
			}
			set[it.Name] = struct{}{}
		}
	}
}

// del removes prev, when had.
func (v *view) del(prev Item, had bool) {
	if !had {
		return
	}
	v.tree.Delete(prev)
	for name, fn := range v.indexers {
		v.unindex(name, fn, prev)
	}
}

func (v *view) unindex(name string, fn IndexFunc, it Item) {
	for _, val := range fn(it) {
		set := v.index[name][val]
		delete(set, it.Name)
		if len(set) == 0 {
			delete(v.index[name], val)
		}
	}
}

// AddIndex adds an index named name to the Cache: ByIndex(name, value)
// then returns the items fn puts under value. Add every index before Run.
func (c *Cache) AddIndex(name string, fn IndexFunc) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.view.indexers[name] = fn
	c.view.index[name] = map[string]map[string]struct{}{}
	for _, it := range c.items {
		c.view.put(Item{}, false, it)
	}
}

// ByIndex returns the cached items the index name puts under value, in
// name order (nil for an unknown index). Like List, it reads what the
// cache holds now (it may lag the store) and the messages are shared:
// do not change them.
func (c *Cache) ByIndex(name, value string) []Item {
	c.mu.Lock()
	defer c.mu.Unlock()
	idx, ok := c.view.index[name]
	if !ok {
		return nil
	}
	set := idx[value]
	out := make([]Item, 0, len(set))
	for n := range set {
		out = append(out, c.items[n])
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Get returns the cached item name, and whether the cache holds it. The
// message is shared: do not change it (proto.Clone first).
func (c *Cache) Get(name string) (Item, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	it, ok := c.items[name]
	return it, ok
}

// Synced reports whether the first listing is in.
func (c *Cache) Synced() bool {
	select {
	case <-c.synced:
		return true
	default:
		return false
	}
}

// snapshotNow returns the cached items as a tree that no later change
// touches, and the revision it holds. Listings that start while nothing
// changes share one.
func (c *Cache) snapshotNow() (*btree.BTreeG[Item], int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.view.now()
	c.view.expire(now)
	if s, ok := c.view.snaps[c.rev]; ok {
		s.used = now
		return s.tree, c.rev
	}
	if len(c.view.snaps) >= maxSnapshots {
		c.view.evictOldest()
	}
	t := c.view.tree.Clone()
	c.view.snaps[c.rev] = &snapshot{tree: t, used: now}
	return t, c.rev
}

// snapshotAt returns the snapshot of revision rev, if it is still kept.
func (c *Cache) snapshotAt(rev int64) (*btree.BTreeG[Item], bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.view.now()
	c.view.expire(now)
	s, ok := c.view.snaps[rev]
	if !ok {
		return nil, false
	}
	s.used = now
	return s.tree, true
}

func (v *view) expire(now time.Time) {
	for rev, s := range v.snaps {
		if now.Sub(s.used) > snapshotTTL {
			delete(v.snaps, rev)
		}
	}
}

func (v *view) evictOldest() {
	var oldest int64
	var at time.Time
	for rev, s := range v.snaps {
		if at.IsZero() || s.used.Before(at) {
			oldest, at = rev, s.used
		}
	}
	delete(v.snaps, oldest)
}

// page reads one page of t after the name after ("" from the start):
// items that match (all when match is nil), at most opts.Limit (0: no
// limit), ending once their encoded size reaches opts.MaxBytes (> 0), as
// Store.List pages. more is whether t holds items after the page.
func page(t *btree.BTreeG[Item], after string, opts ListOptions, match func(Item) bool) (items []Item, more bool) {
	var size int64
	full := false
	visit := func(it Item) bool {
		if !strings.HasPrefix(it.Name, opts.NamePrefix) {
			return false // past the prefix's names, which are contiguous
		}
		if full {
			more = true
			return false
		}
		if match != nil && !match(it) {
			return true
		}
		items = append(items, it)
		size += int64(proto.Size(it.Msg))
		full = (opts.Limit > 0 && int64(len(items)) >= opts.Limit) || (opts.MaxBytes > 0 && size >= opts.MaxBytes)
		return true
	}
	start := opts.NamePrefix
	if after != "" && after >= start {
		start = after + "\x00"
	}
	t.AscendGreaterOrEqual(Item{Name: start}, visit)
	return items, more
}
