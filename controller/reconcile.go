package controller

import (
	"context"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/liveness"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// reconcile runs the leader's loops until ctx ends. For now: hosts whose
// agent stopped sending heartbeats get AgentReachable=False, and
// enrollment tokens are deleted a while after they expire.
func (c *Controller) reconcile(ctx context.Context, st *store.Store, rec *events.Recorder) {
	t := time.NewTicker(c.cfg.ReconcileInterval)
	defer t.Stop()
	for {
		c.markSilentAgents(ctx, st, rec)
		c.deleteExpiredTokens(ctx, st)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// markSilentAgents lists the hosts page by page and marks those whose
// agent went silent.
func (c *Controller) markSilentAgents(ctx context.Context, st *store.Store, rec *events.Recorder) {
	newHost := func() proto.Message { return &typesv1.Host{} }
	cont := ""
	for {
		items, next, err := st.List(ctx, "hosts", newHost, store.ListOptions{Limit: 500, Continue: cont})
		if err != nil {
			if ctx.Err() == nil {
				c.log.Warn("liveness: list hosts", "err", err)
			}
			return
		}
		for _, it := range items {
			now := c.cfg.Clock()
			cond := liveness.Decide(it.Msg.(*typesv1.Host), now, c.cfg.AgentSilence)
			if cond == nil {
				continue
			}
			h := it.Msg.(*typesv1.Host)
			h.Status.Conditions, _ = conditions.Set(h.Status.Conditions, cond, now)
			if _, err := st.Update(ctx, "hosts", it.Name, h, it.Rev); err != nil {
				if !errdefs.IsConflict(err) && !errdefs.IsNotFound(err) {
					c.log.Warn("liveness: update host", "host", it.Name, "err", err)
				}
				continue // a heartbeat or apply won the race: look again next round
			}
			c.log.Info("agent unreachable", "host", it.Name, "reason", cond.GetReason())
			rec.Record(ctx, "hosts", it.Name, events.Warning, liveness.ReasonHeartbeatMissed, cond.GetMessage())
		}
		if next == "" {
			return
		}
		cont = next
	}
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
