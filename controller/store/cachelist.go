package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/btree"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Revision returns etcd's current revision: a linearizable read of one
// key that returns no value (the cheapest read that still goes through
// the leader's read index), so a reader that waits for a cache to reach
// it sees every write that completed before it was called. It returns
// Unavailable when etcd does not answer.
func (s *Store) Revision(ctx context.Context) (int64, error) {
	resp, err := s.client.Get(ctx, pauseKey, clientv3.WithCountOnly())
	if err != nil {
		return 0, etcdErr(ctx, "read revision", err)
	}
	return resp.Header.Revision, nil
}

// cacheWait bounds how long ListPage waits for the cache to reach etcd's
// revision before it leaves the page to etcd (Kubernetes' consistent
// list from cache waits 3 s).
const cacheWait = 3 * time.Second

// ListPage is Store.List served from the cache, with Store.List's
// continue tokens and consistency: a listing's first page reads etcd's
// current revision (Revision), waits until the cache has applied it
// (WaitRevision), and pages a snapshot of the cache at that point; its
// later pages read the same snapshot, so a paged listing is one
// consistent state even while the kind changes, and holds every write
// that completed before the listing began. Only items that match (all
// when match is nil) are returned and counted against opts.Limit and
// opts.MaxBytes (their encoded size).
//
// served is false when the cache cannot serve the page (its first
// listing is not in, it did not reach the revision within cacheWait, or
// the continue token's snapshot is no longer kept): the caller lists
// from etcd with the same options instead (Store.List reads the token's
// revision, so a listing that moves from the cache to etcd stays
// consistent). It returns InvalidArgument for a malformed token and
// Unavailable when etcd does not answer the revision read. The messages
// are shared: do not change them (proto.Clone first).
func (c *Cache) ListPage(ctx context.Context, opts ListOptions, match func(Item) bool) (items []Item, next string, served bool, err error) {
	if !c.Synced() {
		return nil, "", false, nil
	}
	var snap *btree.BTreeG[Item]
	var rev int64
	after := ""
	if opts.Continue == "" {
		cur, err := c.st.Revision(ctx)
		if err != nil {
			return nil, "", false, err
		}
		wctx, cancel := context.WithTimeout(ctx, cacheWait)
		err = c.WaitRevision(wctx, cur)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return nil, "", false, ctx.Err()
			}
			if errors.Is(err, context.DeadlineExceeded) {
				c.st.log.Info("cache: behind etcd, listing from etcd", "kind", c.kind, "revision", cur, "cache_revision", c.Revision())
				return nil, "", false, nil
			}
			return nil, "", false, err
		}
		snap, rev = c.snapshotNow()
	} else {
		r, a, err := decodeContinue(opts.Continue)
		if err != nil {
			return nil, "", false, err
		}
		s, ok := c.snapshotAt(r)
		if !ok {
			return nil, "", false, nil
		}
		snap, rev, after = s, r, a
	}
	items, more := page(snap, after, opts, match, c.decoded)
	if more {
		next = encodeContinue(rev, items[len(items)-1].Name)
	}
	return items, next, true, nil
}

// PausedAt is Paused that also returns the etcd revision it read at (one
// linearizable read): a cache that reached the revision holds every write
// that completed before the call.
func (s *Store) PausedAt(ctx context.Context) (*Pause, int64, error) {
	resp, err := s.client.Get(ctx, pauseKey)
	if err != nil {
		return nil, 0, etcdErr(ctx, "read pause", err)
	}
	if len(resp.Kvs) == 0 {
		return nil, resp.Header.Revision, nil
	}
	var p Pause
	if err := json.Unmarshal(resp.Kvs[0].Value, &p); err != nil {
		return nil, 0, fmt.Errorf("read pause: decode the record: %w", err)
	}
	return &p, resp.Header.Revision, nil
}

// PauseChanges counts the changes of the pause (Pause, MarkMoved, Resume,
// Adopt) made through this Store (or a Fenced copy) in this process, each
// counted once its write returned. A reader that decided from a cached
// view of the pause reads it before and after: a change between them
// made here is seen at once (one made by another replica only through
// etcd).
func (s *Store) PauseChanges() uint64 { return s.pauseChanges.Load() }
