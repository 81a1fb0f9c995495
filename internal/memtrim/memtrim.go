// Package memtrim returns the heap memory a long-running, mostly idle
// daemon no longer uses to the operating system.
//
// The Go runtime keeps freed heap pages mapped until the heap exceeds its
// goal (4 MiB at least with the default GOGC), so a daemon whose live heap is
// 1 MiB but which allocates a little with every heartbeat grows its resident
// memory to that goal and stays there. A Trimmer watches how much the
// program allocated (runtime.MemStats.TotalAlloc) and, once that
// exceeds a threshold since its last trim, runs debug.FreeOSMemory: one
// forced collection that returns every free page. An idle agent thus stays
// within threshold of its live memory at the cost of one collection of a
// small heap every few minutes; a busy one (laying an image) is trimmed at
// most once per check interval, which is negligible next to the collections
// its own allocation rate causes. See docs/bench/agent.md for measurements.
package memtrim

import (
	"context"
	"runtime"
	"runtime/debug"
	"time"
)

// Trimmer decides when to return free heap memory. It is not safe for
// concurrent use; Run it in one goroutine.
//
// It reads the runtime's statistics with runtime.ReadMemStats (a pause of
// microseconds for a small heap) rather than runtime/metrics, whose
// package initialisation alone would cost the agent 15 KiB of heap and
// 36 KiB of binary.
type Trimmer struct {
	threshold uint64
	last      uint64
	stats     runtime.MemStats
}

// New returns a Trimmer that trims once threshold bytes have been
// allocated since it was made or since its last trim.
func New(threshold uint64) *Trimmer {
	t := &Trimmer{threshold: threshold}
	t.last = t.allocated()
	return t
}

func (t *Trimmer) allocated() uint64 {
	runtime.ReadMemStats(&t.stats)
	return t.stats.TotalAlloc
}

// Trim runs debug.FreeOSMemory when at least the threshold has been
// allocated since the last trim, and reports whether it did. It blocks for
// one garbage collection when it trims.
func (t *Trimmer) Trim() bool {
	if t.allocated()-t.last < t.threshold {
		return false
	}
	debug.FreeOSMemory()
	t.last = t.allocated()
	return true
}

// Run calls Trim every interval until ctx is done. It blocks.
func (t *Trimmer) Run(ctx context.Context, interval time.Duration) {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			t.Trim()
		}
	}
}
