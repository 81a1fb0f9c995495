package liveness

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// HostsKind is the store kind of hosts.
const HostsKind = "hosts"

// Tracker holds, in memory, when this replica last heard from each agent
// whose heartbeats it receives. It is safe for concurrent use.
type Tracker struct {
	mu   sync.Mutex
	seen map[string]time.Time
}

// NewTracker returns an empty Tracker.
func NewTracker() *Tracker { return &Tracker{seen: map[string]time.Time{}} }

// Seen records that host's agent was heard from at at (a later time wins).
func (t *Tracker) Seen(host string, at time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if at.After(t.seen[host]) {
		t.seen[host] = at
	}
}

// LastSeen is when host's agent was last heard from, and whether it is
// tracked.
func (t *Tracker) LastSeen(host string) (time.Time, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	at, ok := t.seen[host]
	return at, ok
}

// Forget stops tracking host.
func (t *Tracker) Forget(host string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.seen, host)
}

// adopt starts tracking host as seen at at, unless it is tracked.
func (t *Tracker) adopt(host string, at time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.seen[host]; !ok {
		t.seen[host] = at
	}
}

// forgetIf stops tracking host unless it was heard from after at.
func (t *Tracker) forgetIf(host string, at time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.seen[host].After(at) {
		delete(t.seen, host)
	}
}

// Len is the number of tracked agents.
func (t *Tracker) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.seen)
}

// Silent lists the tracked hosts not heard from for longer than silence
// at now.
func (t *Tracker) Silent(now time.Time, silence time.Duration) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []string
	for h, at := range t.seen {
		if now.Sub(at) > silence {
			out = append(out, h)
		}
	}
	return out
}

// Store is what a Monitor needs of the store (*store.Store).
type Store interface {
	Get(ctx context.Context, kind, name string, into proto.Message) (int64, error)
	Update(ctx context.Context, kind, name string, m proto.Message, expectRev int64) (int64, error)
	List(ctx context.Context, kind string, newMsg func() proto.Message, opts store.ListOptions) ([]store.Item, string, error)
}

var _ Store = (*store.Store)(nil)

// Recorder records events (*events.Recorder).
type Recorder interface {
	Record(ctx context.Context, kind, name, typ, reason, message string)
}

// MonitorConfig tunes a Monitor.
type MonitorConfig struct {
	// Replica is this controller replica's ID, as heartbeats record it.
	Replica string
	// Silence is how long an agent may be silent before its Host gets
	// AgentReachable=False.
	Silence time.Duration
	// Period is how often the tracker is checked (Silence/12 when 0).
	Period time.Duration
	// Clock is the time source (time.Now).
	Clock func() time.Time
	// Live lists the live replicas (LiveReplicas). Hosts held by a
	// replica not in it are adopted (Adopt). Nil: every other replica is
	// taken to be live.
	Live func(ctx context.Context) (map[string]bool, error)
}

// Monitor marks AgentReachable=False on the hosts this replica holds
// whose agent went silent. Every replica runs one: a heartbeat received
// by a replica is judged by that replica.
type Monitor struct {
	st  Store
	rec Recorder
	tr  *Tracker
	cfg MonitorConfig
	log *slog.Logger
}

