package shard

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/backoff"
)

// Key space. Shard and member keys are bound to their member's lease
// (so not in backups); audit records to a lease of AuditTTL.
const (
	// KeyPrefix holds one key per held shard, KeyPrefix+"<n>", whose
	// value is the holder's member ID.
	KeyPrefix = store.Prefix + "shards/"
	// MembersPrefix holds one key per live member (MembersPrefix+ID).
	MembersPrefix = store.Prefix + "shard-members/"
	// AuditPrefix holds the audit log of ownership transitions (Record).
	AuditPrefix = store.Prefix + "shard-audit/"
	// AuditTTL is how long audit records are kept.
	AuditTTL = 24 * time.Hour
)

// Key is the key of shard n.
func Key(n int) string { return KeyPrefix + strconv.Itoa(n) }

// Member is the value of a member key.
type Member struct {
	ID string `json:"id"`
	// Shards is the member's shard count: members that disagree claim
	// nothing new (a host would map to two shards).
	Shards int       `json:"shards"`
	Since  time.Time `json:"since"`
}

// Work runs the reconcilers of one shard until ctx ends (the shard is
// released, lost, or the manager stops); it must return promptly then.
// Every write it makes must be fenced on fence (store.Fenced): the key
// lives exactly as long as this ownership.
type Work func(ctx context.Context, shard int, fence store.Fence)

// Config configures a Manager.
type Config struct {
	// ID is the member (the controller replica's ID). Required.
	ID string
	// Shards is the number of shards; every member must use the same.
	Shards int
	// TTL is the member's lease: a dead member's shards are free after
	// about TTL, and taken by the others right then.
	TTL time.Duration
	// Clock is the time source of audit records (time.Now).
	Clock func() time.Time
}

// Manager keeps one member's shard keys: it registers the member on a
// lease, claims the shards PlanFor assigns it once they are free, releases
// those assigned elsewhere (after their work stopped), stops the work of a
// shard whose key it lost, and records every transition in the audit log.
type Manager struct {
	client *clientv3.Client
	cfg    Config
	work   Work
	log    *slog.Logger
	retry  backoff.Policy

	mu   sync.Mutex
	held map[int]*holding
}

type holding struct {
	rev    int64
	cancel context.CancelFunc
	done   chan struct{}
}

// NewManager returns a Manager; Run starts it.
func NewManager(client *clientv3.Client, cfg Config, work Work, log *slog.Logger) *Manager {
	if cfg.TTL < time.Second {
		cfg.TTL = time.Second
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Manager{
		client: client, cfg: cfg, work: work,
		log:   log.With("component", "shards", "id", cfg.ID),
		retry: backoff.Policy{Base: 200 * time.Millisecond, Max: 5 * time.Second, Factor: 2, Jitter: 0.2},
		held:  map[int]*holding{},
	}
}

// Held returns the shards this member holds now, with their keys' create
// revisions.
func (m *Manager) Held() map[int]int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[int]int64, len(m.held))
	for s, h := range m.held {
		out[s] = h.rev
	}
	return out
}

// Run keeps the member's shards until ctx ends, then stops their work and
// releases them. A lost session (the lease expired: etcd unreachable for a
// TTL) stops the work of every shard at once and joins again. It blocks
// and returns ctx.Err().
func (m *Manager) Run(ctx context.Context) error {
	rnd := rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
	for attempt := 0; ; attempt++ {
		err := m.session(ctx)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		d := m.retry.Delay(attempt, rnd)
		m.log.Warn("shard membership ended; joining again", "err", err, "retry_in", d)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(d):
		}
	}
}

