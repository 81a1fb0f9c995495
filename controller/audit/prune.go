package audit

import (
	"context"
	"log/slog"
	"time"

	"github.com/kilnhq/kiln/controller/store"
)

// DefaultPruneInterval is how often the audit log is pruned.
const DefaultPruneInterval = time.Hour

// Retention bounds the audit log.
type Retention struct {
	// MaxAge is how long entries are kept (<= 0: no age limit).
	MaxAge time.Duration
	// MaxEntries is how many entries are kept at most (<= 0: no count
	// limit; store.PruneAudit).
	MaxEntries int64
	// Interval is how often Prune applies it (> 0).
	Interval time.Duration
}

// Prune applies r to the audit log now and every r.Interval until ctx
// ends; it blocks. Every replica prunes (deleting an old range twice is
// harmless), so retention holds without a leader. A failed round is
// logged and retried at the next.
func Prune(ctx context.Context, st *store.Store, r Retention, clock func() time.Time, log *slog.Logger) {
	t := time.NewTicker(r.Interval)
	defer t.Stop()
	for {
		var before time.Time
		if r.MaxAge > 0 {
			before = clock().Add(-r.MaxAge)
		}
		n, err := st.PruneAudit(ctx, before, r.MaxEntries)
		switch {
		case err != nil && ctx.Err() == nil:
			log.Warn("audit log not pruned", "err", err)
		case n > 0:
			log.Info("audit log pruned", "deleted", n, "max_age", r.MaxAge, "max_entries", r.MaxEntries)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
