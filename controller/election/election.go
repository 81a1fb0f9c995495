// Package election chooses the one controller replica that reconciles,
// with an etcd lease-based election (go.etcd.io/etcd/client/v3/concurrency).
// The other replicas serve reads and stand by; when the leader crashes its
// lease expires and a stand-by takes over after about the lease TTL.
package election

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// DefaultPrefix is the election's key prefix in the Kiln key space.
const DefaultPrefix = "/kiln/v1/election/controller"

// Elector campaigns for leadership on behalf of one replica.
type Elector struct {
	client *clientv3.Client
	prefix string
	id     string
	ttl    int
	log    *slog.Logger
	leader atomic.Bool
	retry  backoff.Policy
	rand   *rand.Rand // Used only by Run's goroutine.
}

// New returns an Elector for the replica id, campaigning under prefix with
// a lease of ttlSeconds (at least 1; etcd may raise very small values to its
// minimum). A crashed leader is replaced after about ttlSeconds.
func New(client *clientv3.Client, prefix, id string, ttlSeconds int, log *slog.Logger) *Elector {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if ttlSeconds < 1 {
		ttlSeconds = 1
	}
	return &Elector{
		client: client,
		prefix: prefix,
		id:     id,
		ttl:    ttlSeconds,
		log:    log.With("component", "election", "id", id),
		rand:   rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64())),
		retry:  backoff.Policy{Base: 200 * time.Millisecond, Max: 5 * time.Second, Factor: 2, Jitter: 0.2},
	}
}

// IsLeader reports whether this replica leads now (lead is running).
func (e *Elector) IsLeader() bool { return e.leader.Load() }

// Leader returns the id of the current leader. It returns NotFound when no
// replica leads and Unavailable when etcd does not answer.
func (e *Elector) Leader(ctx context.Context) (string, error) {
	resp, err := e.client.Get(ctx, e.prefix+"/", clientv3.WithFirstCreate()...)
	if err != nil {
		return "", errdefs.Unavailable("election %s: leader: %w", e.prefix, err)
	}
	if len(resp.Kvs) == 0 {
		return "", errdefs.NotFound("election %s: no leader", e.prefix)
	}
	return string(resp.Kvs[0].Value), nil
}

// Term is one term of leadership: the election key this replica created
// when it won and that key's create revision. The key lives exactly as
// long as the term (it is deleted when the leader resigns or its lease
// expires or is revoked), so a write that compares
// CreateRevision(Key) = Rev (store.Fenced) succeeds only within the term.
type Term struct {
	Key string
	Rev int64
}

// Run campaigns until ctx ends. Each time this replica wins, it calls lead
// with the term and a context that is cancelled when leadership is lost
// (the lease expired or could not be kept alive) or ctx ends; lead must
// return promptly then. When lead returns, Run resigns and campaigns again.
//
// Run blocks and returns ctx.Err() when ctx ends. Leadership is a lease:
// a leader cut off from etcd learns it lost leadership only when its
// client-side lease deadline passes, after a stand-by may have taken
// over. Fence every write of the term with the term's key and revision
// (store.Fenced) so that such a deposed leader's writes are refused.
func (e *Elector) Run(ctx context.Context, lead func(ctx context.Context, term Term)) error {
	for attempt := 0; ; attempt++ {
		if err := e.term(ctx, lead); err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			d := e.retry.Delay(attempt, e.rand)
			e.log.Warn("campaign failed, retrying", "err", err, "retry_in", d)
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(d):
			}
			continue
		}
		attempt = -1
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
}

// term is one campaign and, if won, one term of leadership.
func (e *Elector) term(ctx context.Context, lead func(ctx context.Context, term Term)) error {
	sess, err := concurrency.NewSession(e.client, concurrency.WithTTL(e.ttl), concurrency.WithContext(ctx))
	if err != nil {
		return fmt.Errorf("election %s: new session: %w", e.prefix, err)
	}
	defer sess.Close() // Revokes the lease: stand-bys need not wait for the TTL.

	// Campaign until won, the session dies, or ctx ends.
	cctx, cancelCampaign := context.WithCancel(ctx)
	go func() {
		select {
		case <-sess.Done():
			cancelCampaign()
		case <-cctx.Done():
		}
	}()
	el := concurrency.NewElection(sess, e.prefix)
	e.log.Debug("campaigning")
	err = el.Campaign(cctx, e.id)
	cancelCampaign()
	if err != nil {
		select {
		case <-sess.Done():
			return fmt.Errorf("election %s: session lost while campaigning", e.prefix)
		default:
		}
		return fmt.Errorf("election %s: campaign: %w", e.prefix, err)
	}

	lctx, cancelLead := context.WithCancel(ctx)
	defer cancelLead()
	go func() {
		select {
		case <-sess.Done():
			e.log.Warn("leadership lost: session ended")
		case <-lctx.Done():
		}
		cancelLead()
	}()
	start := time.Now()
	e.leader.Store(true)
	t := Term{Key: el.Key(), Rev: el.Rev()}
	e.log.Info("became leader", "key", t.Key, "rev", t.Rev)
	lead(lctx, t)
	e.leader.Store(false)
	e.log.Info("leadership ended", "held", time.Since(start).Round(time.Millisecond))

	// Resign even when ctx has ended, so a stand-by takes over at once.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := el.Resign(rctx); err != nil {
		e.log.Debug("resign failed", "err", err)
	}
	return nil
}
