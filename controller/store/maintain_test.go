package store

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestCompactionTarget(t *testing.T) {
	t0 := time.Date(2026, 12, 7, 9, 0, 0, 0, time.UTC)
	// One a minute, the last one the look at t0+3m (when the time bound
	// looks at t0+4m, one look was missed).
	samples := []revAt{{t0, 100}, {t0.Add(time.Minute), 200}, {t0.Add(2 * time.Minute), 300}, {t0.Add(3 * time.Minute), 400}}
	for _, tc := range []struct {
		name      string
		c         Compaction
		now       time.Time
		cur       int64
		compacted int64
		grown     int64
		want      int64
	}{
		{"nothing older than retention", Compaction{Retention: 5 * time.Minute, MaxRevisions: -1}, t0.Add(4 * time.Minute), 400, 0, 0, 0},
		{"newest sample older than retention", Compaction{Retention: 90 * time.Second, MaxRevisions: -1}, t0.Add(3 * time.Minute), 400, 0, 0, 200},
		{"already compacted there", Compaction{Retention: 90 * time.Second, MaxRevisions: -1}, t0.Add(3 * time.Minute), 400, 200, 0, 0},
		{"revisions cut a busy history", Compaction{Retention: 5 * time.Minute, MaxRevisions: 50}, t0.Add(4 * time.Minute), 400, 0, 0, 350},
		{"time cuts deeper than revisions", Compaction{Retention: 30 * time.Second, MaxRevisions: 350}, t0.Add(3 * time.Minute), 400, 0, 0, 300},
		{"revision bound not reached", Compaction{Retention: -1, MaxRevisions: 1000}, t0.Add(time.Hour), 400, 0, 0, 0},
		{"no bounds", Compaction{Retention: -1, MaxRevisions: -1, MaxHistoryBytes: -1}, t0.Add(time.Hour), 400, 0, 1 << 40, 0},
		{"history bytes: keeps the last look's", Compaction{Retention: -1, MaxRevisions: -1, MaxHistoryBytes: 100}, t0.Add(3 * time.Minute), 400, 0, 100, 300},
		{"history bytes not reached", Compaction{Retention: -1, MaxRevisions: -1, MaxHistoryBytes: 100}, t0.Add(3 * time.Minute), 400, 0, 99, 0},
		{"history bytes cut deeper than time", Compaction{Retention: 90 * time.Second, MaxRevisions: -1, MaxHistoryBytes: 100}, t0.Add(3 * time.Minute), 400, 0, 150, 300},
		{"history bytes, already compacted there", Compaction{Retention: -1, MaxRevisions: -1, MaxHistoryBytes: 100}, t0.Add(3 * time.Minute), 400, 300, 500, 0},
		{"history bytes and revisions: the deeper", Compaction{Retention: -1, MaxRevisions: 50, MaxHistoryBytes: 100}, t0.Add(3 * time.Minute), 400, 0, 150, 350},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.c.target(samples, tc.now, tc.cur, tc.compacted, tc.grown); got != tc.want {
				t.Errorf("%+v.target(now %v, cur %d, compacted %d) = %d, want %d", tc.c, tc.now.Sub(t0), tc.cur, tc.compacted, got, tc.want)
			}
		})
	}
}

func TestDefragDue(t *testing.T) {
	t0 := time.Date(2026, 12, 7, 9, 0, 0, 0, time.UTC)
	const mib = 1 << 20
	for _, tc := range []struct {
		name         string
		size, inUse  int64
		since, every time.Duration
		want         bool
	}{
		{"half free", 1000 * mib, 400 * mib, 2 * time.Hour, time.Hour, true},
		{"too soon", 1000 * mib, 400 * mib, 30 * time.Minute, time.Hour, false},
		{"little free", 1000 * mib, 800 * mib, 2 * time.Hour, time.Hour, false},
		{"half free but small", 100 * mib, 40 * mib, 2 * time.Hour, time.Hour, false},
		{"near the quota, a quarter free", 1800 * mib, 1350 * mib, 2 * time.Hour, time.Hour, true},
		{"disabled", 1000 * mib, 100 * mib, 2 * time.Hour, -1, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := defragDue(tc.size, tc.inUse, DefaultQuotaBytes, t0, t0.Add(tc.since), tc.every); got != tc.want {
				t.Errorf("defragDue(%d MiB, %d MiB in use, after %v, every %v) = %v, want %v", tc.size/mib, tc.inUse/mib, tc.since, tc.every, got, tc.want)
			}
		})
	}
}

