package enrollment

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/kilnhq/kiln/controller/store"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// HostCache is the replica's watch cache of Hosts (*store.Cache).
type HostCache interface {
	// Get returns the cached Host (shared: read only).
	Get(name string) (store.Item, bool)
	// WaitRevision returns once the cache applied revision rev.
	WaitRevision(ctx context.Context, rev int64) error
}

var _ HostCache = (*store.Cache)(nil)

// PauseReader reads the controller-wide pause and etcd's revision in one
// linearizable read (*store.Store).
type PauseReader interface {
	PausedAt(ctx context.Context) (*store.Pause, int64, error)
	// PauseChanges counts the pause changes made in this process.
	PauseChanges() uint64
}

var _ PauseReader = (*store.Store)(nil)

// Host cache checks: how often RunHostCache confirms that the cache is
// current, and how old a confirmation may be for a heartbeat to be
// answered from the cache.
const (
	hostCacheCheck = time.Second
	// MaxHostCacheLag bounds how stale a Host may be when an idle
	// heartbeat is accepted from the cache: a certificate serial
	// replaced or revoked (a re-enrollment, a renewal, a deleted Host)
	// more than this long ago is refused.
	MaxHostCacheLag = 5 * time.Second
)

// freshness is what the last check of the host cache found.
type freshness struct {
	// at is when the check's revision read began: every write that
	// completed before it is in the cache.
	at time.Time
	// paused: the controller was paused for a move (heartbeats then go
	// to etcd, whose read tells the agent where its fleet went).
	paused bool
	// pauseChanges is PauseChanges before the check: a pause or resume
	// through this replica (kilnctl move) after it sends heartbeats to
	// etcd at once, not within MaxHostCacheLag.
	pauseChanges uint64
}

// hostCache is the Service's use of a HostCache (UseHostCache).
type hostCache struct {
	hosts  HostCache
	pauses PauseReader
	fresh  atomic.Pointer[freshness]
}

// UseHostCache makes idle heartbeats read their Host from hosts instead of
// etcd, once RunHostCache has confirmed that hosts is current (a
// linearizable read of etcd's revision, then WaitRevision) within
// MaxHostCacheLag. Call before serving; then run RunHostCache.
//
// Why a stale read is safe here: a heartbeat that would write nothing
// only marks the agent seen in this replica's memory; one that changes
// its Host (a first check-in) writes it with a compare-and-swap on the
// cached revision, so a Host changed since fails the swap and the
// heartbeat is decided again on a linearizable read; one that is refused
// or finds no Host goes to etcd as before, so a refusal and a NotFound
// are decided on a linearizable read. What the lag can do is
// accept a certificate serial replaced or revoked within the last
// MaxHostCacheLag (the cache was confirmed current at most that long
// ago, and holds every write before that), mark seen a host deleted as
// recently, and answer as if not paused for that long after another
// replica recorded a pause (a pause through this replica takes effect at
// once: PauseChanges): each is refused by the next heartbeat after that.
func (s *Service) UseHostCache(hosts HostCache, pauses PauseReader) {
	s.hostCache = &hostCache{hosts: hosts, pauses: pauses}
}

// RunHostCache confirms every second, until ctx ends, that the host cache
// is current (UseHostCache); heartbeats use the cache only while the last
// confirmation is younger than MaxHostCacheLag. It blocks; it returns at
// once without a host cache.
func (s *Service) RunHostCache(ctx context.Context) {
	hc := s.hostCache
	if hc == nil {
		return
	}
	t := time.NewTicker(hostCacheCheck)
	defer t.Stop()
	for {
		s.checkHostCache(ctx, hc)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (s *Service) checkHostCache(ctx context.Context, hc *hostCache) {
	at, changes := s.cfg.Clock(), hc.pauses.PauseChanges()
	p, rev, err := hc.pauses.PausedAt(ctx)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Debug("host cache check: read revision", "err", err)
		}
		return
	}
	wctx, cancel := context.WithTimeout(ctx, MaxHostCacheLag)
	defer cancel()
	if err := hc.hosts.WaitRevision(wctx, rev); err != nil {
		if ctx.Err() == nil {
			s.log.Info("host cache check: cache behind etcd, heartbeats read etcd", "revision", rev, "err", err)
		}
		return
	}
	hc.fresh.Store(&freshness{at: at, paused: p != nil, pauseChanges: changes})
}

// HostCacheConfirmed is when the host cache was last confirmed current
// (RunHostCache); the zero time when never, or without a host cache.
func (s *Service) HostCacheConfirmed() time.Time {
	if s.hostCache == nil {
		return time.Time{}
	}
	if f := s.hostCache.fresh.Load(); f != nil {
		return f.at
	}
	return time.Time{}
}

// cachedHost returns the cached Host of host (shared: read only) and its
// mod revision; ok is false when the caller must go to etcd: no cache,
// not confirmed current within MaxHostCacheLag, paused, or no such Host
// in it.
func (s *Service) cachedHost(host string, now time.Time) (*typesv1.Host, int64, bool) {
	hc := s.hostCache
	if hc == nil {
		return nil, 0, false
	}
	f := hc.fresh.Load()
	if f == nil || f.paused || now.Sub(f.at) > MaxHostCacheLag || hc.pauses.PauseChanges() != f.pauseChanges {
		return nil, 0, false
	}
	it, ok := hc.hosts.Get(host)
	if !ok {
		return nil, 0, false
	}
	h, ok := it.Msg.(*typesv1.Host)
	if !ok {
		return nil, 0, false
	}
	return h, it.Rev, true
}
