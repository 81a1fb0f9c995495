package store

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func runCache(t *testing.T, ctx context.Context, c *Cache) {
	t.Helper()
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); c.Run(rctx) }()
	t.Cleanup(func() { stop(); <-done })
	_, err := c.List(ctx)
	require.NoError(t, err)
}

func names(items []Item) []string {
	out := make([]string, 0, len(items))
	for _, it := range items {
		out = append(out, it.Name)
	}
	return out
}

func rackIndex(it Item) []string {
	if r := it.Msg.(*typesv1.Host).GetMetadata().GetLabels()["rack"]; r != "" {
		return []string{r}
	}
	return nil
}

// An index follows creates, label changes and deletes; Get reads one item.
func TestCacheIndex(t *testing.T) { eachMode(t, testCacheIndex) }

func testCacheIndex(t *testing.T, encoded bool) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	for _, n := range []string{"h-1", "h-2", "h-3"} {
		_, err := s.Create(ctx, "hosts", n, host(n, "")) // rack1
		require.NoError(t, err)
	}
	c := NewCache(s, "hosts", func() proto.Message { return &typesv1.Host{} })
	if encoded {
		c.KeepEncoded()
	}
	c.AddIndex("rack", rackIndex)
	runCache(t, ctx, c)
	require.Equal(t, []string{"h-1", "h-2", "h-3"}, names(c.ByIndex("rack", "rack1")))
	require.Empty(t, c.ByIndex("rack", "rack2"))
	require.Nil(t, c.ByIndex("cluster", "x"), "unknown index")

	h := &typesv1.Host{}
	rev, err := s.Get(ctx, "hosts", "h-2", h)
	require.NoError(t, err)
	h.Metadata.Labels["rack"] = "rack2"
	rev, err = s.Update(ctx, "hosts", "h-2", h, rev)
	require.NoError(t, err)
	require.NoError(t, s.Delete(ctx, "hosts", "h-3", 0))
	_, err = s.Create(ctx, "hosts", "h-0", host("h-0", ""))
	require.NoError(t, err)

	require.Eventually(t, func() bool {
		return slices.Equal(names(c.ByIndex("rack", "rack1")), []string{"h-0", "h-1"}) &&
			slices.Equal(names(c.ByIndex("rack", "rack2")), []string{"h-2"})
	}, 10*time.Second, 10*time.Millisecond, "rack1 = %v, rack2 = %v", names(c.ByIndex("rack", "rack1")), names(c.ByIndex("rack", "rack2")))
	it, ok := c.Get("h-2")
	require.True(t, ok)
	require.Equal(t, rev, it.Rev)
	require.Equal(t, "rack2", it.Msg.(*typesv1.Host).GetMetadata().GetLabels()["rack"])
	_, ok = c.Get("h-3")
	require.False(t, ok, "Get of a deleted host")
}

// Pages of a snapshot are those of etcd at the snapshot's revision, even
// after the kind changed; limits, sizes, prefixes and matches end pages
// as Store.List does.
func TestCacheSnapshotPages(t *testing.T) { eachMode(t, testCacheSnapshotPages) }

func testCacheSnapshotPages(t *testing.T, encoded bool) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	var want []string
	for i := range 25 {
		n := fmt.Sprintf("h-%02d", i)
		_, err := s.Create(ctx, "hosts", n, host(n, ""))
		require.NoError(t, err)
		want = append(want, n)
	}
	c := NewCache(s, "hosts", func() proto.Message { return &typesv1.Host{} })
	if encoded {
		c.KeepEncoded()
	}
	runCache(t, ctx, c)
	_, rev0, err := s.ListAllAt(ctx, "hosts", func() proto.Message { return &typesv1.Host{} })
	require.NoError(t, err)
	require.Eventually(t, func() bool { return c.Revision() >= rev0 }, 10*time.Second, 10*time.Millisecond)
	snap, rev := c.snapshotNow()
	require.Equal(t, rev0, rev)
	again, _ := c.snapshotNow()
	require.Same(t, snap, again, "a second listing at the same revision shares the snapshot")

	// Change the kind after the snapshot.
	require.NoError(t, s.Delete(ctx, "hosts", "h-03", 0))
	_, err = s.Create(ctx, "hosts", "h-10a", host("h-10a", ""))
	require.NoError(t, err)
	require.Eventually(t, func() bool { _, ok := c.Get("h-10a"); return ok }, 10*time.Second, 10*time.Millisecond)

	all := func(opts ListOptions, match func(Item) bool) []string {
		var got []string
		after := ""
		for {
			items, more := page(snap, after, opts, match, c.decoded)
			got = append(got, names(items)...)
			if !more {
				return got
			}
			require.NotEmpty(t, items, "a page that says more holds an item")
			after = items[len(items)-1].Name
		}
	}
	require.Equal(t, want, all(ListOptions{Limit: 7}, nil), "pages of the snapshot")
	require.Equal(t, want, all(ListOptions{MaxBytes: 1}, nil), "one item a page by size")
	require.Equal(t, []string{"h-10", "h-11", "h-12", "h-13", "h-14", "h-15", "h-16", "h-17", "h-18", "h-19"}, all(ListOptions{Limit: 3, NamePrefix: "h-1"}, nil))
	even := func(it Item) bool { return it.Name[len(it.Name)-1]%2 == 0 }
	require.Equal(t, []string{"h-00", "h-02", "h-04", "h-06", "h-08", "h-10", "h-12", "h-14", "h-16", "h-18", "h-20", "h-22", "h-24"}, all(ListOptions{Limit: 4}, even))

	// The snapshot is kept by its revision; the live tree moved on.
	got, ok := c.snapshotAt(rev)
	require.True(t, ok)
	require.Same(t, snap, got)
	live, rev2 := c.snapshotNow()
	require.Greater(t, rev2, rev)
	items, _ := page(live, "h-02", ListOptions{Limit: 2}, nil, c.decoded)
	require.Equal(t, []string{"h-04", "h-05"}, names(items), "the live listing no longer has h-03")
	items, _ = page(live, "h-10", ListOptions{Limit: 1}, nil, c.decoded)
	require.Equal(t, []string{"h-10a"}, names(items))
}

