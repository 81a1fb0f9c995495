package store

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// holdReads keeps s's reader from sending until release: the Gets made
// meanwhile queue, so a test knows which of them go together. release
// lets as many groups go in flight as the reader allows; each takes the
// next group of the queue, in order.
func holdReads(t *testing.T, s *Store) (waitQueued func(n int), release func()) {
	t.Helper()
	rd := s.reads
	require.NotNil(t, rd, "read grouping is off")
	return hold(t, "Gets", &rd.mu, rd.inFlight, &rd.sending, func() int { return len(rd.queue) }, rd.run)
}

type getResult struct {
	mac string
	rev int64
	err error
}

// getAll runs s.Get of each name in a goroutine each and returns the results in order, once all are queued
// and released.
func getAll(t *testing.T, s *Store, names []string, waitQueued func(int), release func()) []getResult {
	t.Helper()
	out := make([]getResult, len(names))
	var wg sync.WaitGroup
	for i, name := range names {
		wg.Go(func() {
			h := &typesv1.Host{}
			rev, err := s.Get(context.Background(), "hosts", name, h)
			out[i] = getResult{mac: h.GetSpec().GetBootMac(), rev: rev, err: err}
		})
	}
	waitQueued(len(names))
	release()
	wg.Wait()
	return out
}

// TestGroupReadsGroups: Gets of distinct keys queued together go in one
// etcd request, and each caller gets its own host's value and mod
// revision.
func TestGroupReadsGroups(t *testing.T) {
	s, _ := newStore(t)
	const n = 100
	revs := createHosts(t, s, n)
	// Give each host its own value.
	for i, name := range hostNames(n) {
		rev, err := s.Update(context.Background(), "hosts", name, host(name, macOf(i)), revs[i])
		require.NoError(t, err)
		revs[i] = rev
	}
	txns0, gets0 := s.reads.txns.Load(), s.reads.gets.Load()
	waitQueued, release := holdReads(t, s)
	got := getAll(t, s, hostNames(n), waitQueued, release)
	for i, g := range got {
		require.NoError(t, g.err, "Get(h%03d)", i)
		if g.mac != macOf(i) || g.rev != revs[i] {
			t.Errorf("Get(h%03d) = (mac %s, rev %d), want (%s, %d)", i, g.mac, g.rev, macOf(i), revs[i])
		}
	}
	require.Equal(t, uint64(1), s.reads.txns.Load()-txns0, "etcd requests for %d queued Gets", n)
	require.Equal(t, uint64(n), s.reads.gets.Load()-gets0, "gets in the group")
}

// TestGroupReadsSameKey: Gets of one key in a group share its get.
func TestGroupReadsSameKey(t *testing.T) {
	s, _ := newStore(t)
	revs := createHosts(t, s, 2)
	txns0, gets0, reads0 := s.reads.txns.Load(), s.reads.gets.Load(), s.reads.reads.Load()
	waitQueued, release := holdReads(t, s)
	got := getAll(t, s, []string{"h000", "h001", "h000", "h000"}, waitQueued, release)
	for i, g := range got {
		require.NoError(t, g.err, "Get %d", i)
	}
	require.Equal(t, []int64{revs[0], revs[1], revs[0], revs[0]}, []int64{got[0].rev, got[1].rev, got[2].rev, got[3].rev}, "revisions")
	require.Equal(t, uint64(1), s.reads.txns.Load()-txns0, "etcd requests")
	require.Equal(t, uint64(2), s.reads.gets.Load()-gets0, "gets for two distinct keys")
	require.Equal(t, uint64(4), s.reads.reads.Load()-reads0, "Gets answered")
}

