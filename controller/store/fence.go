package store

import (
	"context"
	"errors"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// ErrFenced is the class of a write a fenced Store refused because its
// fence no longer holds: the controller that made it was deposed. Test
// with errors.Is; it is also FailedPrecondition.
var ErrFenced = errors.New("fenced")

// Fence names the election key of a leader's term and the revision that
// created it (election.Term). While the key exists with that create
// revision, the term lasts.
type Fence struct {
	Key string
	Rev int64
	// Held names what the key stands for in a refusal ("shard 3"); empty
	// for the leader election's key.
	Held string
}

// Fenced returns a view of s whose every write (Create, Update, Delete,
// PutSecret, DeleteSecret) also compares, in the same etcd transaction,
// the create revision of f.Key with f.Rev: once the term ends (the leader
// resigned, or its lease expired or was revoked, and another replica may
// lead) the write is refused with ErrFenced and nothing is written. Reads
// are not fenced. The view shares s's client and sealer.
//
// Equivalent to: `etcdctl txn` with `c(KEY) = REV` added to every compare.
func (s *Store) Fenced(f Fence) *Store {
	c := *s
	c.fence = &f
	return &c
}

// CheckFence returns nil while the fence of s holds (always, for an
// unfenced Store) and the controller is not paused for a move, an
// ErrFenced error once the fence does not hold, and an ErrPaused error
// while paused. It is a linearizable read through etcd, for a step whose
// start writes nothing.
func (s *Store) CheckFence(ctx context.Context) error {
	if s.fence == nil {
		return nil
	}
	resp, err := s.client.Txn(ctx).If(s.guard()...).Else(s.orElse()...).Commit()
	if err != nil {
		return etcdErr(ctx, "check leader fence "+s.fence.Key, err)
	}
	if !resp.Succeeded {
		if err := s.broken(resp, "start a step"); err != nil {
			return err
		}
		return s.fencedErr("start a step")
	}
	return nil
}

// guard adds, to cmps, the pause's compare (the controller is not paused
// for a move) and the fence's compare.
func (s *Store) guard(cmps ...clientv3.Cmp) []clientv3.Cmp {
	cmps = append(cmps, pauseCmp())
	if s.fence == nil {
		return cmps
	}
	return append(cmps, s.fenceCmp())
}

// orElse adds, to the else branch, a read of the fence key and then of
// the pause record, which broken then looks at.
func (s *Store) orElse(ops ...clientv3.Op) []clientv3.Op {
	if s.fence != nil {
		ops = append(ops, clientv3.OpGet(s.fence.Key, clientv3.WithKeysOnly()))
	}
	return append(ops, clientv3.OpGet(pauseKey))
}

// broken reports whether a failed transaction built with guard and
// orElse failed because of the pause or the fence, and returns their
// error.
func (s *Store) broken(resp *clientv3.TxnResponse, op string) error {
	n := len(resp.Responses)
	if n == 0 {
		return nil
	}
	if kvs := resp.Responses[n-1].GetResponseRange().Kvs; len(kvs) > 0 {
		return pausedErr(kvs[0].Value, op)
	}
	if s.fence == nil || n < 2 {
		return nil
	}
	kvs := resp.Responses[n-2].GetResponseRange().Kvs
	if len(kvs) == 1 && kvs[0].CreateRevision == s.fence.Rev {
		return nil
	}
	return s.fencedErr(op)
}

func (s *Store) fenceCmp() clientv3.Cmp {
	return clientv3.Compare(clientv3.CreateRevision(s.fence.Key), "=", s.fence.Rev)
}

func (s *Store) fencedErr(op string) error {
	if s.fence.Held != "" {
		return fmt.Errorf("%w (%w)", errdefs.FailedPrecondition(
			"%s refused: this controller no longer holds %s (key %s of revision %d is gone: lease expired, released or revoked); it writes nothing more for it and the next holder carries on",
			op, s.fence.Held, s.fence.Key, s.fence.Rev), ErrFenced)
	}
	return fmt.Errorf("%w (%w)", errdefs.FailedPrecondition(
		"%s refused: this controller is no longer the leader (election key %s of revision %d is gone: lease expired, revoked or resigned); it writes nothing more and the new leader carries on",
		op, s.fence.Key, s.fence.Rev), ErrFenced)
}