// Snapshots expire after snapshotTTL without use, and at most
// maxSnapshots are kept.
func TestCacheSnapshotExpiry(t *testing.T) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	c := NewCache(s, "hosts", func() proto.Message { return &typesv1.Host{} })
	now := time.Unix(1_000_000, 0)
	c.view.now = func() time.Time { return now }
	runCache(t, ctx, c)
	_, rev := c.snapshotNow()
	now = now.Add(snapshotTTL / 2)
	_, ok := c.snapshotAt(rev)
	require.True(t, ok, "used within the TTL")
	now = now.Add(snapshotTTL + time.Second)
	_, ok = c.snapshotAt(rev)
	require.False(t, ok, "unused for longer than the TTL")

	for i := range maxSnapshots + 3 {
		c.mu.Lock()
		c.rev = int64(1000 + i)
		c.mu.Unlock()
		c.snapshotNow()
		now = now.Add(time.Millisecond)
	}
	c.mu.Lock()
	n := len(c.view.snaps)
	c.mu.Unlock()
	require.Equal(t, maxSnapshots, n)
	_, ok = c.snapshotAt(1000)
	require.False(t, ok, "the least recently used went first")
	_, ok = c.snapshotAt(1000 + maxSnapshots + 2)
	require.True(t, ok)
}

// A listing from the cache holds every write that completed before it
// began (no waiting for the watch), its later pages read the snapshot of
// its first (as etcd would at the token's revision), and its tokens are
// Store.List's: a page the cache cannot serve is listed from etcd with
// the same token.
func TestCacheListPage(t *testing.T) { eachMode(t, testCacheListPage) }

func testCacheListPage(t *testing.T, encoded bool) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	newHost := func() proto.Message { return &typesv1.Host{} }
	for i := range 30 {
		n := fmt.Sprintf("h-%02d", i)
		_, err := s.Create(ctx, "hosts", n, host(n, ""))
		require.NoError(t, err)
	}
	c := NewCache(s, "hosts", newHost)
	if encoded {
		c.KeepEncoded()
	}
	_, _, served, err := c.ListPage(ctx, ListOptions{Limit: 10}, nil)
	require.NoError(t, err)
	require.False(t, served, "before the first listing")
	runCache(t, ctx, c)

	items, next, served, err := c.ListPage(ctx, ListOptions{Limit: 10}, nil)
	require.NoError(t, err)
	require.True(t, served)
	require.Len(t, items, 10)
	require.NotEmpty(t, next)
	got := names(items)

	// Changes after the first page do not show in the next ones...
	_, err = s.Create(ctx, "hosts", "h-15a", host("h-15a", ""))
	require.NoError(t, err)
	require.NoError(t, s.Delete(ctx, "hosts", "h-20", 0))
	for next != "" {
		cont := next
		items, next, served, err = c.ListPage(ctx, ListOptions{Limit: 10, Continue: cont}, nil)
		require.NoError(t, err)
		require.True(t, served)
		fromEtcd, etcdNext, err := s.List(ctx, "hosts", newHost, ListOptions{Limit: 10, Continue: cont})
		require.NoError(t, err)
		require.Equal(t, names(fromEtcd), names(items), "the page etcd lists at the token's revision")
		require.Equal(t, etcdNext, next)
		for i := range items {
			require.Equal(t, fromEtcd[i].Rev, items[i].Rev)
		}
		got = append(got, names(items)...)
	}
	require.Len(t, got, 30)
	require.Contains(t, got, "h-20")
	require.NotContains(t, got, "h-15a")

	// ...and a listing that starts after them holds both, at once.
	items, _, served, err = c.ListPage(ctx, ListOptions{}, nil)
	require.NoError(t, err)
	require.True(t, served)
	require.Contains(t, names(items), "h-15a")
	require.NotContains(t, names(items), "h-20")

	// A token whose snapshot the cache does not keep (another replica's,
	// or an expired one) is left to etcd.
	_, _, served, err = c.ListPage(ctx, ListOptions{Limit: 10, Continue: encodeContinue(3, "h-09")}, nil)
	require.NoError(t, err)
	require.False(t, served)
	_, _, _, err = c.ListPage(ctx, ListOptions{Continue: "not a token"}, nil)
	require.True(t, errdefs.IsInvalidArgument(err), "malformed token: %v", err)
}

