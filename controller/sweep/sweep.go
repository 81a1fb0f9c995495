// Package sweep holds the controller's periodic sweeps over all hosts and
// tokens that no executor owns: the leader's (LifecycleRunning=False
// cleared when it runs the lifecycle, expired enrollment tokens deleted)
// and an API-only replica's watch for a leader (LifecycleRunning=False set
// on every host when none leads). See docs/controller.md, "API-only
// replicas".
package sweep

import (
	"context"
	"log/slog"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/cacheindex"
	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Config configures a Sweeper.
type Config struct {
	// ID names this replica (in the LifecycleRunning=False message).
	ID string
	// Interval is how often a sweep runs.
	Interval time.Duration
	// ElectionTTL is the leader lease; an API-only replica tells the hosts
	// after leaderlessGrace of them without a leader.
	ElectionTTL time.Duration
	// Lifecycle is set when this replica runs the host lifecycle when it
	// leads: its sweep then clears LifecycleRunning=False.
	Lifecycle bool
	// Clock is the time source.
	Clock func() time.Time
	// Hosts, when set, is the replica's Host cache: the leader's sweep
	// finds the hosts to change there instead of listing every Host from
	// etcd each Interval (100,000 Hosts every 5 s), and writes only those,
	// with the revision it read (a host changed meanwhile waits for the
	// next sweep). With the cacheindex.ConditionNotTrue index
	// (cacheindex.Add) it reads only the hosts that carry the condition;
	// without, it reads them all from the cache.
	Hosts *store.Cache
}

// Sweeper runs the sweeps of one replica.
type Sweeper struct {
	cfg Config
	log *slog.Logger
}

// New returns a Sweeper; cfg.Clock defaults to time.Now.
func New(cfg Config, log *slog.Logger) *Sweeper {
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Sweeper{cfg: cfg, log: log}
}

// Leader runs the leader's sweep every interval until ctx ends, on st
// (fenced on the leader's term by the caller): a leader that runs the
// lifecycle removes LifecycleRunning=False (leaderwatch.go), and
// enrollment tokens are deleted a while after they expire. It blocks.
func (s *Sweeper) Leader(ctx context.Context, st *store.Store, rec *events.Recorder) {
	t := time.NewTicker(s.cfg.Interval)
	defer t.Stop()
	for {
		s.reconcileHosts(ctx, st, rec)
		s.deleteExpiredTokens(ctx, st)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// reconcileHosts clears LifecycleRunning=False when this replica runs the
// lifecycle. (Silent agents are marked by the liveness monitor of the
// replica that receives their heartbeats, controller/liveness.)
func (s *Sweeper) reconcileHosts(ctx context.Context, st *store.Store, rec *events.Recorder) {
	if !s.cfg.Lifecycle {
		return
	}
	if s.cfg.Hosts != nil {
		s.clearCachedHosts(ctx, st)
		return
	}
	s.updateHosts(ctx, st, func(h *typesv1.Host, _ time.Time) bool {
		return clearLifecycleDisabled(h)
	}, func(*typesv1.Host) {})
}

// clearCachedHosts is reconcileHosts from the Host cache: the hosts that
// say LifecycleRunning=False are written without it; the others are not
// decoded, copied or written (with the cache's ConditionNotTrue index:
// the condition is only ever False).
func (s *Sweeper) clearCachedHosts(ctx context.Context, st *store.Store) {
	var items []store.Item
	if c := s.cfg.Hosts; c.HasIndex(cacheindex.ConditionNotTrue) {
		if !c.Synced() {
			return // the next sweep
		}
		items = c.ByIndex(cacheindex.ConditionNotTrue, ConditionLifecycleRunning)
	} else {
		var err error
		if items, err = c.List(ctx); err != nil {
			if ctx.Err() == nil {
				s.log.Warn("hosts cache", "err", err)
			}
			return
		}
	}
	for _, it := range items {
		cached := it.Msg.(*typesv1.Host)
		if conditions.Get(cached.GetStatus().GetConditions(), ConditionLifecycleRunning) == nil {
			continue
		}
		h := proto.CloneOf(cached) // the cache's messages are shared
		clearLifecycleDisabled(h)
		if _, err := st.Update(ctx, "hosts", it.Name, h, it.Rev); err != nil && !errdefs.IsConflict(err) && !errdefs.IsNotFound(err) {
			s.log.Warn("update host", "host", it.Name, "err", err)
		}
	}
}

// tokenRetention keeps expired tokens around for a while, so an agent
// presenting one is told it expired rather than that it is unknown.
const tokenRetention = 24 * time.Hour

// deleteExpiredTokens removes enrollment tokens that expired more than
// tokenRetention ago.
func (s *Sweeper) deleteExpiredTokens(ctx context.Context, st *store.Store) {
	newToken := func() proto.Message { return &typesv1.EnrollmentToken{} }
	cont := ""
	for {
		items, next, err := st.List(ctx, enrollment.TokensKind, newToken, store.ListOptions{Limit: 500, Continue: cont})
		if err != nil {
			if ctx.Err() == nil {
				s.log.Warn("tokens: list", "err", err)
			}
			return
		}
		now := s.cfg.Clock()
		for _, it := range items {
			tok := it.Msg.(*typesv1.EnrollmentToken)
			if now.Sub(tok.GetExpires().AsTime()) <= tokenRetention {
				continue
			}
			if err := st.Delete(ctx, enrollment.TokensKind, it.Name, it.Rev); err != nil {
				if !errdefs.IsConflict(err) && !errdefs.IsNotFound(err) {
					s.log.Warn("tokens: delete expired", "token_id", it.Name, "err", err)
				}
				continue
			}
			s.log.Info("expired enrollment token deleted", "token_id", it.Name)
		}
		if next == "" {
			return
		}
		cont = next
	}
}
