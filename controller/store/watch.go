package store

import (
	"context"
	"errors"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// EventType says what happened to a resource.
type EventType int

// The event types.
const (
	EventPut EventType = iota + 1
	EventDelete
	// eventProgress is only in a Cache's own watch (watchProgress): every
	// change up to Rev was delivered.
	eventProgress
)

func (t EventType) String() string {
	switch t {
	case EventPut:
		return "Put"
	case EventDelete:
		return "Delete"
	}
	return "Unknown"
}

// WatchEvent is one change of a resource, or the error that ended a watch.
type WatchEvent struct {
	Type EventType
	Name string
	// Rev is the revision of the change (the resource's new mod revision
	// for a Put).
	Rev int64
	// Value is the protobuf encoding of the resource after a Put; empty
	// for a Delete.
	Value []byte
	// Err, when set, is the last event: the watch cannot continue. It is
	// FailedPrecondition when the requested history was compacted: list
	// again and watch from the list's revision + 1.
	Err error
	// revMore: more changes of revision Rev follow (a transaction's
	// changes share its revision); a Cache has applied Rev only after the
	// last.
	revMore bool
}

// watchRetry is the pause before a watch is re-established after etcd
// ended it (member lost its leader, connection broke).
const watchRetry = 500 * time.Millisecond

// Watch streams the changes to resources of kind, starting at revision
// fromRev (inclusive; 0 means from now). Typical use: List, then Watch from
// the revision after the newest item or the header revision.
//
// The channel closes when ctx ends or after an event with Err set. Watch
// survives etcd member failures and reconnects: it resumes after the last
// delivered revision, so no change is skipped or repeated. If that
// revision has been compacted away meanwhile, it reports a
// FailedPrecondition error instead.
func (s *Store) Watch(ctx context.Context, kind string, fromRev int64) <-chan WatchEvent {
	ch := make(chan WatchEvent, 64)
	go func() {
		defer close(ch)
		if err := checkKind(kind); err != nil {
			send(ctx, ch, WatchEvent{Err: err})
			return
		}
		s.watch(ctx, kind, fromRev, ch, false)
	}()
	return ch
}

// watchProgress is Watch with etcd's progress notifications passed on,
// in order with the changes, as eventProgress events: a Cache learns from
// them that it is current up to a revision no change of its kind has.
func (s *Store) watchProgress(ctx context.Context, kind string, fromRev int64) <-chan WatchEvent {
	ch := make(chan WatchEvent, 64)
	go func() {
		defer close(ch)
		s.watch(ctx, kind, fromRev, ch, true)
	}()
	return ch
}

func (s *Store) watch(ctx context.Context, kind string, next int64, ch chan<- WatchEvent, progress bool) {
	prefix := Prefix + kind + "/"
	for {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithCreatedNotify(), clientv3.WithProgressNotify()}
		if next > 0 {
			opts = append(opts, clientv3.WithRev(next))
		}
		for resp := range s.client.Watch(wctx, prefix, opts...) {
			if resp.CompactRevision != 0 {
				cancel()
				send(ctx, ch, WatchEvent{Err: errdefs.FailedPrecondition(
					"watch %s from revision %d: history compacted up to revision %d; list again and watch from there",
					kind, next, resp.CompactRevision)})
				return
			}
			if err := resp.Err(); err != nil {
				if permanent(err) {
					cancel()
					send(ctx, ch, WatchEvent{Err: errdefs.FailedPrecondition("watch %s: %w", kind, err)})
					return
				}
				s.log.Warn("watch interrupted, re-establishing", "kind", kind, "next_rev", next, "err", err)
				break
			}
			if resp.Created {
				// A watch "from now" starts after the revision current
				// at creation; a restart must begin there too.
				if next == 0 {
					next = resp.Header.Revision + 1
				}
				continue
			}
			if resp.IsProgressNotify() {
				// Every change up to the header revision was delivered.
				next = max(next, resp.Header.Revision+1)
				if progress && !send(ctx, ch, WatchEvent{Type: eventProgress, Rev: resp.Header.Revision}) {
					cancel()
					return
				}
				continue
			}
			for i, ev := range resp.Events {
				we := WatchEvent{Name: strings.TrimPrefix(string(ev.Kv.Key), prefix), Rev: ev.Kv.ModRevision}
				// etcd never splits a revision's changes across responses.
				we.revMore = i < len(resp.Events)-1 && resp.Events[i+1].Kv.ModRevision == ev.Kv.ModRevision
				if ev.Type == clientv3.EventTypeDelete {
					we.Type = EventDelete
				} else {
					we.Type = EventPut
					we.Value = ev.Kv.Value
				}
				if !send(ctx, ch, we) {
					cancel()
					return
				}
				next = ev.Kv.ModRevision + 1
			}
		}
		cancel()
		select {
		case <-ctx.Done():
			return
		case <-time.After(watchRetry):
		}
	}
}

func send(ctx context.Context, ch chan<- WatchEvent, ev WatchEvent) bool {
	select {
	case ch <- ev:
		return true
	case <-ctx.Done():
		return false
	}
}

// permanent reports whether a watch error will not go away by watching
// again (authentication or permission problems, a malformed request, a watch
// etcd cancelled with a reason).
func permanent(err error) bool {
	code := status.Code(err)
	var ee interface{ Code() codes.Code }
	if errors.As(err, &ee) { // etcd's rpctypes.EtcdError
		code = ee.Code()
	}
	switch code {
	case codes.PermissionDenied, codes.Unauthenticated, codes.InvalidArgument, codes.FailedPrecondition, codes.OutOfRange:
		return true
	}
	return false
}