// TestCompactionApplied writes to a member that keeps 200 ms of history:
// the history of the first write is compacted while its key lives on.
func TestCompactionApplied(t *testing.T) {
	ctx := testCtx(t)
	e, err := StartEmbedded(ctx, EmbeddedConfig{DataDir: filepath.Join(t.TempDir(), "etcd"), Logger: testLogger(t),
		Compaction: Compaction{Retention: 200 * time.Millisecond, MaxRevisions: -1}})
	require.NoError(t, err)
	t.Cleanup(e.Close)
	c, err := Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })

	first, err := c.Put(ctx, "/kiln/v1/test/a", "1")
	require.NoError(t, err)
	old := first.Header.Revision
	for i := range 20 {
		_, err := c.Put(ctx, "/kiln/v1/test/a", fmt.Sprint(i+2))
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool {
		_, err := c.Get(ctx, "/kiln/v1/test/a", clientv3.WithRev(old))
		return err != nil
	}, time.Minute, 50*time.Millisecond, "revision %d never compacted", old)
	_, err = c.Get(ctx, "/kiln/v1/test/a", clientv3.WithRev(old))
	require.ErrorIs(t, err, rpctypes.ErrCompacted, "Get at revision %d", old)
	resp, err := c.Get(ctx, "/kiln/v1/test/a")
	require.NoError(t, err)
	require.Equal(t, "21", string(resp.Kvs[0].Value), "the key's current value")
}

// TestCompactionBoundByHistoryBytes writes 4 MiB of versions of one key
// to a member with no time or revision bound and at most 1 MiB of
// history: the old versions are compacted, as a wave's would be long
// before the 5 minutes of history the time bound keeps.
func TestCompactionBoundByHistoryBytes(t *testing.T) {
	ctx := testCtx(t)
	e, err := StartEmbedded(ctx, EmbeddedConfig{DataDir: filepath.Join(t.TempDir(), "etcd"), Logger: testLogger(t),
		Compaction: Compaction{Retention: -1, MaxRevisions: -1, MaxHistoryBytes: 1 << 20}, DefragInterval: -1, maintainEvery: 20 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(e.Close)
	c, err := Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })

	value := strings.Repeat("x", 64<<10)
	first, err := c.Put(ctx, "/kiln/v1/test/big", value+"0")
	require.NoError(t, err)
	old := first.Header.Revision
	for i := range 64 {
		_, err := c.Put(ctx, "/kiln/v1/test/big", value+fmt.Sprint(i+1))
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool {
		_, err := c.Get(ctx, "/kiln/v1/test/big", clientv3.WithRev(old))
		return err != nil
	}, time.Minute, 50*time.Millisecond, "revision %d never compacted with 4 MiB of history", old)
	_, err = c.Get(ctx, "/kiln/v1/test/big", clientv3.WithRev(old))
	require.ErrorIs(t, err, rpctypes.ErrCompacted, "Get at revision %d", old)
	resp, err := c.Get(ctx, "/kiln/v1/test/big")
	require.NoError(t, err)
	require.Equal(t, value+"64", string(resp.Kvs[0].Value), "the key's current value")
}

// TestCacheRelistsAfterCompaction cuts a Cache off its etcd member (a
// network partition), changes the hosts and lets the member compact the
// history the Cache's watch would resume from: once the partition heals,
// the Cache lists again and holds what the store holds (decoded, or
// encoded as the caches of Hosts and Machines are).
func TestCacheRelistsAfterCompaction(t *testing.T) { eachMode(t, testCacheRelistsAfterCompaction) }

