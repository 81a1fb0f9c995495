package controller

import (
	"context"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// reconcile runs the leader's loops until ctx ends. For now: a leader
// that runs the lifecycle removes LifecycleRunning=False (lifecycle.go),
// and enrollment tokens are deleted a while after they expire.
func (c *Controller) reconcile(ctx context.Context, st *store.Store, rec *events.Recorder) {
	t := time.NewTicker(c.cfg.ReconcileInterval)
	defer t.Stop()
	for {
		c.reconcileHosts(ctx, st, rec)
		c.deleteExpiredTokens(ctx, st)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// runsLifecycle reports whether this replica runs the host lifecycle
// when it leads.
func (c *Controller) runsLifecycle() bool { return c.cfg.Lifecycle || c.cfg.Simulate > 0 }

// reconcileHosts clears LifecycleRunning=False when this replica runs the
// lifecycle. (Silent agents are marked by the liveness monitor of the
// replica that receives their heartbeats, controller/liveness.)
func (c *Controller) reconcileHosts(ctx context.Context, st *store.Store, rec *events.Recorder) {
	if !c.runsLifecycle() {
		return
	}
	c.updateHosts(ctx, st, func(h *typesv1.Host, _ time.Time) bool {
		return clearLifecycleDisabled(h)
	}, func(*typesv1.Host) {})
}

// tokenRetention keeps expired tokens around for a while, so an agent
// presenting one is told it expired rather than that it is unknown.
const tokenRetention = 24 * time.Hour

// deleteExpiredTokens removes enrollment tokens that expired more than
// tokenRetention ago.
func (c *Controller) deleteExpiredTokens(ctx context.Context, st *store.Store) {
	newToken := func() proto.Message { return &typesv1.EnrollmentToken{} }
	cont := ""
	for {
		items, next, err := st.List(ctx, enrollment.TokensKind, newToken, store.ListOptions{Limit: 500, Continue: cont})
		if err != nil {
			if ctx.Err() == nil {
				c.log.Warn("tokens: list", "err", err)
			}
			return
		}
		now := c.cfg.Clock()
		for _, it := range items {
			tok := it.Msg.(*typesv1.EnrollmentToken)
			if now.Sub(tok.GetExpires().AsTime()) <= tokenRetention {
				continue
			}
			if err := st.Delete(ctx, enrollment.TokensKind, it.Name, it.Rev); err != nil {
				if !errdefs.IsConflict(err) && !errdefs.IsNotFound(err) {
					c.log.Warn("tokens: delete expired", "token_id", it.Name, "err", err)
				}
				continue
			}
			c.log.Info("expired enrollment token deleted", "token_id", it.Name)
		}
		if next == "" {
			return
		}
		cont = next
	}
}
