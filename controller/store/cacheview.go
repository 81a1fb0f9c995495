package store

import (
	"slices"
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

// view is what a Cache keeps: the items in name order in a copy-on-write
// B-tree (a listing's snapshot is a clone, O(1), that later changes do
// not touch; a Get is a lookup in it), the snapshots still in use, and
// the indexes. A Cache changes it under its mu.
type view struct {
	tree     *btree.BTreeG[Item]
	indexers map[string]IndexFunc
	// index is index name -> value -> item names.
	index map[string]map[string]*nameSet
	snaps map[int64]*snapshot
	now   func() time.Time
	// watchers are the Cache's Watch streams (cachewatch.go).
	watchers map[*cacheWatcher]struct{}
}

// indexVal is one value an item is indexed under.
type indexVal struct{ index, value string }

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
		index:    map[string]map[string]*nameSet{},
		snaps:    map[int64]*snapshot{},
		now:      time.Now,
		watchers: map[*cacheWatcher]struct{}{},
	}
}

// reset empties the tree and the indexes (a new listing follows).
func (v *view) reset() {
	v.tree = btree.NewG(32, lessByName)
	for name := range v.index {
		v.index[name] = map[string]*nameSet{}
	}
}

// get returns the item name as kept.
func (v *view) get(name string) (Item, bool) {
	return v.tree.Get(Item{Name: name})
}

// put records kept, which replaces prev when had; it is kept decoded,
// which the indexers read.
func (v *view) put(prev Item, had bool, it, kept Item) {
	if had {
		v.unindex(prev)
	}
	var vals []indexVal
	for name, fn := range v.indexers {
		for _, val := range fn(it) {
			set := v.index[name][val]
			if set == nil {
				set = &nameSet{}
				v.index[name][val] = set
			}
			set.add(it.Name)
			vals = append(vals, indexVal{name, val})
		}
	}
	kept.vals = slices.Clip(vals)
	v.tree.ReplaceOrInsert(kept)
}

// del removes prev, when had.
func (v *view) del(prev Item, had bool) {
	if !had {
		return
	}
	v.tree.Delete(prev)
	v.unindex(prev)
}

// unindex takes kept item it out of every index it is under.
func (v *view) unindex(it Item) {
	for _, iv := range it.vals {
		set := v.index[iv.index][iv.value]
		if set.remove(it.Name) == 0 {
			delete(v.index[iv.index], iv.value)
		}
	}
}

// nameSet is the item names under one value of an index: a slice while
// few (most values of an index hold one item: a host's machine, a
// machine's host; a map of one name costs about four times a slice of
// one), a map once more than fewNames.
type nameSet struct {
	few  []string
	many map[string]struct{}
}

const fewNames = 8

func (s *nameSet) add(name string) {
	if s.many != nil {
		s.many[name] = struct{}{}
		return
	}
	if slices.Contains(s.few, name) {
		return
	}
	if len(s.few) < fewNames {
		s.few = append(s.few, name)
		return
	}
	s.many = make(map[string]struct{}, 2*fewNames)
	for _, n := range s.few {
		s.many[n] = struct{}{}
	}
	s.many[name] = struct{}{}
	s.few = nil
}

// remove takes name out and returns how many names are left.
func (s *nameSet) remove(name string) int {
	if s == nil {
		return 0
	}
	if s.many != nil {
		delete(s.many, name)
		return len(s.many)
	}
	if i := slices.Index(s.few, name); i >= 0 {
		s.few = slices.Delete(s.few, i, i+1)
	}
	return len(s.few)
}

func (s *nameSet) len() int {
	if s == nil {
		return 0
	}
	if s.many != nil {
		return len(s.many)
	}
	return len(s.few)
}

func (s *nameSet) each(fn func(string)) {
	if s == nil {
		return
	}
	for _, n := range s.few {
		fn(n)
	}
	for n := range s.many {
		fn(n)
	}
}

// AddIndex adds an index named name to the Cache: ByIndex(name, value)
// then returns the items fn puts under value. Add every index before Run.
func (c *Cache) AddIndex(name string, fn IndexFunc) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.view.indexers[name] = fn
	c.view.index[name] = map[string]*nameSet{}
	var all []Item
	c.view.tree.Ascend(func(it Item) bool { all = append(all, it); return true })
	for _, it := range all {
		c.view.put(it, true, c.decoded(it), it)
	}
}

// ByIndex returns the cached items the index name puts under value, in
// name order (nil for an unknown index). Like List, it reads what the
// cache holds now (it may lag the store) and the messages are shared:
// do not change them. Of an encoded Cache it decodes them all at once:
// RangeIndex walks them one at a time.
func (c *Cache) ByIndex(name, value string) []Item {
	kept, ok := c.keptByIndex(name, value)
	if !ok {
		return nil
	}
	for i, it := range kept {
		kept[i] = c.decoded(it)
	}
	return kept
}

// RangeIndex calls fn with each cached item the index name puts under
// value, in name order, until fn returns false; of an encoded Cache it
// decodes one at a time (Range). An unknown index has no items.
func (c *Cache) RangeIndex(name, value string, fn func(Item) bool) {
	kept, _ := c.keptByIndex(name, value)
	for _, it := range kept {
		if !fn(c.decoded(it)) {
			return
		}
	}
}

// keptByIndex returns the items as kept under value of index name, in
// name order, in a new slice; ok is false for an unknown index.
func (c *Cache) keptByIndex(name, value string) (kept []Item, ok bool) {
	c.mu.Lock()
	idx, ok := c.view.index[name]
	if !ok {
		c.mu.Unlock()
		return nil, false
	}
	set := idx[value]
	kept = make([]Item, 0, set.len())
	set.each(func(n string) {
		if it, ok := c.view.get(n); ok {
			kept = append(kept, it)
		}
	})
	c.mu.Unlock()
	sort.Slice(kept, func(i, j int) bool { return kept[i].Name < kept[j].Name })
	return kept, true
}

// HasIndex reports whether the Cache has an index named name (AddIndex).
func (c *Cache) HasIndex(name string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.view.indexers[name]
	return ok
}

// IndexLen returns how many cached items the index name puts under
// value (0 for an unknown index), decoding none.
func (c *Cache) IndexLen(name, value string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.view.index[name][value].len()
}

// Get returns the cached item name, and whether the cache holds it. The
// message is shared: do not change it (proto.Clone first).
func (c *Cache) Get(name string) (Item, bool) {
	c.mu.Lock()
	it, ok := c.view.get(name)
	c.mu.Unlock()
	if !ok {
		return Item{}, false
	}
	return c.decoded(it), true
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
// decode gives an item as the reader gets it (Cache.decoded).
func page(t *btree.BTreeG[Item], after string, opts ListOptions, match func(Item) bool, decode func(Item) Item) (items []Item, more bool) {
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
		kept := it
		it = decode(it)
		if match != nil && !match(it) {
			return true
		}
		items = append(items, it)
		if kept.raw != nil {
			size += int64(len(kept.raw))
		} else {
			size += int64(proto.Size(it.Msg))
		}
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
