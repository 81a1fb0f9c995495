package store

import (
	"bytes"
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// The benchmarks run against a single-member embedded etcd in a temporary
// directory, as the default controller does; each write is an fsynced raft
// commit.

func BenchmarkCreate(b *testing.B) {
	s, _ := newStore(b)
	ctx := testCtx(b)
	i := 0
	for b.Loop() {
		name := fmt.Sprintf("host-%06d", i)
		if _, err := s.Create(ctx, "hosts", name, host(name, "52:54:00:00:00:01")); err != nil {
			b.Fatal(err)
		}
		i++
	}
}

func BenchmarkGet(b *testing.B) {
	s, _ := newStore(b)
	ctx := testCtx(b)
	_, err := s.Create(ctx, "hosts", "rack1-01", host("rack1-01", "52:54:00:00:00:01"))
	require.NoError(b, err)
	var h typesv1.Host
	for b.Loop() {
		if _, err := s.Get(ctx, "hosts", "rack1-01", &h); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkUpdate(b *testing.B) {
	s, _ := newStore(b)
	ctx := testCtx(b)
	h := host("rack1-01", "52:54:00:00:00:01")
	rev, err := s.Create(ctx, "hosts", "rack1-01", h)
	require.NoError(b, err)
	for b.Loop() {
		h.Metadata.Generation++
		if rev, err = s.Update(ctx, "hosts", "rack1-01", h, rev); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkUpdateParallel updates 256 hosts at once, each from its own
// goroutine (as the executor's workers do), with every write in its own
// transaction and with group commit at 1, 2, 4 and 8 transactions in
// flight (and at 1 and 4 with the embedded etcd's op bound), and reports writes/s of each (and writes per transaction when
// grouped):
//
//	go test ./controller/store/ -run '^$' -bench UpdateParallel
func BenchmarkUpdateParallel(b *testing.B) {
	_, c := startEtcd(b)
	const writers = 256
	for _, bc := range []struct {
		name string
		g    GroupCommit
	}{
		{"single", GroupCommit{Disabled: true}},
		{"grouped/in-flight=1", GroupCommit{MaxInFlight: 1}},
		{"grouped/in-flight=2", GroupCommit{MaxInFlight: 2}},
		{"grouped/in-flight=4", GroupCommit{MaxInFlight: 4}},
		{"grouped/in-flight=8", GroupCommit{MaxInFlight: 8}},
		// The embedded etcd takes MaxBatchOps operations per transaction.
		{"grouped/in-flight=1/max-ops=2048", GroupCommit{MaxInFlight: 1, MaxOps: MaxBatchOps}},
		{"grouped/in-flight=4/max-ops=2048", GroupCommit{MaxInFlight: 4, MaxOps: MaxBatchOps}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			s := New(c, WithGroupCommit(bc.g))
			ctx := testCtx(b)
			var next atomic.Int64
			b.SetParallelism((writers + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
			b.RunParallel(func(pb *testing.PB) {
				name := fmt.Sprintf("par-%03d", next.Add(1)-1)
				h := host(name, "52:54:00:00:00:01")
				rev, err := s.Update(ctx, "hosts", name, h, 0)
				if errdefs.IsNotFound(err) {
					rev, err = s.Create(ctx, "hosts", name, h)
				}
				for err == nil && pb.Next() {
					h.Metadata.Generation++
					rev, err = s.Update(ctx, "hosts", name, h, rev)
				}
				if err != nil {
					b.Error(err)
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "writes/s")
			if s.group != nil && s.group.txns.Load() > 0 {
				b.ReportMetric(float64(s.group.writes.Load())/float64(s.group.txns.Load()), "writes/txn")
			}
		})
	}
}

// BenchmarkGetParallel reads 256 hosts at once, each from its own
// goroutine (as the executor's workers do), with every Get a request of
// its own and with read grouping at the default 2 groups in flight (and
// at 1 and 4), and reports reads/s of each (and Gets per etcd request
// when grouped). Writes are grouped in every case; none run here.
//
//	go test ./controller/store/ -run '^$' -bench GetParallel
func BenchmarkGetParallel(b *testing.B) {
	_, c := startEtcd(b)
	const readers = 256
	setup := New(c)
	ctx := testCtx(b)
	for i := range readers {
		name := fmt.Sprintf("par-%03d", i)
		_, err := setup.Create(ctx, "hosts", name, host(name, "52:54:00:00:00:01"))
		require.NoError(b, err)
	}
	for _, bc := range []struct {
		name string
		g    GroupCommit
	}{
		{"single", GroupCommit{DisableReads: true}},
		{"grouped/in-flight=1", GroupCommit{MaxInFlight: 1}},
		{"grouped/in-flight=2", GroupCommit{}},
		{"grouped/in-flight=4", GroupCommit{MaxInFlight: 4}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			s := New(c, WithGroupCommit(bc.g))
			var next atomic.Int64
			b.SetParallelism((readers + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
			b.RunParallel(func(pb *testing.PB) {
				name := fmt.Sprintf("par-%03d", (next.Add(1)-1)%readers)
				var h typesv1.Host
				for pb.Next() {
					if _, err := s.Get(ctx, "hosts", name, &h); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "reads/s")
			if s.reads != nil && s.reads.txns.Load() > 0 {
				b.ReportMetric(float64(s.reads.reads.Load())/float64(s.reads.txns.Load()), "reads/request")
			}
		})
	}
}

func BenchmarkPutSecret(b *testing.B) {
	s, _ := newStore(b)
	ctx := testCtx(b)
	pw := []byte("bmc-password-0f3c9a")
	for b.Loop() {
		if err := s.PutSecret(ctx, "bmc/rack1-01", pw); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkList1000 lists 1000 hosts in pages of 100.
func BenchmarkList1000(b *testing.B) {
	s, _ := newStore(b)
	ctx := testCtx(b)
	for i := range 1000 {
		name := fmt.Sprintf("host-%04d", i)
		_, err := s.Create(ctx, "hosts", name, host(name, "52:54:00:00:00:01"))
		require.NoError(b, err)
	}
	newHost := func() proto.Message { return &typesv1.Host{} }
	for b.Loop() {
		n := 0
		opts := ListOptions{Limit: 100}
		for {
			items, next, err := s.List(ctx, "hosts", newHost, opts)
			if err != nil {
				b.Fatal(err)
			}
			n += len(items)
			if next == "" {
				break
			}
			opts.Continue = next
		}
		if n != 1000 {
			b.Fatalf("listed %d, want 1000", n)
		}
	}
}

// BenchmarkBackupRestore1000 backs up 1000 hosts and restores them into a
// second etcd, replacing what the previous iteration restored.
func BenchmarkBackupRestore1000(b *testing.B) {
	src, _ := newStore(b)
	_, c2 := startEtcd(b)
	dst := New(c2)
	ctx := testCtx(b)
	for i := range 1000 {
		name := fmt.Sprintf("host-%04d", i)
		_, err := src.Create(ctx, "hosts", name, host(name, "52:54:00:00:00:01"))
		require.NoError(b, err)
	}
	var size int
	for b.Loop() {
		var buf bytes.Buffer
		if _, err := src.Backup(ctx, &buf); err != nil {
			b.Fatal(err)
		}
		size = buf.Len()
		if _, err := dst.Restore(ctx, &buf, RestoreOptions{Replace: true}); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(size), "backup-bytes")
}
