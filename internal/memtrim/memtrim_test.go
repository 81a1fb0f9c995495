package memtrim_test

import (
	"context"
	"runtime/metrics"
	"testing"
	"time"

	"github.com/kilnhq/kiln/internal/memtrim"
)

func read(name string) uint64 {
	s := []metrics.Sample{{Name: name}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

var sink [][]byte

// garbage allocates about n bytes that are garbage once it returns.
func garbage(n int) {
	for i := 0; i < n/1024; i++ {
		sink = append(sink, make([]byte, 1024))
	}
	sink = nil
}

// TestTrim: below the first amount nothing happens; past it, one forced
// collection returns the freed pages to the OS; then the (smaller)
// threshold counts from there.
func TestTrim(t *testing.T) {
	const first, threshold = 8 << 20, 2 << 20
	tr := memtrim.New(first, threshold)
	forced := read("/gc/cycles/forced:gc-cycles")

	garbage(4 << 20)
	if tr.Trim() {
		t.Fatalf("Trim() after 4 MiB of garbage = true, want false below the first %d bytes", first)
	}
	if got := read("/gc/cycles/forced:gc-cycles"); got != forced {
		t.Fatalf("forced collections = %d, want still %d", got, forced)
	}

	garbage(6 << 20)
	released := read("/memory/classes/heap/released:bytes")
	if !tr.Trim() {
		t.Fatalf("Trim() after 10 MiB of garbage = false, want true")
	}
	if got := read("/gc/cycles/forced:gc-cycles"); got != forced+1 {
		t.Errorf("forced collections = %d, want %d", got, forced+1)
	}
	if got := read("/memory/classes/heap/released:bytes"); got <= released {
		t.Errorf("released heap = %d bytes after the trim, want more than the %d before: the garbage's pages go back to the OS", got, released)
	}

	if tr.Trim() {
		t.Errorf("Trim() right after a trim = true, want false: the count starts again")
	}
	garbage(threshold / 2)
	if tr.Trim() {
		t.Errorf("Trim() after 1 MiB = true, want false below the threshold %d", threshold)
	}
	garbage(threshold)
	if !tr.Trim() {
		t.Errorf("Trim() after 3 MiB since the last trim = false, want true past the threshold %d", threshold)
	}
}

// TestRunStops: Run trims while it runs and returns when its context ends.
func TestRunStops(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	forced := read("/gc/cycles/forced:gc-cycles")
	go func() {
		defer close(done)
		memtrim.New(1, 1).Run(ctx, time.Millisecond)
	}()
	deadline := time.Now().Add(time.Minute)
	for read("/gc/cycles/forced:gc-cycles") == forced {
		if time.Now().After(deadline) {
			t.Fatal("Run did not trim within a minute of allocating")
		}
		garbage(64 << 10)
		time.Sleep(time.Millisecond)
	}
	cancel()
	<-done
}

type node struct {
	next *node
	pad  [48]byte
}

var live *node

// BenchmarkTrim: one trim of a heap shaped like the idle agent's (1 MiB
// live in small linked objects) after 256 KiB of garbage.
// Run with: go test -run '^$' -bench Trim ./internal/memtrim
func BenchmarkTrim(b *testing.B) {
	for i := 0; i < (1<<20)/64; i++ {
		live = &node{next: live}
	}
	tr := memtrim.New(256<<10, 256<<10)
	for b.Loop() {
		b.StopTimer()
		garbage(256 << 10)
		b.StartTimer()
		if !tr.Trim() {
			b.Fatal("Trim() = false after 256 KiB of garbage")
		}
	}
}
