// Package memtrim returns the heap memory a long-running, mostly idle
// daemon no longer uses to the operating system.
//
// The Go runtime keeps freed heap pages mapped until the heap exceeds its
// goal (4 MiB at least with the default GOGC), so a daemon whose live heap is
// 1 MiB but which allocates a little with every heartbeat grows its resident
// memory to that goal and stays there. A Trimmer watches how much the
// program allocated (runtime/metrics "/gc/heap/allocs:bytes") and, once that
// exceeds a threshold since its last trim, runs debug.FreeOSMemory: one
// forced collection that returns every free page. An idle agent thus stays
// within threshold of its live memory at the cost of one collection of a
// small heap every few minutes; a busy one (laying an image) is trimmed at
// most once per check interval, which is negligible next to the collections
// its own allocation rate causes.
//
// The first trim waits for a larger amount: a program's first collections
// leave about 1 MiB of runtime metadata resident for good, so collecting
// before the runtime would have done so itself only costs memory.
//
// A Trimmer can also drop the program's mappings of its own executable's
// read-only pages at every check (ReleaseExecutable): start-up touches
// nearly the whole binary once, while an idle daemon runs a small part of
// it. See docs/bench/agent.md for measurements.
package memtrim

import (
	"context"
	"runtime/debug"
	"runtime/metrics"
	"time"
)

const allocsMetric = "/gc/heap/allocs:bytes"

// Trimmer decides when to return free heap memory. It is not safe for
// concurrent use; Run it in one goroutine.
//
// It reads runtime/metrics, not runtime.ReadMemStats: stopping the world to
// read MemStats raised the agent's resident memory by 0.5 MiB
// (docs/bench/agent.md).
type Trimmer struct {
	// Executable makes Run also call ReleaseExecutable at every check,
	// the first one StartupDelay after it starts.
	Executable bool

	need      uint64 // first, then threshold
	threshold uint64
	last      uint64
	sample    [1]metrics.Sample
}

// New returns a Trimmer that trims once first bytes have been allocated
// since it was made, and then each time threshold more have been allocated
// since its last trim.
func New(first, threshold uint64) *Trimmer {
	t := &Trimmer{need: first, threshold: threshold}
	t.sample[0].Name = allocsMetric
	t.last = t.allocated()
	return t
}

func (t *Trimmer) allocated() uint64 {
	metrics.Read(t.sample[:])
	return t.sample[0].Value.Uint64()
}

// Trim runs debug.FreeOSMemory when enough has been allocated since the
// last trim (see New), and reports whether it did. It blocks for one
// garbage collection when it trims.
func (t *Trimmer) Trim() bool {
	if t.allocated()-t.last < t.need {
		return false
	}
	debug.FreeOSMemory()
	t.need = t.threshold
	t.last = t.allocated()
	return true
}

// StartupDelay is when Run checks first if the interval is longer: by then
// a daemon has started, and the code only its start-up ran can go.
const StartupDelay = 2 * time.Second

// Run calls Trim every interval (the first time after StartupDelay, if that
// is shorter) until ctx is done, and ReleaseExecutable after each Trim if
// t.Executable is set. It blocks. Releasing is an optimisation: where it
// fails (no /proc), Run goes on trimming the heap.
func (t *Trimmer) Run(ctx context.Context, interval time.Duration) {
	timer := time.NewTimer(min(interval, StartupDelay))
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
			t.Trim()
			if t.Executable {
				_, _ = ReleaseExecutable()
			}
			timer.Reset(interval)
		}
	}
}