func testCacheRelistsAfterCompaction(t *testing.T, encoded bool) {
	ctx := testCtx(t)
	curl, err := FreeLoopbackURL()
	require.NoError(t, err)
	e, err := StartEmbedded(ctx, EmbeddedConfig{DataDir: filepath.Join(t.TempDir(), "etcd"), ClientURL: curl, Logger: testLogger(t),
		Compaction: Compaction{Retention: 100 * time.Millisecond, MaxRevisions: -1}})
	require.NoError(t, err)
	t.Cleanup(e.Close)
	direct, err := Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { direct.Close() })
	writer := New(direct, WithLogger(testLogger(t)))

	p := newCutProxy(t, strings.TrimPrefix(curl, "http://"))
	viaProxy, err := Dial([]string{"http://" + p.addr()}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { viaProxy.Close() })
	reader := New(viaProxy, WithLogger(testLogger(t)))

	for _, n := range []string{"h-1", "h-2", "h-3"} {
		_, err := writer.Create(ctx, "hosts", n, host(n, ""))
		require.NoError(t, err)
	}
	c := NewCache(reader, "hosts", func() proto.Message { return &typesv1.Host{} })
	if encoded {
		c.KeepEncoded()
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); c.Run(rctx) }()
	t.Cleanup(func() { stop(); <-done })
	names := func() []string {
		items, err := c.List(ctx)
		require.NoError(t, err)
		var out []string
		for _, it := range items {
			out = append(out, it.Name)
		}
		return out
	}
	require.Equal(t, []string{"h-1", "h-2", "h-3"}, names())
	behind := c.Revision()

	p.cut()
	require.NoError(t, writer.Delete(ctx, "hosts", "h-1", 0))
	_, err = writer.Create(ctx, "hosts", "h-4", host("h-4", ""))
	require.NoError(t, err)
	// Wait for the compaction past the Cache's revision.
	require.Eventually(t, func() bool {
		_, err := direct.Get(ctx, "/kiln/v1/hosts/h-2", clientv3.WithRev(behind+1))
		return err != nil
	}, time.Minute, 50*time.Millisecond, "revision %d never compacted", behind+1)
	require.Equal(t, []string{"h-1", "h-2", "h-3"}, names(), "cut off, the Cache holds what it had")
	p.mend()

	require.Eventually(t, func() bool {
		n := names()
		return len(n) == 3 && n[0] == "h-2" && n[2] == "h-4"
	}, time.Minute, 50*time.Millisecond, "the Cache never caught up: %v", names())
	require.Equal(t, []string{"h-2", "h-3", "h-4"}, names())
}

// TestDefragmentAtStart fills a member, deletes everything and restarts
// it: the database file shrinks.
func TestDefragmentAtStart(t *testing.T) {
	ctx := testCtx(t)
	dir := filepath.Join(t.TempDir(), "etcd")
	cfg := EmbeddedConfig{DataDir: dir, Logger: testLogger(t), Compaction: Compaction{Retention: 100 * time.Millisecond, MaxRevisions: -1}, DefragInterval: -1}
	e, err := StartEmbedded(ctx, cfg)
	require.NoError(t, err)
	fillAndEmpty(t, e)
	e.Close()
	full := dbSize(t, dir)
	require.Greater(t, full, int64(100<<20), "database file after 100 MiB of writes")

	e, err = StartEmbedded(ctx, cfg)
	require.NoError(t, err)
	e.Close()
	if got := dbSize(t, dir); got > full/4 {
		t.Errorf("database file after a restart = %d MiB, want < %d MiB (a quarter of %d MiB)", got>>20, full>>22, full>>20)
	}
}

// TestDefragmentWhileRunning fills a member, deletes everything and
// waits: the running member defragments (its interval here is 1 ns).
func TestDefragmentWhileRunning(t *testing.T) {
	ctx := testCtx(t)
	dir := filepath.Join(t.TempDir(), "etcd")
	e, err := StartEmbedded(ctx, EmbeddedConfig{DataDir: dir, Logger: testLogger(t),
		Compaction: Compaction{Retention: 100 * time.Millisecond, MaxRevisions: -1}, DefragInterval: time.Nanosecond, maintainEvery: 20 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(e.Close)
	fillAndEmpty(t, e)
	require.Eventually(t, func() bool { return dbSize(t, dir) < 20<<20 }, time.Minute, 50*time.Millisecond,
		"database file never shrank below 20 MiB after its 100 MiB were deleted: %d MiB", dbSize(t, dir)>>20)
}

// fillAndEmpty writes 100 MiB to e, deletes it and waits until the
// compaction has freed its pages.
func fillAndEmpty(t *testing.T, e *Embedded) {
	t.Helper()
	ctx := testCtx(t)
	c, err := Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	defer c.Close()
	value := strings.Repeat("x", 1<<20)
	for i := range 100 {
		_, err := c.Put(ctx, fmt.Sprintf("/kiln/v1/test/%03d", i), value)
		require.NoError(t, err)
	}
	resp, err := c.Delete(ctx, "/kiln/v1/test/", clientv3.WithPrefix())
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		_, err := c.Get(ctx, "/kiln/v1/test/000", clientv3.WithRev(resp.Header.Revision-1))
		return err != nil
	}, time.Minute, 50*time.Millisecond, "deleted values never compacted")
	require.Eventually(t, func() bool { return e.etcd.Server.Backend().SizeInUse() < 20<<20 }, time.Minute, 50*time.Millisecond,
		"the compaction never freed the deleted values' pages")
}

func dbSize(t *testing.T, dir string) int64 {
	st, err := os.Stat(filepath.Join(dir, "member", "snap", "db"))
	require.NoError(t, err)
	return st.Size()
}

