package store

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// holdGroups keeps s's committer from sending until release: the writes
// made meanwhile queue, so a test knows which of them go together.
// release lets as many transactions go in flight as the committer
// allows; each takes the next group of the queue, in order.
func holdGroups(t *testing.T, s *Store) (waitQueued func(n int), release func()) {
	t.Helper()
	c := s.group
	require.NotNil(t, c, "grouping is off")
	return hold(t, "writes", &c.mu, c.inFlight, &c.sending, func() int { return len(c.queue) }, c.run)
}

// hold is holdGroups and holdReads: it takes every slot of a queue's
// senders (sending, under mu, up to inFlight), so what is asked meanwhile
// queues; release starts the senders it took.
func hold(t *testing.T, what string, mu *sync.Mutex, inFlight int, sending *int, queued func() int, run func()) (waitQueued func(n int), release func()) {
	t.Helper()
	// Wait for the senders of earlier calls to finish: a sender that has
	// answered its caller but not yet given back its slot would give it
	// back after we took the rest, and the next call would start a sender
	// that empties the queue we wait on.
	var held int
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		if *sending != 0 {
			return false
		}
		held = inFlight
		*sending = inFlight
		return true
	}, time.Minute, time.Millisecond, what+" senders idle")
	waitQueued = func(n int) {
		t.Helper()
		require.Eventually(t, func() bool {
			mu.Lock()
			defer mu.Unlock()
			return queued() == n
		}, time.Minute, time.Millisecond, what+" queued")
	}
	var once sync.Once
	release = func() {
		once.Do(func() {
			for range held {
				go run()
			}
		})
	}
	t.Cleanup(release)
	return waitQueued, release
}

// changes watches every key under Prefix from revision from on until it
// has seen revision to, and returns the keys each revision changed.
func changes(t *testing.T, c *clientv3.Client, from, to int64) map[int64][]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out := map[int64][]string{}
	for resp := range c.Watch(ctx, Prefix, clientv3.WithPrefix(), clientv3.WithRev(from)) {
		require.NoError(t, resp.Err())
		// etcd sends the events of a revision in one response.
		seen := int64(0)
		for _, ev := range resp.Events {
			out[ev.Kv.ModRevision] = append(out[ev.Kv.ModRevision], string(ev.Kv.Key))
			seen = ev.Kv.ModRevision
		}
		if seen >= to {
			return out
		}
	}
	t.Fatalf("watch ended before revision %d", to)
	return nil
}

// createHosts creates n hosts h000... and returns their revisions.
func createHosts(t *testing.T, s *Store, n int) []int64 {
	t.Helper()
	revs := make([]int64, n)
	for i := range n {
		name := fmt.Sprintf("h%03d", i)
		rev, err := s.Create(context.Background(), "hosts", name, host(name, "52:54:00:00:00:01"))
		require.NoError(t, err)
		revs[i] = rev
	}
	return revs
}

// updateAll runs s.Update of host i to mac(i) with revision revs[i] in
// a goroutine each and returns the results in order, once all are
// queued (waitQueued) and released.
func updateAll(t *testing.T, stores []*Store, names []string, revs []int64, mac func(int) string, waitQueued func(int), release func()) ([]int64, []error) {
	t.Helper()
	got := make([]int64, len(names))
	errs := make([]error, len(names))
	var wg sync.WaitGroup
	for i, name := range names {
		wg.Go(func() {
			got[i], errs[i] = stores[i].Update(context.Background(), "hosts", name, host(name, mac(i)), revs[i])
		})
	}
	waitQueued(len(names))
	release()
	wg.Wait()
	return got, errs
}

func hostNames(n int) []string {
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("h%03d", i)
	}
	return names
}

func repeat(s *Store, n int) []*Store {
	out := make([]*Store, n)
	for i := range out {
		out[i] = s
	}
	return out
}

func macOf(i int) string { return fmt.Sprintf("52:54:00:00:01:%02x", i) }

