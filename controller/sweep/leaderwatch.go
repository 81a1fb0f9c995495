package sweep

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/election"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// The condition that says no controller advances a host. An API-only
// replica that finds no leader sets it False on every host; the leader
// that runs the lifecycle removes it (docs/controller.md, "API-only
// replicas").
const (
	ConditionLifecycleRunning = "LifecycleRunning"
	ReasonLifecycleDisabled   = "LifecycleDisabled"
)

// leaderlessGrace is how long, in election TTLs, an API-only replica
// waits without seeing a leader before it tells the hosts: a crashed
// leader is replaced after about one TTL, so two without any leader mean
// none is coming.
const leaderlessGrace = 2

// leaderWatch decides, from what an API-only replica observes of the
// election, when nothing advances the hosts. It does no I/O and reads no
// clock.
type leaderWatch struct {
	grace time.Duration
	// since is when the replica first saw no leader; zero while it sees
	// one (or before it has looked).
	since time.Time
}

// observe records whether a leader held the lease at now and reports
// whether no leader has been seen for at least the grace period.
func (w *leaderWatch) observe(leader bool, now time.Time) bool {
	if leader {
		w.since = time.Time{}
		return false
	}
	if w.since.IsZero() {
		w.since = now
	}
	return now.Sub(w.since) >= w.grace
}

// lifecycleDisabled is the condition an API-only replica id sets on the
// hosts when no leader held the lease for grace.
func lifecycleDisabled(id string, grace time.Duration) *typesv1.Condition {
	c := conditions.New(ConditionLifecycleRunning, conditions.False, ReasonLifecycleDisabled,
		fmt.Sprintf("no controller advances hosts: controller %s runs with --api-only and no controller has led for %s; "+
			"start one without --api-only (kiln-controller run; docs/controller.md)", id, grace))
	c.Severity = "Error"
	return c
}

// WatchForLeader runs on an API-only replica until ctx ends: every
// reconcile interval it looks up the election leader, and once none has
// led for the grace period it sets LifecycleRunning=False on every host
// (a Warning event when the condition is new). It never removes the
// condition: the leader that runs the lifecycle does (clearLifecycleDisabled).
func (s *Sweeper) WatchForLeader(ctx context.Context, el *election.Elector, st *store.Store, rec *events.Recorder) {
	w := leaderWatch{grace: leaderlessGrace * s.cfg.ElectionTTL}
	cond := lifecycleDisabled(s.cfg.ID, w.grace)
	t := time.NewTicker(s.cfg.Interval)
	defer t.Stop()
	for {
		_, err := el.Leader(ctx)
		switch {
		case err == nil:
			w.observe(true, s.cfg.Clock())
		case errdefs.IsNotFound(err):
			if w.observe(false, s.cfg.Clock()) {
				s.updateHosts(ctx, st, func(h *typesv1.Host, now time.Time) bool {
					var changed bool
					h.Status.Conditions, changed = conditions.Set(h.Status.Conditions, proto.Clone(cond).(*typesv1.Condition), now)
					return changed
				}, func(h *typesv1.Host) {
					rec.Record(ctx, "hosts", h.GetMetadata().GetName(), events.Warning, ReasonLifecycleDisabled, cond.GetMessage())
				})
			}
		default:
			if ctx.Err() == nil {
				s.log.Warn("api-only: look up the leader", "err", err)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// clearLifecycleDisabled removes LifecycleRunning=False from h; the
// leader calls it when it runs the lifecycle. It reports whether h
// changed.
func clearLifecycleDisabled(h *typesv1.Host) bool {
	var changed bool
	h.Status.Conditions, changed = conditions.Remove(h.GetStatus().GetConditions(), ConditionLifecycleRunning)
	return changed
}

// updateHosts lists the hosts page by page, calls change on each (with a
// non-nil Status), stores those it changed and calls stored (when not nil)
// for each one stored. A host changed meanwhile (a conflict) or deleted is
// skipped until the next round.
func (s *Sweeper) updateHosts(ctx context.Context, st *store.Store, change func(h *typesv1.Host, now time.Time) bool, stored func(h *typesv1.Host)) {
	newHost := func() proto.Message { return &typesv1.Host{} }
	cont := ""
	for {
		items, next, err := st.List(ctx, "hosts", newHost, store.ListOptions{Limit: 500, Continue: cont})
		if err != nil {
			if ctx.Err() == nil {
				s.log.Warn("list hosts", "err", err)
			}
			return
		}
		for _, it := range items {
			h := it.Msg.(*typesv1.Host)
			if h.Status == nil {
				h.Status = &typesv1.HostStatus{}
			}
			if !change(h, s.cfg.Clock()) {
				continue
			}
			if _, err := st.Update(ctx, "hosts", it.Name, h, it.Rev); err != nil {
				if !errdefs.IsConflict(err) && !errdefs.IsNotFound(err) {
					s.log.Warn("update host", "host", it.Name, "err", err)
				}
				continue
			}
			if stored != nil {
				stored(h)
			}
		}
		if next == "" {
			return
		}
		cont = next
	}
}