// TestGroupReadsAfterUpdate: a Get that starts after an Update returned
// sees the update, grouped with Gets of other hosts.
func TestGroupReadsAfterUpdate(t *testing.T) {
	s, _ := newStore(t)
	revs := createHosts(t, s, 10)
	txns0 := s.reads.txns.Load()
	// Read h000 once so the update below replaces what a stale read
	// would return.
	rev, err := s.Get(context.Background(), "hosts", "h000", &typesv1.Host{})
	require.NoError(t, err)
	require.Equal(t, revs[0], rev)
	waitQueued, release := holdReads(t, s)
	updated, err := s.Update(context.Background(), "hosts", "h000", host("h000", macOf(42)), revs[0])
	require.NoError(t, err)
	got := getAll(t, s, hostNames(10), waitQueued, release)
	require.NoError(t, got[0].err)
	if got[0].mac != macOf(42) || got[0].rev != updated {
		t.Errorf("Get(h000) after Update = (mac %s, rev %d), want (%s, %d)", got[0].mac, got[0].rev, macOf(42), updated)
	}
	for i := 1; i < 10; i++ {
		require.NoError(t, got[i].err, "Get(h%03d)", i)
		require.Equal(t, revs[i], got[i].rev, "Get(h%03d)", i)
	}
	require.Equal(t, uint64(2), s.reads.txns.Load()-txns0, "etcd requests: the first Get, then the group")
}

// TestGroupReadsNotFound: an absent host's Get in a group with present
// ones returns NotFound; the others their hosts.
func TestGroupReadsNotFound(t *testing.T) {
	s, _ := newStore(t)
	revs := createHosts(t, s, 2)
	txns0 := s.reads.txns.Load()
	waitQueued, release := holdReads(t, s)
	got := getAll(t, s, []string{"h000", "absent", "h001"}, waitQueued, release)
	require.NoError(t, got[0].err)
	require.NoError(t, got[2].err)
	require.Equal(t, revs[0], got[0].rev)
	require.Equal(t, revs[1], got[2].rev)
	if !errdefs.IsNotFound(got[1].err) {
		t.Errorf("Get(absent) in a group = %v, want NotFound", got[1].err)
	}
	require.Equal(t, uint64(1), s.reads.txns.Load()-txns0, "etcd requests")
}

// TestGroupReadsCancelled: a Get whose context ended before the call, or
// ends while it waits to be sent, returns the context's error and is not
// sent.
func TestGroupReadsCancelled(t *testing.T) {
	s, _ := newStore(t)
	createHosts(t, s, 2)
	done, cancelDone := context.WithCancel(context.Background())
	cancelDone()
	_, err := s.Get(done, "hosts", "h000", &typesv1.Host{})
	require.ErrorIs(t, err, context.Canceled, "Get with a done context")

	gets0 := s.reads.gets.Load()
	waitQueued, release := holdReads(t, s)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := s.Get(ctx, "hosts", "h000", &typesv1.Host{})
		errc <- err
	}()
	waitQueued(1)
	cancel()
	require.ErrorIs(t, <-errc, context.Canceled, "Get cancelled while queued")
	got := getAll(t, s, []string{"h001"}, func(n int) { waitQueued(n + 1) }, release)
	require.NoError(t, got[0].err, "Get(h001)")
	require.Equal(t, uint64(1), s.reads.gets.Load()-gets0, "gets sent: h001's only")
}

// TestGroupReadsSplit: more distinct keys queued than MaxOps allows go in
// several requests, each within the bound.
func TestGroupReadsSplit(t *testing.T) {
	_, c := startEtcd(t)
	s := New(c, WithGroupCommit(GroupCommit{MaxOps: 8, MaxInFlight: 1}))
	const n = 20
	revs := createHosts(t, s, n)
	waitQueued, release := holdReads(t, s)
	got := getAll(t, s, hostNames(n), waitQueued, release)
	for i, g := range got {
		require.NoError(t, g.err, "Get(h%03d)", i)
		require.Equal(t, revs[i], g.rev, "Get(h%03d)", i)
	}
	require.Equal(t, uint64(3), s.reads.txns.Load(), "etcd requests for %d Gets of at most 8 keys", n)
}

