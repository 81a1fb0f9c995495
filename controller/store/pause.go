package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// ReplicasPrefix is where live controller replicas register, each key
// bound to its replica's lease (controller/liveness.Register). A backup
// leaves them out and a move's target keeps its own.
const ReplicasPrefix = Prefix + "replicas/"

// ErrPaused is the class of a write a Store refused because the
// controller is paused for a move (Pause). Test with errors.Is; it is also
// FailedPrecondition, and its message says where the controller moved.
var ErrPaused = errors.New("paused")

// maintenanceKind holds the controller-wide pause record; no resource
// kind may use it, and backups leave it out (a copy taken during a move
// must not arrive paused).
const maintenanceKind = "maintenance"

// pauseKey is the controller-wide "paused for move" record.
const pauseKey = Prefix + maintenanceKind + "/pause"

// Pause is the controller-wide "paused for move" record: while it exists
// every write through any Store of this etcd (the API's, and every
// reconciler's, fenced or not) is refused with ErrPaused, in the same
// transaction as the write, so no write slips in after the pause.
type Pause struct {
	// MovedTo is the controller the fleet moved (or is moving) to: its API
	// address.
	MovedTo string `json:"movedTo"`
	// By is who paused it (the operator certificate's name).
	By string `json:"by"`
	// Since is when the pause was recorded.
	Since time.Time `json:"since"`
	// Moved is set once the copy is verified on MovedTo (the move's last
	// step): the fleet lives there now.
	Moved bool `json:"moved"`
	// From is set instead of MovedTo on the target of a move while it
	// adopts the fleet (Adopt): the address it moves in from.
	From string `json:"from,omitempty"`
}

func (p *Pause) String() string {
	if p.From != "" {
		return fmt.Sprintf("adopting the fleet of %s (since %s)", p.From, p.Since.UTC().Format(time.RFC3339))
	}
	state := "moving to"
	if p.Moved {
		state = "moved to"
	}
	return fmt.Sprintf("%s %s (paused by %s at %s)", state, p.MovedTo, p.By, p.Since.UTC().Format(time.RFC3339))
}

// Pause records p unless a pause is recorded already, and returns the
// pause in force (the one recorded before, if any). It is a single etcd
// transaction: after it returns, no write through a Store succeeds. It
// returns Unavailable when etcd does not answer.
func (s *Store) Pause(ctx context.Context, p Pause) (Pause, error) {
	have, _, err := s.pause(ctx, p)
	return have, err
}

// pause is Pause that also reports whether it recorded p.
func (s *Store) pause(ctx context.Context, p Pause) (Pause, bool, error) {
	defer s.pauseChanges.Add(1)
	val, err := json.Marshal(p)
	if err != nil {
		return Pause{}, false, err
	}
	resp, err := s.client.Txn(ctx).
		If(clientv3.Compare(clientv3.Version(pauseKey), "=", 0)).
		Then(clientv3.OpPut(pauseKey, string(val))).
		Else(clientv3.OpGet(pauseKey)).
		Commit()
	if err != nil {
		return Pause{}, false, etcdErr(ctx, "pause", err)
	}
	if resp.Succeeded {
		return p, true, nil
	}
	kvs := resp.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 {
		return Pause{}, false, errdefs.Unavailable("pause: the pause record changed while it was written; try again")
	}
	var have Pause
	if err := json.Unmarshal(kvs[0].Value, &have); err != nil {
		return Pause{}, false, fmt.Errorf("pause: decode the record: %w", err)
	}
	return have, false, nil
}

// MarkMoved sets Moved on the pause in force. It returns FailedPrecondition
// when the controller is not paused.
func (s *Store) MarkMoved(ctx context.Context) (Pause, error) {
	defer s.pauseChanges.Add(1)
	resp, err := s.client.Get(ctx, pauseKey)
	if err != nil {
		return Pause{}, etcdErr(ctx, "mark moved", err)
	}
	if len(resp.Kvs) == 0 {
		return Pause{}, errdefs.FailedPrecondition("mark moved: the controller is not paused")
	}
	var p Pause
	if err := json.Unmarshal(resp.Kvs[0].Value, &p); err != nil {
		return Pause{}, fmt.Errorf("mark moved: decode the record: %w", err)
	}
	p.Moved = true
	val, err := json.Marshal(p)
	if err != nil {
		return Pause{}, err
	}
	tx, err := s.client.Txn(ctx).
		If(clientv3.Compare(clientv3.ModRevision(pauseKey), "=", resp.Kvs[0].ModRevision)).
		Then(clientv3.OpPut(pauseKey, string(val))).
		Commit()
	if err != nil {
		return Pause{}, etcdErr(ctx, "mark moved", err)
	}
	if !tx.Succeeded {
		return Pause{}, errdefs.Conflict("mark moved: the pause record changed meanwhile; try again")
	}
	return p, nil
}

// Paused returns the pause in force, or nil when the controller is not
// paused. It is a linearizable read.
func (s *Store) Paused(ctx context.Context) (*Pause, error) {
	resp, err := s.client.Get(ctx, pauseKey)
	if err != nil {
		return nil, etcdErr(ctx, "read pause", err)
	}
	if len(resp.Kvs) == 0 {
		return nil, nil
	}
	var p Pause
	if err := json.Unmarshal(resp.Kvs[0].Value, &p); err != nil {
		return nil, fmt.Errorf("read pause: decode the record: %w", err)
	}
	return &p, nil
}

