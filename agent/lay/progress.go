package lay

import (
	"sync"
	"time"

	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// reporter turns byte counts into Progress reports, at most one per
// interval within a step; a new step and a note always report.
type reporter struct {
	mu       sync.Mutex
	fn       func(*agentv1.Progress)
	now      func() time.Time
	interval time.Duration
	name     string
	start    time.Time
	last     time.Time
	total    uint64
	done     uint64
}

func newReporter(fn func(*agentv1.Progress), now func() time.Time, interval time.Duration) *reporter {
	return &reporter{fn: fn, now: now, interval: interval}
}

// step starts a step and reports it.
func (r *reporter) step(name string, done uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.name, r.done = name, done
	r.start = r.now()
	r.emit(r.name, r.start)
}

// note reports a message within the current step ("fetch: server ignored
// Range ...").
func (r *reporter) note(msg string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.emit(r.name+": "+msg, r.now())
}

// setTotal sets the number of bytes the current step will process.
func (r *reporter) setTotal(total uint64) {
	r.mu.Lock()
	r.total = total
	r.mu.Unlock()
}

// add counts n more bytes done and reports if the interval has passed.
func (r *reporter) add(n int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.done += uint64(n)
	if now := r.now(); now.Sub(r.last) >= r.interval {
		r.emit(r.name, now)
	}
}

func (r *reporter) emit(step string, now time.Time) {
	r.last = now
	if r.fn == nil {
		return
	}
	p := &agentv1.Progress{Step: step, DoneBytes: r.done, TotalBytes: r.total}
	if el := now.Sub(r.start).Seconds(); el > 0 {
		p.BytesPerSecond = float64(r.done) / el
	}
	if r.total > 0 {
		p.Percent = 100 * float64(min(r.done, r.total)) / float64(r.total)
		if p.BytesPerSecond > 0 && r.total > r.done {
			p.EtaSeconds = float64(r.total-r.done) / p.BytesPerSecond
		}
	}
	r.fn(p)
}