// TestGroupReadsOff: Disabled and DisableReads send Gets alone.
func TestGroupReadsOff(t *testing.T) {
	_, c := startEtcd(t)
	for _, g := range []GroupCommit{{Disabled: true}, {DisableReads: true}} {
		s := New(c, WithGroupCommit(g))
		require.Nil(t, s.reads, "reader with %+v", g)
		require.Equal(t, g.Disabled, s.group == nil, "committer with %+v", g)
	}
	s := New(c, WithGroupCommit(GroupCommit{DisableReads: true}))
	_, err := s.Create(context.Background(), "hosts", "h000", host("h000", macOf(0)))
	require.NoError(t, err)
	h := &typesv1.Host{}
	_, err = s.Get(context.Background(), "hosts", "h000", h)
	require.NoError(t, err)
	require.Equal(t, macOf(0), h.GetSpec().GetBootMac())
	_, err = s.Get(context.Background(), "hosts", "absent", h)
	require.True(t, errdefs.IsNotFound(err), "Get(absent) = %v, want NotFound", err)
}

// TestGroupReadsEtcdError: an etcd error reaches every Get of the group
// as Unavailable.
func TestGroupReadsEtcdError(t *testing.T) {
	e, _ := startEtcd(t)
	c, err := Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	s := New(c)
	createHosts(t, s, 2)
	waitQueued, release := holdReads(t, s)
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i, name := range []string{"h000", "h001", "absent"} {
		wg.Go(func() { _, errs[i] = s.Get(context.Background(), "hosts", name, &typesv1.Host{}) })
	}
	waitQueued(3)
	require.NoError(t, c.Close())
	release()
	wg.Wait()
	for i, err := range errs {
		require.True(t, errdefs.IsUnavailable(err), "Get %d on a closed client = %v, want Unavailable", i, err)
	}
	t.Logf("grouped Get on a closed client: %v", errs[0])
}

// TestGroupReadsReadYourWrites: 256 goroutines update their own host and
// read it back, over and over, with no holding: each Get sees the
// revision its caller's Update returned, and the Gets shared requests.
func TestGroupReadsReadYourWrites(t *testing.T) {
	s, _ := newStore(t)
	const n, rounds = 256, 4
	revs := createHosts(t, s, n)
	txns0, reads0 := s.reads.txns.Load(), s.reads.reads.Load()
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i, name := range hostNames(n) {
		wg.Go(func() {
			rev := revs[i]
			for r := range rounds {
				h := host(name, macOf(i))
				h.Metadata.Generation = int64(r + 1)
				if rev, errs[i] = s.Update(context.Background(), "hosts", name, h, rev); errs[i] != nil {
					return
				}
				got := &typesv1.Host{}
				gotRev, err := s.Get(context.Background(), "hosts", name, got)
				if err != nil {
					errs[i] = err
					return
				}
				if gotRev != rev || got.GetMetadata().GetGeneration() != int64(r+1) {
					errs[i] = fmt.Errorf("Get(%s) after Update = (generation %d, rev %d), want (%d, %d)", name, got.GetMetadata().GetGeneration(), gotRev, r+1, rev)
					return
				}
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "h%03d", i)
	}
	txns, reads := s.reads.txns.Load()-txns0, s.reads.reads.Load()-reads0
	t.Logf("%d Gets in %d requests", reads, txns)
	require.Equal(t, uint64(n*rounds), reads, "Gets answered by the reader")
	require.Less(t, txns, reads, "every Get had a request of its own: nothing was grouped")
}

// A controller on its embedded etcd groups writes up to MaxBatchOps
// operations; its reads stay at MaxReadGroup keys, so an answer stays
// about a megabyte.
func TestReadGroupBound(t *testing.T) {
	for _, tc := range []struct{ maxOps, want int }{{0, DefaultGroupMaxOps}, {10, 10}, {MaxBatchOps, MaxReadGroup}} {
		if got := newReader(nil, GroupCommit{MaxOps: tc.maxOps}).maxOps; got != tc.want {
			t.Errorf("MaxOps %d: a read group of %d keys, want %d", tc.maxOps, got, tc.want)
		}
	}
}
