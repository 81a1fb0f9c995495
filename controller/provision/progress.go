package provision

import (
	"context"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Defaults of how often a running operation's progress is stored.
const (
	// DefaultProgressInterval is the longest a stored progress stays
	// behind the agent's while reports keep coming.
	DefaultProgressInterval = 5 * time.Second
	// DefaultProgressPercent is the jump in percent that is stored before
	// the interval is over (but never more than once a second).
	DefaultProgressPercent = 10
)

// progressMinGap is the shortest time between two stored reports of one
// operation that the percent rule allows.
const progressMinGap = time.Second

// progressThrottle decides which of an operation's progress reports are
// worth a write to the store: the first one, each new step, the one that
// completes the operation (step "done" or every byte done), then at most
// one per interval, or one per percent points gained (at most once per
// second). A lay reports every ~250 ms; without this a fleet laying at
// once would write to etcd four times a second per host. It reads no
// clock: now is passed in.
type progressThrottle struct {
	interval time.Duration
	percent  float64

	stored    bool
	last      time.Time
	step      string
	lastPct   float64
	completed bool
}

func newProgressThrottle(interval time.Duration, percent float64) *progressThrottle {
	if interval <= 0 {
		interval = DefaultProgressInterval
	}
	if percent <= 0 {
		percent = DefaultProgressPercent
	}
	return &progressThrottle{interval: interval, percent: percent}
}

// admit reports whether p, received at now, is to be stored, and if so
// remembers it as the last stored one.
func (t *progressThrottle) admit(p *agentv1.Progress, now time.Time) bool {
	complete := p.GetStep() == "done" || (p.GetTotalBytes() > 0 && p.GetDoneBytes() >= p.GetTotalBytes())
	since := now.Sub(t.last)
	ok := false
	switch {
	case !t.stored, baseStep(p.GetStep()) != baseStep(t.step):
		ok = true
	case complete && !t.completed:
		ok = true
	case since >= t.interval:
		ok = true
	case since >= progressMinGap && p.GetPercent()-t.lastPct >= t.percent:
		ok = true
	}
	if !ok {
		return false
	}
	t.stored, t.last, t.step, t.lastPct = true, now, p.GetStep(), p.GetPercent()
	t.completed = t.completed || complete
	return true
}

// baseStep is step without a note: agent/lay reports a note within a step
// as "fetch: server ignored the Range request ...", which is no new step
// (a flaky server's retries must not each force a write).
func baseStep(step string) string {
	base, _, _ := strings.Cut(step, ": ")
	return base
}

// OperationProgress converts an agent's progress report into what the
// controller stores, stamped with now.
func OperationProgress(p *agentv1.Progress, now time.Time) *typesv1.OperationProgress {
	return &typesv1.OperationProgress{
		Step:           p.GetStep(),
		DoneBytes:      p.GetDoneBytes(),
		TotalBytes:     p.GetTotalBytes(),
		BytesPerSecond: p.GetBytesPerSecond(),
		EtaSeconds:     p.GetEtaSeconds(),
		Percent:        p.GetPercent(),
		Updated:        timestamppb.New(now),
	}
}

// progressSink returns the function follow calls with each progress
// report of operation opID on host name: it stores the reports the
// throttle admits into the host's status.lastOperation, while that is
// still opID and running. Storing is best effort: a failure is logged and
// the operation goes on.
func (e *Executor) progressSink(ctx context.Context, name, opID string) func(*agentv1.Progress) {
	t := newProgressThrottle(e.cfg.ProgressInterval, e.cfg.ProgressPercent)
	return func(p *agentv1.Progress) {
		now := e.cfg.Clock()
		if p == nil || !t.admit(p, now) {
			return
		}
		if err := e.storeProgress(ctx, name, opID, OperationProgress(p, now)); err != nil && ctx.Err() == nil {
			e.log.Warn("store operation progress", "host", name, "operation", opID, "err", err)
		}
	}
}

// storeProgress writes p into host name's last operation if that is
// still opID and running; a conflict (a heartbeat, an apply) reads the
// host again.
func (e *Executor) storeProgress(ctx context.Context, name, opID string, p *typesv1.OperationProgress) error {
	for range 5 {
		h := &typesv1.Host{}
		rev, err := e.deps.Store.Get(ctx, HostsKind, name, h)
		if err != nil {
			return err
		}
		op := h.GetStatus().GetLastOperation()
		if op.GetId() != opID || op.GetState() != hostlife.OpRunning {
			return nil // the step moved on; its progress is of no use
		}
		op.Progress, op.Percent = p, p.GetPercent()
		newRev, err := e.deps.Store.Update(ctx, HostsKind, name, h, rev)
		if errdefs.IsConflict(err) {
			continue
		}
		if err != nil {
			return err
		}
		e.mu.Lock()
		e.written[name] = newRev
		e.mu.Unlock()
		return nil
	}
	return errdefs.Unavailable("host %q: too many concurrent updates", name)
}