// session is one membership: one lease.
func (m *Manager) session(ctx context.Context) error {
	// The lease outlives ctx until the shards are released on shutdown:
	// only its creation is cut short by ctx.
	lctx, lcancel := context.WithCancel(context.WithoutCancel(ctx))
	defer lcancel()
	stop := context.AfterFunc(ctx, lcancel)
	sess, err := concurrency.NewSession(m.client, concurrency.WithTTL(int(m.cfg.TTL/time.Second)), concurrency.WithContext(lctx))
	if !stop() {
		if err == nil {
			sess.Close()
		}
		return ctx.Err()
	}
	if err != nil {
		return fmt.Errorf("shards: new session: %w", err)
	}
	defer sess.Close() // Revokes the lease: the member key goes at once.
	audit, err := m.client.Grant(ctx, int64(AuditTTL/time.Second))
	if err != nil {
		return fmt.Errorf("shards: grant audit lease: %w", err)
	}
	val, _ := json.Marshal(Member{ID: m.cfg.ID, Shards: m.cfg.Shards, Since: m.cfg.Clock().UTC()})
	if _, err := m.client.Put(ctx, MembersPrefix+m.cfg.ID, string(val), clientv3.WithLease(sess.Lease())); err != nil {
		return fmt.Errorf("shards: register member: %w", err)
	}
	m.log.Info("shard member joined", "shards", m.cfg.Shards, "lease", fmt.Sprintf("%x", sess.Lease()))

	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-sess.Done():
			cancel()
		case <-sctx.Done():
		}
	}()
	kick := make(chan struct{}, 1)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); m.watch(sctx, kick, audit.ID) }()
	defer wg.Wait()

	tick := time.NewTicker(m.cfg.TTL / 2)
	defer tick.Stop()
	for {
		if err := m.round(sctx, sess.Lease(), audit.ID); err != nil && sctx.Err() == nil {
			m.log.Warn("shard round", "err", err)
		}
		select {
		case <-sctx.Done():
			if ctx.Err() != nil {
				select {
				case <-sess.Done():
				default:
					m.releaseAll(context.WithoutCancel(ctx), audit.ID)
					return nil
				}
			}
			m.dropAll("session ended")
			return fmt.Errorf("shards: session lost (lease %x)", sess.Lease())
		case <-kick:
		case <-tick.C:
		}
	}
}

// round observes the shard and member keys and acts on PlanFor.
func (m *Manager) round(ctx context.Context, lease, audit clientv3.LeaseID) error {
	resp, err := m.client.Txn(ctx).Then(
		clientv3.OpGet(KeyPrefix, clientv3.WithPrefix()),
		clientv3.OpGet(MembersPrefix, clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return fmt.Errorf("read shards: %w", err)
	}
	owners := map[int]string{}
	revs := map[int]int64{}
	for _, kv := range resp.Responses[0].GetResponseRange().Kvs {
		if n, ok := parseShardKey(string(kv.Key)); ok {
			owners[n], revs[n] = string(kv.Value), kv.CreateRevision
		}
	}
	var members []string
	agree := true
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		var mem Member
		if err := json.Unmarshal(kv.Value, &mem); err != nil {
			continue
		}
		members = append(members, strings.TrimPrefix(string(kv.Key), MembersPrefix))
		if mem.Shards != m.cfg.Shards {
			agree = false
			m.log.Error("shard members disagree on the shard count: claiming nothing until they agree (kiln-controller run --shards must be the same on every replica)",
				"member", mem.ID, "their_shards", mem.Shards, "our_shards", m.cfg.Shards)
		}
	}

	// Shards whose key is gone or is another ownership now: stop at once.
	m.mu.Lock()
	for s, h := range m.held {
		if revs[s] != h.rev {
			h.cancel()
			delete(m.held, s)
			m.log.Warn("shard lost: its work stopped", "shard", s, "held", h.rev, "owner_now", owners[s])
		}
	}
	m.mu.Unlock()

	plan := PlanFor(m.cfg.ID, m.cfg.Shards, members, owners)
	for _, s := range plan.Release {
		if err := m.release(ctx, s, audit); err != nil {
			return err
		}
	}
	if !agree {
		return nil
	}
	for _, s := range plan.Claim {
		if _, taken := owners[s]; taken {
			continue // its owner releases it, or its lease expires, first
		}
		if err := m.claim(ctx, s, lease, audit); err != nil {
			return err
		}
	}
	return nil
}

// claim creates shard s's key if absent, recording the claim in the same
// transaction, and starts its work.
func (m *Manager) claim(ctx context.Context, s int, lease, audit clientv3.LeaseID) error {
	now := m.cfg.Clock().UTC()
	rec, _ := json.Marshal(Record{Shard: s, Kind: KindClaim, Member: m.cfg.ID, By: m.cfg.ID, Time: now})
	key := Key(s)
	resp, err := m.client.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
		Then(clientv3.OpPut(key, m.cfg.ID, clientv3.WithLease(lease)),
			clientv3.OpPut(claimKey(s, m.cfg.ID, now), string(rec), clientv3.WithLease(audit))).
		Commit()
	if err != nil {
		return fmt.Errorf("claim shard %d: %w", s, err)
	}
	if !resp.Succeeded {
		return nil // taken meanwhile: the next round sees by whom
	}
	rev := resp.Header.Revision
	wctx, cancel := context.WithCancel(context.Background())
	h := &holding{rev: rev, cancel: cancel, done: make(chan struct{})}
	m.mu.Lock()
	m.held[s] = h
	m.mu.Unlock()
	m.log.Info("shard claimed", "shard", s, "rev", rev)
	go func() {
		defer close(h.done)
		m.work(wctx, s, store.Fence{Key: key, Rev: rev, Held: fmt.Sprintf("shard %d", s)})
	}()
	return nil
}