// Resume removes the pause: writes are accepted again. Resuming a
// controller that is not paused does nothing.
func (s *Store) Resume(ctx context.Context) error {
	defer s.pauseChanges.Add(1)
	if _, err := s.client.Delete(ctx, pauseKey); err != nil {
		return etcdErr(ctx, "resume", err)
	}
	return nil
}

// WaitResumed blocks until the controller is not paused (at once when it
// is not), or ctx ends.
func (s *Store) WaitResumed(ctx context.Context) error {
	for {
		resp, err := s.client.Get(ctx, pauseKey)
		if err != nil {
			return etcdErr(ctx, "read pause", err)
		}
		if len(resp.Kvs) == 0 {
			return nil
		}
		wctx, cancel := context.WithCancel(ctx)
		wch := s.client.Watch(clientv3.WithRequireLeader(wctx), pauseKey, clientv3.WithRev(resp.Header.Revision+1))
		for ev := range wch {
			if ev.Err() != nil {
				break
			}
			if len(ev.Events) > 0 && ev.Events[len(ev.Events)-1].Type == clientv3.EventTypeDelete {
				cancel()
				return nil
			}
		}
		cancel()
		if err := ctx.Err(); err != nil {
			return err
		}
	}
}

// UntilPaused returns a context that ends when ctx does or when a pause is
// recorded, whichever comes first, and its cancel function.
func (s *Store) UntilPaused(ctx context.Context) (context.Context, context.CancelFunc) {
	pctx, cancel := context.WithCancel(ctx)
	go func() {
		defer cancel()
		for pctx.Err() == nil {
			resp, err := s.client.Get(pctx, pauseKey)
			if err != nil {
				select {
				case <-pctx.Done():
				case <-time.After(time.Second):
				}
				continue
			}
			if len(resp.Kvs) > 0 {
				return
			}
			wch := s.client.Watch(clientv3.WithRequireLeader(pctx), pauseKey, clientv3.WithRev(resp.Header.Revision+1))
			for ev := range wch {
				if ev.Err() != nil {
					break
				}
				for _, e := range ev.Events {
					if e.Type == clientv3.EventTypePut {
						return
					}
				}
			}
		}
	}()
	return pctx, cancel
}

// pauseCmp holds while the controller is not paused.
func pauseCmp() clientv3.Cmp {
	return clientv3.Compare(clientv3.Version(pauseKey), "=", 0)
}

// pausedErr reads why a write was refused by pauseCmp.
func pausedErr(value []byte, op string) error {
	var p Pause
	msg := "paused"
	if err := json.Unmarshal(value, &p); err == nil {
		msg = p.String()
	}
	return fmt.Errorf("%w (%w)", errdefs.FailedPrecondition(
		"%s refused: this controller is paused for a move: %s; use the controller there (kilnctl --kilnconfig of that controller), or resume this one with kilnctl move --resume if the move was abandoned",
		op, msg), &PausedError{Pause: p})
}

// PausedError is the cause of a write (or GetUnpaused) refused by the
// pause: errors.Is(err, ErrPaused) holds for it, and errors.As gives the
// pause record (an empty one when the record did not decode).
type PausedError struct{ Pause Pause }

func (e *PausedError) Error() string { return ErrPaused.Error() }

// Is makes errors.Is(err, ErrPaused) hold.
func (e *PausedError) Is(target error) bool { return target == ErrPaused }

// PauseOf returns the pause record that refused err, if it was refused
// by one.
func PauseOf(err error) (Pause, bool) {
	var pe *PausedError
	if errors.As(err, &pe) {
		return pe.Pause, true
	}
	return Pause{}, false
}

// GetUnpaused is Get that fails, as a write would, with the pause's error
// while this controller is paused for a move, in the same round trip (one
// etcd transaction). Agents' heartbeats read their Host with it: a
// heartbeat that writes nothing must still tell the agent where its fleet
// went.
func (s *Store) GetUnpaused(ctx context.Context, kind, name string, into proto.Message) (int64, error) {
	key, err := resourceKey(kind, name)
	if err != nil {
		return 0, err
	}
	resp, err := s.client.Txn(ctx).If(pauseCmp()).Then(clientv3.OpGet(key)).Else(clientv3.OpGet(pauseKey)).Commit()
	if err != nil {
		return 0, etcdErr(ctx, "get "+key, err)
	}
	kvs := resp.Responses[0].GetResponseRange().Kvs
	if !resp.Succeeded {
		var value []byte
		if len(kvs) > 0 {
			value = kvs[0].Value
		}
		return 0, pausedErr(value, "heartbeat")
	}
	if len(kvs) == 0 {
		return 0, errdefs.NotFound("%s %q not found", kind, name)
	}
	if err := proto.Unmarshal(kvs[0].Value, into); err != nil {
		return 0, fmt.Errorf("get %s: decode: %w", key, err)
	}
	return kvs[0].ModRevision, nil
}