// Watchers of a Cache get its changes in order from memory; one that
// falls too far behind ends with Unavailable after the changes it had.
func TestCacheWatch(t *testing.T) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	c := NewCache(s, "hosts", func() proto.Message { return &typesv1.Host{} })
	runCache(t, ctx, c)
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch := c.Watch(wctx)
	slow := c.Watch(wctx) // read only at the end

	rev1, err := s.Create(ctx, "hosts", "h-1", host("h-1", ""))
	require.NoError(t, err)
	h := host("h-1", "52:54:00:00:00:01")
	rev2, err := s.Update(ctx, "hosts", "h-1", h, rev1)
	require.NoError(t, err)
	require.NoError(t, s.Delete(ctx, "hosts", "h-1", 0))
	type change struct {
		typ  EventType
		rev  int64
		boot string
	}
	var got []change
	for range 3 {
		select {
		case ev := <-ch:
			require.NoError(t, ev.Err)
			require.Equal(t, "h-1", ev.Name)
			c := change{typ: ev.Type, rev: ev.Rev}
			if ev.Type == EventPut {
				m := &typesv1.Host{}
				require.NoError(t, proto.Unmarshal(ev.Value, m))
				c.boot = m.GetSpec().GetBootMac()
			}
			got = append(got, c)
		case <-time.After(10 * time.Second):
			t.Fatalf("watch: %d changes, want 3", len(got))
		}
	}
	require.Equal(t, []change{{EventPut, rev1, ""}, {EventPut, rev2, "52:54:00:00:00:01"}, {EventDelete, got[2].rev, ""}}, got)
	require.Greater(t, got[2].rev, rev2)

	// One transaction of more changes than a watcher may lag.
	var ops []BatchOp
	for i := range cacheWatchBuffer + 10 {
		n := fmt.Sprintf("b-%04d", i)
		ops = append(ops, BatchOp{Kind: "hosts", Name: n, Msg: host(n, "")})
	}
	_, err = s.Batch(ctx, ops)
	require.NoError(t, err)
	// Read the slow watcher only once the cache applied the whole batch
	// (its changes share one revision).
	require.Eventually(t, func() bool {
		items, err := c.List(ctx)
		return err == nil && len(items) == len(ops)
	}, 10*time.Second, 10*time.Millisecond)
	n := 0
	for ev := range slow {
		if ev.Err != nil {
			require.True(t, errdefs.IsUnavailable(ev.Err), "the dropped watcher's last event: %v", ev.Err)
			break
		}
		n++
	}
	require.GreaterOrEqual(t, n, cacheWatchBuffer, "changes a dropped watcher still got")
	require.Less(t, n, 3+len(ops), "a dropped watcher got every change")
	_, open := <-slow
	require.False(t, open, "the dropped watcher's channel is closed")

	// Ending the context ends a watch.
	cancel()
	for range ch {
	}
}

// A transaction's changes share one revision: a cache that reached it
// holds all of them (read-your-writes after a batch).
func TestCacheWaitRevisionBatch(t *testing.T) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	c := NewCache(s, "hosts", func() proto.Message { return &typesv1.Host{} })
	runCache(t, ctx, c)
	total := 0
	for round := range 20 {
		var ops []BatchOp
		for i := range 200 {
			n := fmt.Sprintf("r%02d-%03d", round, i)
			ops = append(ops, BatchOp{Kind: "hosts", Name: n, Msg: host(n, "")})
		}
		rev, err := s.Batch(ctx, ops)
		require.NoError(t, err)
		total += len(ops)
		require.NoError(t, c.WaitRevision(ctx, rev))
		items, err := c.List(ctx)
		require.NoError(t, err)
		require.Equal(t, total, len(items), "round %d: hosts in the cache at the batch's revision", round)
	}
}