// TestGroupCommitGroups: updates of distinct keys queued together go in
// one etcd transaction: each caller gets that transaction's revision, the
// watch sees every key change at it, and each value is the caller's.
func TestGroupCommitGroups(t *testing.T) {
	s, c := newStore(t)
	const n = 100
	revs := createHosts(t, s, n)
	waitQueued, release := holdGroups(t, s)
	got, errs := updateAll(t, repeat(s, n), hostNames(n), revs, macOf, waitQueued, release)
	for i, err := range errs {
		require.NoError(t, err, "Update(h%03d)", i)
	}
	for i := range got {
		require.Equal(t, got[0], got[i], "revision of update %d: not the group's", i)
	}
	byRev := changes(t, c, revs[n-1]+1, got[0])
	require.Len(t, byRev[got[0]], n, "keys changed at the group's revision %d", got[0])
	require.Len(t, byRev, 1, "revisions after the creates: %v", byRev)
	for i, name := range hostNames(n) {
		h := &typesv1.Host{}
		rev, err := s.Get(context.Background(), "hosts", name, h)
		require.NoError(t, err)
		if rev != got[i] || h.GetSpec().GetBootMac() != macOf(i) {
			t.Errorf("Get(%s) = (mac %s, rev %d), want (%s, %d)", name, h.GetSpec().GetBootMac(), rev, macOf(i), got[i])
		}
	}
}

// TestGroupCommitManyWriters: 256 goroutines update their own key over
// and over, with no holding: every update succeeds, each returned
// revision is the key's, and the updates shared transactions.
func TestGroupCommitManyWriters(t *testing.T) {
	s, c := newStore(t)
	const n, rounds = 256, 4
	revs := createHosts(t, s, n)
	txns0 := s.group.txns.Load()
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
			}
			revs[i] = rev
		})
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "Update(h%03d)", i)
	}
	last := int64(0)
	for i, name := range hostNames(n) {
		h := &typesv1.Host{}
		rev, err := s.Get(context.Background(), "hosts", name, h)
		require.NoError(t, err)
		if rev != revs[i] || h.GetMetadata().GetGeneration() != rounds {
			t.Errorf("Get(%s) = (generation %d, rev %d), want (%d, %d)", name, h.GetMetadata().GetGeneration(), rev, rounds, revs[i])
		}
		last = max(last, rev)
	}
	txns := s.group.txns.Load() - txns0
	byRev := changes(t, c, createdRev(t, c)+1, last)
	t.Logf("%d updates in %d transactions, %d revisions", n*rounds, txns, len(byRev))
	require.Less(t, len(byRev), n*rounds, "every update had a revision of its own: nothing was grouped")
}

// createdRev is the revision of the last host create (h255's).
func createdRev(t *testing.T, c *clientv3.Client) int64 {
	resp, err := c.Get(context.Background(), Key("hosts", "h"), clientv3.WithPrefix(), clientv3.WithKeysOnly())
	require.NoError(t, err)
	var maxCreate int64
	for _, kv := range resp.Kvs {
		maxCreate = max(maxCreate, kv.CreateRevision)
	}
	return maxCreate
}

// TestGroupCommitConflictInGroup: in one group, a stale update gets
// Conflict and an update of an absent host NotFound, exactly as alone,
// while the others commit.
func TestGroupCommitConflictInGroup(t *testing.T) {
	s, c := newStore(t)
	revs := createHosts(t, s, 5)
	ctx := context.Background()
	// h004 moves on: revs[4] is stale.
	_, err := s.Update(ctx, "hosts", "h004", host("h004", "52:54:00:00:00:04"), revs[4])
	require.NoError(t, err)
	names := append(hostNames(5), "absent")
	revs = append(revs, 0)
	waitQueued, release := holdGroups(t, s)
	got, errs := updateAll(t, repeat(s, len(names)), names, revs, macOf, waitQueued, release)
	for i := range 4 {
		require.NoError(t, errs[i], "Update(h%03d) in a group with a conflict", i)
		require.Equal(t, got[0], got[i], "revision of update %d", i)
	}
	if !errdefs.IsConflict(errs[4]) {
		t.Errorf("stale Update(h004) = %v, want Conflict", errs[4])
	}
	if !errdefs.IsNotFound(errs[5]) {
		t.Errorf("Update(absent) = %v, want NotFound", errs[5])
	}
	t.Logf("conflict in a group: %v", errs[4])
	byRev := changes(t, c, got[0], got[0])
	require.Len(t, byRev[got[0]], 4, "keys changed by the group")
}

