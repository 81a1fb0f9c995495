package store

import (
	"context"
	"maps"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestCache(t *testing.T) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	newHost := func() proto.Message { return &typesv1.Host{} }
	for _, n := range []string{"h-2", "h-1", "h-3"} {
		_, err := s.Create(ctx, "hosts", n, host(n, ""))
		require.NoError(t, err)
	}
	c := NewCache(s, "hosts", newHost)

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
