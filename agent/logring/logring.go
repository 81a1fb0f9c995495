// Package logring keeps the agent's most recent log lines in memory so the
// controller can read them through the Logs RPC (kilnctl logs HOST) without
// shell access to the host. It is an io.Writer for a slog handler: each
// Write is one line.
package logring

import (
	"bytes"
	"context"
	"sync"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// DefaultTail is how many lines Logs sends when asked for tail 0.
const DefaultTail = 200

// Ring holds the last Capacity lines.
type Ring struct {
	now func() time.Time

	mu       sync.Mutex
	capacity int
	lines    []*agentv1.LogLine // circular once len(lines) == capacity
	start    int                // index of the oldest line
	total    uint64             // lines ever written
	changed  chan struct{}      // closed and replaced on every write
}

// New returns a Ring keeping capacity lines (at least 1). Its memory
// grows with the lines written, up to capacity.
func New(capacity int) *Ring {
	if capacity < 1 {
		capacity = 1
	}
	return &Ring{now: time.Now, capacity: capacity, changed: make(chan struct{})}
}

// Write stores p as one line (a trailing newline is dropped). It never
// fails.
func (r *Ring) Write(p []byte) (int, error) {
	line := &agentv1.LogLine{Time: timestamppb.New(r.now()), Line: string(bytes.TrimRight(p, "\n"))}
	r.mu.Lock()
	if len(r.lines) < r.capacity {
		r.lines = append(r.lines, line)
	} else {
		r.lines[r.start] = line
		r.start = (r.start + 1) % len(r.lines)
	}
	r.total++
	close(r.changed)
	r.changed = make(chan struct{})
	r.mu.Unlock()
	return len(p), nil
}

// since returns the lines with absolute index >= from (clamped to what is
// still held), the next index and the change channel.
func (r *Ring) since(from uint64) ([]*agentv1.LogLine, uint64, <-chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	oldest := r.total - uint64(len(r.lines))
	if from < oldest {
		from = oldest
	}
	out := make([]*agentv1.LogLine, 0, r.total-from)
	for i := from; i < r.total; i++ {
		out = append(out, r.lines[(r.start+int(i-oldest))%len(r.lines)])
	}
	return out, r.total, r.changed
}

// Logs sends the last tail lines (DefaultTail when 0) to send and, with
// follow, every later line until ctx is done. It blocks; it returns send's
// error, or nil when ctx ends a follow.
func (r *Ring) Logs(ctx context.Context, tail int, follow bool, send func(*agentv1.LogLine) error) error {
	if tail <= 0 {
		tail = DefaultTail
	}
	r.mu.Lock()
	from := uint64(0)
	if r.total > uint64(tail) {
		from = r.total - uint64(tail)
	}
	r.mu.Unlock()
	for {
		lines, next, changed := r.since(from)
		for _, l := range lines {
			if err := send(l); err != nil {
				return err
			}
		}
		from = next
		if !follow {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		}
	}
}