// TestGroupCommitSameKey: two updates of one key from the same revision,
// queued together, go in separate transactions (etcd refuses a key put
// twice in one): one commits, the other gets Conflict, and the stored
// value is the winner's.
func TestGroupCommitSameKey(t *testing.T) {
	s, _ := newStore(t)
	revs := createHosts(t, s, 2)
	waitQueued, release := holdGroups(t, s)
	names := []string{"h000", "h001", "h000"}
	got, errs := updateAll(t, repeat(s, 3), names, []int64{revs[0], revs[1], revs[0]}, macOf, waitQueued, release)
	require.NoError(t, errs[1], "Update(h001)")
	win := 0
	switch {
	case errs[0] == nil && errdefs.IsConflict(errs[2]):
	case errs[2] == nil && errdefs.IsConflict(errs[0]):
		win = 2
	default:
		t.Fatalf("two updates of h000 from revision %d = (%v, %v), want one nil and one Conflict", revs[0], errs[0], errs[2])
	}
	h := &typesv1.Host{}
	rev, err := s.Get(context.Background(), "hosts", "h000", h)
	require.NoError(t, err)
	if rev != got[win] || h.GetSpec().GetBootMac() != macOf(win) {
		t.Errorf("Get(h000) = (mac %s, rev %d), want the winner's (%s, %d)", h.GetSpec().GetBootMac(), rev, macOf(win), got[win])
	}
}

// TestGroupCommitFenced: a fenced Store whose term ended and an unfenced
// one write in the same group: the fenced write is refused with
// ErrFenced and writes nothing; the unfenced one commits.
func TestGroupCommitFenced(t *testing.T) {
	s, c := newStore(t)
	ctx := context.Background()
	revs := createHosts(t, s, 2)
	const leaderKey = "/kiln/v1/election/controller/term-a"
	lease, err := c.Grant(ctx, 60)
	require.NoError(t, err)
	put, err := c.Put(ctx, leaderKey, "a", clientv3.WithLease(lease.ID))
	require.NoError(t, err)
	fenced := s.Fenced(Fence{Key: leaderKey, Rev: put.Header.Revision})
	require.Same(t, s.group, fenced.group, "a Fenced copy has a committer of its own")
	_, err = c.Revoke(ctx, lease.ID)
	require.NoError(t, err)

	waitQueued, release := holdGroups(t, s)
	got, errs := updateAll(t, []*Store{fenced, s}, hostNames(2), revs, macOf, waitQueued, release)
	require.True(t, errors.Is(errs[0], ErrFenced), "fenced Update after the term = %v, want ErrFenced", errs[0])
	require.True(t, errdefs.IsFailedPrecondition(errs[0]), "%v is not FailedPrecondition", errs[0])
	require.NoError(t, errs[1], "unfenced Update in the same group")
	rev, err := s.Get(ctx, "hosts", "h000", &typesv1.Host{})
	require.NoError(t, err)
	require.Equal(t, revs[0], rev, "h000 changed by a fenced write")
	rev, err = s.Get(ctx, "hosts", "h001", &typesv1.Host{})
	require.NoError(t, err)
	require.Equal(t, got[1], rev, "h001")
}

// TestGroupCommitPaused: while paused every write of a group is refused
// with ErrPaused.
func TestGroupCommitPaused(t *testing.T) {
	s, _ := newStore(t)
	revs := createHosts(t, s, 3)
	_, err := s.Pause(context.Background(), Pause{MovedTo: "other:7443", By: "test", Since: time.Now()})
	require.NoError(t, err)
	waitQueued, release := holdGroups(t, s)
	_, errs := updateAll(t, repeat(s, 3), hostNames(3), revs, macOf, waitQueued, release)
	for i, err := range errs {
		require.True(t, errors.Is(err, ErrPaused), "Update(h%03d) while paused = %v, want ErrPaused", i, err)
	}
}

