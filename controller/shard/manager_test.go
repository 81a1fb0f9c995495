package shard_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/controller/shard"
	"github.com/kilnhq/kiln/controller/store"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

const (
	testShards = 12
	testTTL    = 2 * time.Second
)

// running tracks which member runs each shard's work, and fails the test
// when two run one shard at once.
type running struct {
	t  *testing.T
	mu sync.Mutex
	by map[int]string
}

func (r *running) work(id string) shard.Work {
	return func(ctx context.Context, s int, _ store.Fence) {
		r.mu.Lock()
		if o, ok := r.by[s]; ok {
			r.t.Errorf("shard %d: work started by %s while %s runs it", s, id, o)
		}
		r.by[s] = id
		r.mu.Unlock()
		<-ctx.Done()
		r.mu.Lock()
		delete(r.by, s)
		r.mu.Unlock()
	}
}

type member struct {
	m      *shard.Manager
	client *clientv3.Client
	cancel context.CancelFunc
	done   chan struct{}
}

func startMember(t *testing.T, endpoints []string, id string, work shard.Work) *member {
	t.Helper()
	c, err := store.Dial(endpoints, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	mb := &member{client: c, cancel: cancel, done: make(chan struct{})}
	mb.m = shard.NewManager(c, shard.Config{ID: id, Shards: testShards, TTL: testTTL}, work, slog.New(slog.DiscardHandler))
	go func() { defer close(mb.done); _ = mb.m.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-mb.done; c.Close() })
	return mb
}

// owners reads who holds each shard key.
func owners(ctx context.Context, t *testing.T, c *clientv3.Client) map[int]string {
	t.Helper()
	resp, err := c.Get(ctx, shard.KeyPrefix, clientv3.WithPrefix())
	require.NoError(t, err)
	out := map[int]string{}
	for _, kv := range resp.Kvs {
		var n int
		_, err := fmt.Sscanf(string(kv.Key), shard.KeyPrefix+"%d", &n)
		require.NoError(t, err)
		out[n] = string(kv.Value)
	}
	return out
}

// waitBalanced waits until every shard is held and the loads of want's
// members are equal to want, and returns how long it took.
func waitBalanced(ctx context.Context, t *testing.T, c *clientv3.Client, want map[string]int) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		got := map[string]int{}
		o := owners(ctx, t, c)
		for _, id := range o {
			got[id]++
		}
		if len(o) == testShards && fmt.Sprint(got) == fmt.Sprint(want) {
			return time.Since(start)
		}
		if ctx.Err() != nil {
			t.Fatalf("shard loads = %v (%d shards held), want %v", got, len(o), want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestManagers runs three members on a real etcd: they split 12 shards
// 4/4/4; one stopping releases its shards, which the others take within
// two lease TTLs; one dying (its etcd client closed: no release, its lease
// expires) loses its shards to the survivor within two TTLs, and a write
// fenced on one of them is refused; it joins again and gets its share. No
// shard's work ever runs on two members at once, and the audit log shows
// no overlapping ownership.
func TestManagers(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e, err := store.StartEmbedded(ctx, store.EmbeddedConfig{DataDir: filepath.Join(t.TempDir(), "etcd")})
	require.NoError(t, err)
	t.Cleanup(e.Close)
	obs, err := store.Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	defer obs.Close()
	r := &running{t: t, by: map[int]string{}}

	a := startMember(t, e.Endpoints(), "a", r.work("a"))
	waitBalanced(ctx, t, obs, map[string]int{"a": 12})
	b := startMember(t, e.Endpoints(), "b", r.work("b"))
	c := startMember(t, e.Endpoints(), "c", r.work("c"))
	d := waitBalanced(ctx, t, obs, map[string]int{"a": 4, "b": 4, "c": 4})
	t.Logf("two joiners balanced in %v", d.Round(time.Millisecond))
	require.Len(t, a.m.Held(), 4)

	// c stops: it releases, a and b take its shards.
	c.cancel()
	<-c.done
	d = waitBalanced(ctx, t, obs, map[string]int{"a": 6, "b": 6})
	t.Logf("a leaver's shards moved in %v", d.Round(time.Millisecond))
	require.Less(t, d, 2*testTTL, "shards of a stopped member moved after %v, want within two TTLs", d)

	// b dies: no release; its lease expires on the etcd side.
	var fence store.Fence
	for s, rev := range b.m.Held() {
		fence = store.Fence{Key: shard.Key(s), Rev: rev, Held: fmt.Sprintf("shard %d", s)}
		break
	}
	require.NotEmpty(t, fence.Key)
	died := time.Now()
	require.NoError(t, b.client.Close())
	d = waitBalanced(ctx, t, obs, map[string]int{"a": 12})
	t.Logf("a dead member's shards moved in %v after its client closed", time.Since(died).Round(time.Millisecond))
	require.Less(t, time.Since(died), 2*testTTL+time.Second, "shards of a dead member moved after %v, want within two TTLs (+1s of etcd's lease checks)", time.Since(died))
	_, err = store.New(obs).Fenced(fence).Create(ctx, "hosts", "fenced-probe", &typesv1.Host{Metadata: &typesv1.ObjectMeta{Name: "fenced-probe"}})
	require.True(t, errors.Is(err, store.ErrFenced), "write fenced on %s@%d after the shard moved: err = %v, want ErrFenced", fence.Key, fence.Rev, err)
	require.ErrorContains(t, err, "no longer holds "+fence.Held, "the refusal names the shard, not the leader")

	// b comes back (a new process, same ID).
	b.cancel()
	<-b.done
	startMember(t, e.Endpoints(), "b", r.work("b"))
	d = waitBalanced(ctx, t, obs, map[string]int{"a": 6, "b": 6})
	t.Logf("a rejoining member got its share in %v", d.Round(time.Millisecond))

	recs, err := shard.ReadAudit(ctx, obs)
	require.NoError(t, err)
	overlaps, err := shard.Check(recs)
	require.NoError(t, err)
	require.Empty(t, overlaps)
	kinds := map[string]int{}
	for _, rc := range recs {
		kinds[rc.Kind]++
	}
	t.Logf("audit: %d records %v", len(recs), kinds)
	require.Positive(t, kinds[shard.KindLost], "the dead member's shards are recorded lost")
	require.Positive(t, kinds[shard.KindRelease], "the leaver's shards are recorded released")
}