// release stops shard s's work, waits for it, then deletes the key if it
// is still this ownership, recording the release in the same transaction.
func (m *Manager) release(ctx context.Context, s int, audit clientv3.LeaseID) error {
	m.mu.Lock()
	h := m.held[s]
	delete(m.held, s)
	m.mu.Unlock()
	if h == nil {
		return nil
	}
	h.cancel()
	<-h.done
	rec, _ := json.Marshal(Record{Shard: s, Kind: KindRelease, Member: m.cfg.ID, Held: h.rev, By: m.cfg.ID, Time: m.cfg.Clock().UTC()})
	key := Key(s)
	_, err := m.client.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(key), "=", h.rev)).
		Then(clientv3.OpDelete(key), clientv3.OpPut(endKey(s, h.rev), string(rec), clientv3.WithLease(audit))).
		Commit()
	if err != nil {
		// The work is stopped; the key goes with the lease if not now.
		return fmt.Errorf("release shard %d: %w", s, err)
	}
	m.log.Info("shard released", "shard", s, "held", h.rev)
	return nil
}

// releaseAll releases every held shard (on shutdown), within a bound.
func (m *Manager) releaseAll(ctx context.Context, audit clientv3.LeaseID) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	m.mu.Lock()
	shards := slices.Sorted(maps.Keys(m.held))
	m.mu.Unlock()
	for _, s := range shards {
		if err := m.release(ctx, s, audit); err != nil {
			m.log.Warn("release shard on shutdown", "shard", s, "err", err)
		}
	}
	m.dropAll("shutdown")
}

// dropAll stops the work of every held shard and waits for it.
func (m *Manager) dropAll(why string) {
	m.mu.Lock()
	held := m.held
	m.held = map[int]*holding{}
	m.mu.Unlock()
	for s, h := range held {
		h.cancel()
		<-h.done
		m.log.Warn("shard work stopped", "shard", s, "held", h.rev, "why", why)
	}
}

// watch kicks a round on every change of a shard or member key, and
// records the loss of every shard key etcd deleted (lease expired or
// revoked) that no release recorded, with the delete's revision.
func (m *Manager) watch(ctx context.Context, kick chan<- struct{}, audit clientv3.LeaseID) {
	wctx := clientv3.WithRequireLeader(ctx)
	keys := m.client.Watch(wctx, KeyPrefix, clientv3.WithPrefix(), clientv3.WithPrevKV())
	members := m.client.Watch(wctx, MembersPrefix, clientv3.WithPrefix())
	poke := func() {
		select {
		case kick <- struct{}{}:
		default:
		}
	}
	for {
		select {
		case <-ctx.Done():
			return
		case w, ok := <-keys:
			if !ok || w.Err() != nil {
				if ctx.Err() == nil {
					m.log.Warn("shard key watch ended; watching again", "err", w.Err())
					keys = m.client.Watch(wctx, KeyPrefix, clientv3.WithPrefix(), clientv3.WithPrevKV())
				}
				poke()
				continue
			}
			for _, ev := range w.Events {
				if ev.Type == clientv3.EventTypeDelete && ev.PrevKv != nil {
					m.recordLost(ctx, ev, audit)
				}
			}
			poke()
		case w, ok := <-members:
			if !ok || w.Err() != nil {
				if ctx.Err() == nil {
					members = m.client.Watch(wctx, MembersPrefix, clientv3.WithPrefix())
				}
			}
			poke()
		}
	}
}

// recordLost writes the end of the ownership a delete event ended, unless
// one is recorded (a release writes its own in the delete's transaction).
func (m *Manager) recordLost(ctx context.Context, ev *clientv3.Event, audit clientv3.LeaseID) {
	s, ok := parseShardKey(string(ev.Kv.Key))
	if !ok {
		return
	}
	held := ev.PrevKv.CreateRevision
	rec, _ := json.Marshal(Record{Shard: s, Kind: KindLost, Member: string(ev.PrevKv.Value), Held: held,
		Rev: ev.Kv.ModRevision, By: m.cfg.ID, Time: m.cfg.Clock().UTC()})
	k := endKey(s, held)
	resp, err := m.client.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0)).
		Then(clientv3.OpPut(k, string(rec), clientv3.WithLease(audit))).
		Commit()
	if err != nil {
		if ctx.Err() == nil {
			m.log.Warn("record shard loss", "shard", s, "err", err)
		}
		return
	}
	if resp.Succeeded {
		m.log.Info("shard lost by its holder (lease ended)", "shard", s, "holder", string(ev.PrevKv.Value), "held", held, "rev", ev.Kv.ModRevision)
	}
}