// TestGroupCommitCancelled: a write whose context ends while it waits to
// be sent returns the context's error and is never sent; one whose
// context ended before the call too.
func TestGroupCommitCancelled(t *testing.T) {
	s, _ := newStore(t)
	revs := createHosts(t, s, 2)
	done, cancelDone := context.WithCancel(context.Background())
	cancelDone()
	_, err := s.Update(done, "hosts", "h000", host("h000", macOf(9)), revs[0])
	require.ErrorIs(t, err, context.Canceled, "Update with a done context")

	waitQueued, release := holdGroups(t, s)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := s.Update(ctx, "hosts", "h000", host("h000", macOf(9)), revs[0])
		errc <- err
	}()
	waitQueued(1)
	cancel()
	require.ErrorIs(t, <-errc, context.Canceled, "Update cancelled while queued")
	release()
	// The next write of the queue goes; the cancelled one did not.
	rev, err := s.Update(context.Background(), "hosts", "h001", host("h001", macOf(1)), revs[1])
	require.NoError(t, err)
	got, err := s.Get(context.Background(), "hosts", "h000", &typesv1.Host{})
	require.NoError(t, err)
	require.Equal(t, revs[0], got, "h000 written by a cancelled update (h001 at %d)", rev)
}

// TestGroupCommitSplit: a queue of more writes than MaxOps allows goes in
// several transactions, each within the bound, in order.
func TestGroupCommitSplit(t *testing.T) {
	_, c := startEtcd(t)
	// An update's transaction is 2 compares (revision, pause), 1 put, 2
	// else reads: width 2. MaxOps 10 holds 8 updates.
	s := New(c, WithGroupCommit(GroupCommit{MaxOps: 10, MaxInFlight: 1}))
	const n = 20
	revs := createHosts(t, s, n)
	waitQueued, release := holdGroups(t, s)
	got, errs := updateAll(t, repeat(s, n), hostNames(n), revs, macOf, waitQueued, release)
	for i, err := range errs {
		require.NoError(t, err, "Update(h%03d)", i)
	}
	byRev := changes(t, c, revs[n-1]+1, slicesMax(got))
	var sizes []int
	for _, rev := range sortedKeys(byRev) {
		sizes = append(sizes, len(byRev[rev]))
	}
	require.Equal(t, []int{8, 8, 4}, sizes, "keys changed per transaction")
}

// TestGroupCommitDefaultOpsFitDefaultEtcd: with the default MaxOps, a
// group of writes with events riding along (UpdateWith) fits an etcd
// started with etcd's default --max-txn-ops (128), where a group bound
// too loosely is refused, and every caller gets Unavailable.
func TestGroupCommitDefaultOpsFitDefaultEtcd(t *testing.T) {
	e, err := StartEmbedded(testCtx(t), EmbeddedConfig{DataDir: filepath.Join(t.TempDir(), "etcd"), MaxTxnOps: 128, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(e.Close)
	c, err := Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	const n = 200
	run := func(s *Store) ([]int64, []error) {
		revs := make([]int64, n)
		for i, name := range hostNames(n) {
			rev, err := s.Update(context.Background(), "hosts", name, host(name, macOf(i)), 0)
			if errdefs.IsNotFound(err) {
				rev, err = s.Create(context.Background(), "hosts", name, host(name, macOf(i)))
			}
			require.NoError(t, err)
			revs[i] = rev
		}
		waitQueued, release := holdGroups(t, s)
		got := make([]int64, n)
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i, name := range hostNames(n) {
			wg.Go(func() {
				ev := clientv3.OpPut(Prefix+"events/hosts/"+name+"/1", "event")
				got[i], _, errs[i] = s.UpdateWith(context.Background(), "hosts", name, host(name, macOf(i)), revs[i], []clientv3.Op{ev})
			})
		}
		waitQueued(n)
		release()
		wg.Wait()
		return got, errs
	}

	got, errs := run(New(c))
	for i, err := range errs {
		require.NoError(t, err, "UpdateWith(h%03d) with the default bound", i)
	}
	byRev := changes(t, c, slicesMin(got), slicesMax(got))
	for rev, keys := range byRev {
		require.LessOrEqual(t, len(keys), 2*(128-2), "keys changed at revision %d", rev)
	}
	require.Less(t, len(byRev), n, "nothing grouped")

	_, errs = run(New(c, WithGroupCommit(GroupCommit{MaxOps: 1000})))
	for i, err := range errs {
		require.True(t, errdefs.IsUnavailable(err), "UpdateWith(h%03d) in a group etcd refuses = %v, want Unavailable", i, err)
		require.True(t, strings.Contains(err.Error(), "too many operations"), "UpdateWith(h%03d) = %v, want etcd's refusal", i, err)
	}
	t.Logf("refused group: %v", errs[0])
}

func slicesMax(v []int64) int64 {
	m := v[0]
	for _, x := range v {
		m = max(m, x)
	}
	return m
}

func slicesMin(v []int64) int64 {
	m := v[0]
	for _, x := range v {
		m = min(m, x)
	}
	return m
}

func sortedKeys(m map[int64][]string) []int64 {
	keys := make([]int64, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i] < keys[j] })
	return keys
}