// NewMonitor returns a Monitor over the tracker the replica's heartbeats
// fill.
func NewMonitor(st Store, rec Recorder, tr *Tracker, cfg MonitorConfig, log *slog.Logger) *Monitor {
	if cfg.Period <= 0 {
		cfg.Period = cfg.Silence / 12
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	return &Monitor{st: st, rec: rec, tr: tr, cfg: cfg, log: log.With("component", "liveness")}
}

// Run adopts the hosts this replica is to judge (Adopt), then checks the
// tracker every period (Check) and adopts again every silence, until ctx
// ends. It blocks.
func (m *Monitor) Run(ctx context.Context) {
	t := time.NewTicker(m.cfg.Period)
	defer t.Stop()
	var adopted time.Time
	for {
		if now := m.cfg.Clock(); now.Sub(adopted) >= m.cfg.Silence {
			if err := m.Adopt(ctx); err != nil {
				if ctx.Err() == nil {
					m.log.Warn("adopting hosts for liveness failed; retrying", "err", err)
				}
			} else {
				adopted = now
			}
		}
		if _, err := m.Check(ctx); err != nil && ctx.Err() == nil {
			m.log.Warn("liveness check failed", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Adopt starts tracking, as last seen now, every reachable host that is
// not tracked and is held by this replica, by none, or by a replica that
// is no longer live. After a restart the replica's memory is empty, and
// when a replica dies its memory is gone: an agent that stopped meanwhile
// is still marked one silence after its adoption. A host held by another
// live replica is that replica's.
func (m *Monitor) Adopt(ctx context.Context) error {
	live, err := m.live(ctx)
	if err != nil {
		return err
	}
	now := m.cfg.Clock()
	cont := ""
	for {
		items, next, err := m.st.List(ctx, HostsKind, func() proto.Message { return &typesv1.Host{} }, store.ListOptions{Limit: 1000, Continue: cont})
		if err != nil {
			return err
		}
		for _, it := range items {
			h := it.Msg.(*typesv1.Host)
			if h.GetStatus().GetAgent().GetLastHeartbeat() == nil || m.heldElsewhere(h, live) {
				continue
			}
			if c := conditions.Get(h.GetStatus().GetConditions(), ConditionAgentReachable); c != nil && c.GetStatus() == conditions.False {
				continue
			}
			m.tr.adopt(it.Name, now)
		}
		if next == "" {
			return nil
		}
		cont = next
	}
}

// live is the set of live replicas, nil when unknown (every replica is
// then taken to be live).
func (m *Monitor) live(ctx context.Context) (map[string]bool, error) {
	if m.cfg.Live == nil {
		return nil, nil
	}
	return m.cfg.Live(ctx)
}

// heldElsewhere reports whether h's heartbeats go to another replica that
// is live.
func (m *Monitor) heldElsewhere(h *typesv1.Host, live map[string]bool) bool {
	holder := h.GetStatus().GetAgent().GetController()
	if holder == "" || holder == m.cfg.Replica {
		return false
	}
	return live == nil || live[holder]
}

// Check marks AgentReachable=False on each tracked host whose agent has
// been silent for longer than the silence, and stops tracking it (its
// next heartbeat tracks it again and writes it reachable). A host now
// held by another replica is dropped without a write. It returns the
// hosts it marked; a store error stops it (the rest wait for the next
// check).
func (m *Monitor) Check(ctx context.Context) ([]string, error) {
	var marked []string
	silent := m.tr.Silent(m.cfg.Clock(), m.cfg.Silence)
	if len(silent) == 0 {
		return nil, nil
	}
	live, err := m.live(ctx)
	if err != nil {
		return nil, err
	}
	for _, name := range silent {
		ok, err := m.mark(ctx, name, live)
		if err != nil {
			return marked, err
		}
		if ok {
			marked = append(marked, name)
		}
	}
	return marked, nil
}

// mark writes AgentReachable=False on host name unless another live
// replica holds it, if its agent is still silent, with a compare-and-swap; a conflict is
// tried again at the next check.
func (m *Monitor) mark(ctx context.Context, name string, live map[string]bool) (bool, error) {
	last, ok := m.tr.LastSeen(name)
	if !ok {
		return false, nil
	}
	h := &typesv1.Host{}
	rev, err := m.st.Get(ctx, HostsKind, name, h)
	if errdefs.IsNotFound(err) {
		m.tr.forgetIf(name, last)
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if m.heldElsewhere(h, live) {
		m.tr.forgetIf(name, last)
		return false, nil
	}
	now := m.cfg.Clock()
	cond := DecideSeen(h, last, now, m.cfg.Silence)
	if cond == nil {
		if c := conditions.Get(h.GetStatus().GetConditions(), ConditionAgentReachable); c != nil && c.GetStatus() == conditions.False {
			m.tr.forgetIf(name, last) // already marked
		}
		return false, nil
	}
	h.Status.Conditions, _ = conditions.Set(h.Status.Conditions, cond, now)
	if _, err := m.st.Update(ctx, HostsKind, name, h, rev); err != nil {
		if errdefs.IsConflict(err) || errdefs.IsNotFound(err) {
			return false, nil
		}
		return false, err
	}
	m.tr.forgetIf(name, last)
	m.log.Info("agent unreachable", "host", name, "reason", cond.GetReason())
	m.rec.Record(ctx, HostsKind, name, "Warning", ReasonHeartbeatMissed, cond.GetMessage())
	return true, nil
}
