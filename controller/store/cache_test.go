package store

import (
	"context"
	"fmt"
	"maps"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestCache(t *testing.T) { eachMode(t, testCache) }

func testCache(t *testing.T, encoded bool) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	newHost := func() proto.Message { return &typesv1.Host{} }
	for _, n := range []string{"h-2", "h-1", "h-3"} {
		_, err := s.Create(ctx, "hosts", n, host(n, ""))
		require.NoError(t, err)
	}
	c := NewCache(s, "hosts", newHost)
	if encoded {
		c.KeepEncoded()
	}

	// Before its first listing, List waits (here until ctx ends).
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	_, err := c.List(short)
	cancel()
	require.ErrorIs(t, err, context.DeadlineExceeded)

	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); c.Run(rctx) }()
	t.Cleanup(func() { stop(); <-done })

	view := func() map[string]string {
		items, err := c.List(ctx)
		require.NoError(t, err)
		out := map[string]string{}
		var names []string
		for _, it := range items {
			out[it.Name] = it.Msg.(*typesv1.Host).GetSpec().GetBootMac()
			names = append(names, it.Name)
		}
		require.IsIncreasing(t, names, "in name order")
		return out
	}
	require.Equal(t, map[string]string{"h-1": "", "h-2": "", "h-3": ""}, view())

	// Changes after the listing show, with the revision Update expects.
	h := &typesv1.Host{}
	rev, err := s.Get(ctx, "hosts", "h-2", h)
	require.NoError(t, err)
	h.Spec.BootMac = "52:54:00:00:00:02"
	rev, err = s.Update(ctx, "hosts", "h-2", h, rev)
	require.NoError(t, err)
	require.NoError(t, s.Delete(ctx, "hosts", "h-3", 0))
	_, err = s.Create(ctx, "hosts", "h-0", host("h-0", "52:54:00:00:00:00"))
	require.NoError(t, err)
	want := map[string]string{"h-0": "52:54:00:00:00:00", "h-1": "", "h-2": "52:54:00:00:00:02"}
	require.Eventually(t, func() bool { return maps.Equal(view(), want) }, 10*time.Second, 10*time.Millisecond)
	items, err := c.List(ctx)
	require.NoError(t, err)
	for _, it := range items {
		if it.Name == "h-2" {
			require.Equal(t, rev, it.Rev, "h-2's revision in the cache")
		}
	}
	require.GreaterOrEqual(t, c.Revision(), rev)
}

// A kind empty at the listing: what is created after it shows (the watch
// starts at the listing's revision, not at "now").
func TestCacheEmptyKind(t *testing.T) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	c := NewCache(s, "hosts", func() proto.Message { return &typesv1.Host{} })
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); c.Run(rctx) }()
	t.Cleanup(func() { stop(); <-done })
	items, err := c.List(ctx)
	require.NoError(t, err)
	require.Empty(t, items)
	_, err = s.Create(ctx, "hosts", "h-1", host("h-1", ""))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		items, err := c.List(ctx)
		return err == nil && len(items) == 1 && items[0].Name == "h-1"
	}, 10*time.Second, 10*time.Millisecond)
}

// startCache runs c until the test ends.
func startCache(t *testing.T, ctx context.Context, c *Cache) {
	t.Helper()
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); c.Run(rctx) }()
	t.Cleanup(func() { stop(); <-done })
}

// Read-your-writes: after WaitRevision(rev of a write), List shows the
// write, with no retry in between.
func TestCacheWaitRevision(t *testing.T) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	_, err := s.Create(ctx, "hosts", "h-1", host("h-1", ""))
	require.NoError(t, err)
	c := NewCache(s, "hosts", func() proto.Message { return &typesv1.Host{} })
	startCache(t, ctx, c)

	macOf := func(name string) string {
		items, err := c.List(ctx)
		require.NoError(t, err)
		for _, it := range items {
			if it.Name == name {
				return it.Msg.(*typesv1.Host).GetSpec().GetBootMac()
			}
		}
		return "(absent)"
	}
	for i := range 20 {
		h := &typesv1.Host{}
		rev, err := s.Get(ctx, "hosts", "h-1", h)
		require.NoError(t, err)
		mac := fmt.Sprintf("52:54:00:00:00:%02x", i)
		h.Spec.BootMac = mac
		rev, err = s.Update(ctx, "hosts", "h-1", h, rev)
		require.NoError(t, err)
		require.NoError(t, c.WaitRevision(ctx, rev))
		require.Equal(t, mac, macOf("h-1"), "write %d, revision %d", i, rev)
		require.GreaterOrEqual(t, c.Revision(), rev)
	}
	rev, err := s.Create(ctx, "hosts", "h-2", host("h-2", "52:54:00:00:01:00"))
	require.NoError(t, err)
	require.NoError(t, c.WaitRevision(ctx, rev))
	require.Equal(t, "52:54:00:00:01:00", macOf("h-2"))

	// The revision of another kind's write: no host changes after it,
	// etcd's progress notification brings the cache there.
	rev, err = s.Create(ctx, "machines", "m-1", host("m-1", ""))
	require.NoError(t, err)
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	start := time.Now()
	require.NoError(t, c.WaitRevision(wctx, rev), "revision %d of a machine", rev)
	cancel()
	t.Logf("reached another kind's revision in %v", time.Since(start))

	// A revision not written yet: WaitRevision returns ctx's error.
	cctx, cancel := context.WithCancel(ctx)
	errc := make(chan error, 1)
	go func() { errc <- c.WaitRevision(cctx, rev+1000) }()
	select {
	case err := <-errc:
		t.Fatalf("WaitRevision of a future revision returned %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	cancel()
	require.ErrorIs(t, <-errc, context.Canceled)
	dctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, c.WaitRevision(dctx, rev+1000), context.DeadlineExceeded)
}

// WaitRevision waits for the first listing; a new listing (after the
// watch's history was compacted) reaches its listing's revision, a change
// its own.
func TestCacheWaitRevisionListing(t *testing.T) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	c := NewCache(s, "hosts", func() proto.Message { return &typesv1.Host{} }) // not run: the test feeds it

	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	require.ErrorIs(t, c.WaitRevision(short, 0), context.DeadlineExceeded, "before the first listing")
	cancel()

	wait := func(rev int64) <-chan error {
		errc := make(chan error, 1)
		go func() { errc <- c.WaitRevision(ctx, rev) }()
		return errc
	}
	pending := func(errc <-chan error) {
		t.Helper()
		select {
		case err := <-errc:
			t.Fatalf("WaitRevision returned %v before its revision", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
	errc := wait(10)
	pending(errc)
	c.reset(nil, 5)
	pending(errc)
	value, err := proto.Marshal(host("h-1", ""))
	require.NoError(t, err)
	require.NoError(t, c.apply(WatchEvent{Type: EventPut, Name: "h-1", Rev: 7, Value: value}))
	pending(errc)
	c.reset(nil, 12) // a new listing, at a later revision
	require.NoError(t, <-errc)

	errc = wait(13)
	pending(errc)
	require.NoError(t, c.apply(WatchEvent{Type: EventPut, Name: "h-1", Rev: 13, Value: value}))
	require.NoError(t, <-errc)
	items, err := c.List(ctx)
	require.NoError(t, err)
	require.Len(t, items, 1)
	require.Equal(t, int64(13), items[0].Rev)

	errc = wait(20)
	pending(errc)
	require.NoError(t, c.apply(WatchEvent{Type: eventProgress, Rev: 20}))
	require.NoError(t, <-errc)
}