// TestGroupCommitNestedTxn: writes whose extra op is a transaction of its
// own (an event log's: rewrite the log if unchanged, else store the
// event alone) still go together, and each caller learns from its
// answers which branch ran.
func TestGroupCommitNestedTxn(t *testing.T) {
	s, c := newStore(t)
	const n = 20
	revs := createHosts(t, s, n)
	logRevs := map[string]int64{}
	// h000..h009 have a log the writer does not know of: their compare fails.
	for _, name := range hostNames(n)[:n/2] {
		resp, err := c.Put(context.Background(), Prefix+"events/hosts/"+name+"/log", "someone else's")
		require.NoError(t, err)
		logRevs[name] = resp.Header.Revision
	}
	txns0 := s.group.txns.Load()
	waitQueued, release := holdGroups(t, s)
	got := make([]int64, n)
	succeeded := make([]bool, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, name := range hostNames(n) {
		wg.Go(func() {
			logKey := Prefix + "events/hosts/" + name + "/log"
			op := clientv3.OpTxn(
				[]clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(logKey), "=", 0)},
				[]clientv3.Op{clientv3.OpPut(logKey, "log")},
				[]clientv3.Op{clientv3.OpPut(Prefix+"events/hosts/"+name+"/1", "event")})
			var answers []*etcdserverpb.ResponseOp
			got[i], answers, errs[i] = s.UpdateWith(context.Background(), "hosts", name, host(name, macOf(i)), revs[i], []clientv3.Op{op})
			if len(answers) == 1 {
				succeeded[i] = answers[0].GetResponseTxn().GetSucceeded()
			}
		})
	}
	waitQueued(n)
	release()
	wg.Wait()
	require.Equal(t, uint64(1), s.group.txns.Load()-txns0, "etcd transactions for %d writes", n)
	for i, name := range hostNames(n) {
		require.NoError(t, errs[i], name)
		require.Equal(t, got[0], got[i], "one revision")
		resp, err := c.Get(context.Background(), Prefix+"events/hosts/"+name+"/", clientv3.WithPrefix())
		require.NoError(t, err)
		if i < n/2 {
			require.False(t, succeeded[i], "%s: the log changed: the else branch ran", name)
			require.Len(t, resp.Kvs, 2, "%s: the other's log and the event alone", name)
			require.Equal(t, logRevs[name], resp.Kvs[1].ModRevision, "%s: the other's log is untouched", name)
		} else {
			require.True(t, succeeded[i], "%s: the log's branch ran", name)
			require.Len(t, resp.Kvs, 1, name)
			require.Equal(t, got[i], resp.Kvs[0].ModRevision, "%s: the log is at the write's revision", name)
		}
	}
}