// TestQuotaWarning fills a member with a 32 MiB quota past 80 % of it:
// the member warns.
func TestQuotaWarning(t *testing.T) {
	ctx := testCtx(t)
	logs := &logRecorder{}
	e, err := StartEmbedded(ctx, EmbeddedConfig{DataDir: filepath.Join(t.TempDir(), "etcd"), Logger: slog.New(logs),
		QuotaBytes: 32 << 20, maintainEvery: 20 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(e.Close)
	c, err := Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	value := strings.Repeat("x", 1<<20)
	near := func() bool { return nearQuota(e.etcd.Server.Backend().Size(), 32<<20) }
	for i := 0; i < 32 && !near(); i++ {
		_, err := c.Put(ctx, fmt.Sprintf("/kiln/v1/test/%d", i), value)
		require.NoError(t, err, "put %d MiB: etcd refused a write before its database reached 80 %% of the quota", i+1)
	}
	// The file grows when the backend commits (every 100 ms), not with
	// each put: give it time.
	require.Eventually(t, near, 30*time.Second, 20*time.Millisecond,
		"32 MiB written, the database never reached 80 %% of its 32 MiB quota: %d MiB", e.etcd.Server.Backend().Size()>>20)
	require.Eventually(t, func() bool { return logs.has("database near its quota") }, time.Minute, 20*time.Millisecond,
		"no warning with a %d MiB database and a 32 MiB quota", e.etcd.Server.Backend().Size()>>20)
}

func TestNearQuota(t *testing.T) {
	const mib = 1 << 20
	for _, tc := range []struct {
		size, quota int64
		want        bool
	}{
		{1000 * mib, 2048 * mib, false},
		{1638 * mib, 2048 * mib, false},
		{1639 * mib, 2048 * mib, true},
		{2048 * mib, 2048 * mib, true},
	} {
		if got := nearQuota(tc.size, tc.quota); got != tc.want {
			t.Errorf("nearQuota(%d MiB, %d MiB) = %v, want %v", tc.size/mib, tc.quota/mib, got, tc.want)
		}
	}
}

// logRecorder is a slog.Handler that keeps the messages.
type logRecorder struct {
	mu   sync.Mutex
	msgs []string
}

func (r *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (r *logRecorder) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.msgs = append(r.msgs, rec.Message)
	return nil
}
func (r *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *logRecorder) WithGroup(string) slog.Handler      { return r }

func (r *logRecorder) has(part string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, m := range r.msgs {
		if strings.Contains(m, part) {
			return true
		}
	}
	return false
}

// cutProxy forwards loopback TCP connections to a target until cut,
// which closes every connection and refuses new ones until mend.
type cutProxy struct {
	l      net.Listener
	target string
	mu     sync.Mutex
	down   bool
	conns  map[net.Conn]struct{}
}

func newCutProxy(t *testing.T, target string) *cutProxy {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &cutProxy{l: l, target: target, conns: map[net.Conn]struct{}{}}
	go p.serve()
	t.Cleanup(func() { l.Close(); p.cut() })
	return p
}

func (p *cutProxy) addr() string { return p.l.Addr().String() }

func (p *cutProxy) serve() {
	for {
		in, err := p.l.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		down := p.down
		p.mu.Unlock()
		if down {
			in.Close()
			continue
		}
		out, err := net.Dial("tcp", p.target)
		if err != nil {
			in.Close()
			continue
		}
		p.mu.Lock()
		p.conns[in], p.conns[out] = struct{}{}, struct{}{}
		p.mu.Unlock()
		go func() { io.Copy(out, in); out.Close() }()
		go func() { io.Copy(in, out); in.Close() }()
	}
}

func (p *cutProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = true
	for c := range p.conns {
		c.Close()
		delete(p.conns, c)
	}
}

func (p *cutProxy) mend() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = false
}

// TestAloneMemberSnapshotsOften: a member alone keeps a short raft log
// in memory (configureRaftLogAlone): after aloneSnapshotCount writes it
// has taken a raft snapshot, where etcd's default waits for 10,000.
func TestAloneMemberSnapshotsOften(t *testing.T) {
	ctx := testCtx(t)
	dir := filepath.Join(t.TempDir(), "etcd")
	e, err := StartEmbedded(ctx, EmbeddedConfig{DataDir: dir, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(e.Close)
	c, err := Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	snaps := func() []string {
		m, err := filepath.Glob(filepath.Join(dir, "member", "snap", "*.snap"))
		require.NoError(t, err)
		return m
	}
	require.Empty(t, snaps(), "a snapshot before any write")
	for i := range aloneSnapshotCount + 10 {
		_, err := c.Put(ctx, "/kiln/v1/test/n", fmt.Sprint(i))
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { return len(snaps()) > 0 }, 30*time.Second, 50*time.Millisecond,
		"no raft snapshot after %d writes", aloneSnapshotCount+10)
}