// eachMode runs test on a Cache holding decoded messages, then on one
// holding encodings (KeepEncoded).
func eachMode(t *testing.T, test func(t *testing.T, encoded bool)) {
	t.Run("decoded", func(t *testing.T) { test(t, false) })
	t.Run("encoded", func(t *testing.T) { test(t, true) })
}

// An encoded Cache gives every reader a message of its own, equal to the
// stored one: a reader that changes what it read changes no later read.
// Its indexes follow changes without decoding what leaves them, and
// IndexLen counts without decoding.
func TestCacheKeepEncoded(t *testing.T) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	for i := range 5 {
		n := fmt.Sprintf("h-%d", i)
		_, err := s.Create(ctx, "hosts", n, host(n, ""))
		require.NoError(t, err)
	}
	c := NewCache(s, "hosts", func() proto.Message { return &typesv1.Host{} })
	c.KeepEncoded()
	c.AddIndex("rack", rackIndex)
	runCache(t, ctx, c)
	require.Equal(t, 5, c.IndexLen("rack", "rack1"))
	require.Zero(t, c.IndexLen("rack", "rack2"))
	require.Zero(t, c.IndexLen("nope", "rack1"), "unknown index")

	stored := &typesv1.Host{}
	rev, err := s.Get(ctx, "hosts", "h-1", stored)
	require.NoError(t, err)
	a, ok := c.Get("h-1")
	require.True(t, ok)
	require.Equal(t, rev, a.Rev)
	require.True(t, proto.Equal(stored, a.Msg), "the cached host is the stored one: %v", a.Msg)
	a.Msg.(*typesv1.Host).Spec.BootMac = "changed by a reader"
	b, _ := c.Get("h-1")
	require.NotSame(t, a.Msg, b.Msg)
	require.True(t, proto.Equal(stored, b.Msg), "a reader's change is not seen by the next reader")

	l1, err := c.List(ctx)
	require.NoError(t, err)
	l2, err := c.List(ctx)
	require.NoError(t, err)
	require.Equal(t, names(l1), names(l2))
	require.NotSame(t, l1[0].Msg, l2[0].Msg, "each List decodes")
	require.NotSame(t, c.ByIndex("rack", "rack1")[0].Msg, c.ByIndex("rack", "rack1")[0].Msg, "each ByIndex decodes")
	for _, it := range l1 {
		kept, ok := c.view.get(it.Name)
		require.True(t, ok, it.Name)
		require.Nil(t, kept.Msg, "%s is kept encoded", it.Name)
	}

	// Moving one to another rack and deleting another leave the index
	// right.
	stored.Metadata.Labels["rack"] = "rack2"
	_, err = s.Update(ctx, "hosts", "h-1", stored, rev)
	require.NoError(t, err)
	require.NoError(t, s.Delete(ctx, "hosts", "h-3", 0))
	require.Eventually(t, func() bool {
		return c.IndexLen("rack", "rack1") == 3 && c.IndexLen("rack", "rack2") == 1
	}, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, []string{"h-0", "h-2", "h-4"}, names(c.ByIndex("rack", "rack1")))
	require.Equal(t, "rack2", c.ByIndex("rack", "rack2")[0].Msg.(*typesv1.Host).GetMetadata().GetLabels()["rack"])
}

// A set of an index grows from a slice into a map and back to none: every
// name added is there once, every name removed is gone.
func TestNameSet(t *testing.T) {
	var s *nameSet
	require.Zero(t, s.len(), "a value with no set")
	s = &nameSet{}
	want := map[string]bool{}
	for i := range 3 * fewNames {
		n := fmt.Sprintf("h-%02d", i)
		s.add(n)
		s.add(n) // twice: once in the set
		want[n] = true
		require.Equal(t, len(want), s.len())
	}
	require.NotNil(t, s.many, "past fewNames names the set is a map")
	for i := range 3 * fewNames {
		n := fmt.Sprintf("h-%02d", i)
		require.Equal(t, len(want)-1, s.remove(n))
		delete(want, n)
		got := map[string]bool{}
		s.each(func(n string) { got[n] = true })
		require.Equal(t, want, got)
	}
	s = &nameSet{}
	s.add("a")
	s.add("b")
	require.Equal(t, 1, s.remove("a"))
	require.Equal(t, 1, s.remove("a"), "removing what is not there")
	got := []string{}
	s.each(func(n string) { got = append(got, n) })
	require.Equal(t, []string{"b"}, got)
}
