package store

import (
	"context"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// MaxBatchOps bounds the operations of one Batch: a put or delete per
// write and an audit record with each. The embedded etcd is started with
// this many --max-txn-ops; an external etcd must be started with at least
// as many (etcd's default, 128, holds a batch of 64 objects).
const MaxBatchOps = 2048

// BatchOp is one write of a Batch: a create (Rev 0, Msg set), an update
// (Rev the mod revision read, Msg set) or a delete (Rev the mod revision
// read, Delete true), each with the audit record stored with it.
type BatchOp struct {
	Kind, Name string
	// Rev is the mod revision the write expects; 0 for a create.
	Rev    int64
	Msg    proto.Message
	Delete bool
	Audit  AuditRecord
}

// Batch stores every op in one etcd transaction: all of them or none. Each
// op's compare must hold (a create's key absent, an update's or delete's
// mod revision unchanged), or nothing is written and Batch returns
// Conflict naming the first object that changed. It returns
// InvalidArgument for a batch of more than MaxBatchOps writes and
// Unavailable when etcd cannot answer. It returns the revision of the
// transaction (0 for an empty batch).
func (s *Store) Batch(ctx context.Context, ops []BatchOp) (int64, error) {
	if len(ops) == 0 {
		return 0, nil
	}
	var cmps []clientv3.Cmp
	var then []clientv3.Op
	var keys []string
	for _, op := range ops {
		key, err := resourceKey(op.Kind, op.Name)
		if err != nil {
			return 0, err
		}
		keys = append(keys, key)
		switch {
		case op.Delete:
			if op.Rev <= 0 {
				return 0, errdefs.InvalidArgument("batch: delete %s: revision %d", key, op.Rev)
			}
			cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(key), "=", op.Rev))
			then = append(then, clientv3.OpDelete(key))
		case op.Msg == nil:
			return 0, errdefs.InvalidArgument("batch: put %s: no object", key)
		default:
			val, err := marshal.Marshal(op.Msg)
			if err != nil {
				return 0, errdefs.InvalidArgument("batch: encode %s: %w", key, err)
			}
			if op.Rev == 0 {
				cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(key), "=", 0))
			} else {
				cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(key), "=", op.Rev))
			}
			then = append(then, clientv3.OpPut(key, string(val)))
		}
		extra, err := op.Audit.ops()
		if err != nil {
			return 0, err
		}
		then = append(then, extra...)
	}
	if len(then) > MaxBatchOps {
		return 0, errdefs.InvalidArgument("batch of %d writes (with audit records): more than the %d etcd takes in one transaction", len(then), MaxBatchOps)
	}
	var orElse []clientv3.Op
	for _, k := range keys {
		orElse = append(orElse, clientv3.OpGet(k, clientv3.WithKeysOnly()))
	}
	resp, err := s.client.Txn(ctx).If(s.guard(cmps...)...).Then(then...).Else(s.orElse(orElse...)...).Commit()
	if err != nil {
		return 0, etcdErr(ctx, fmt.Sprintf("batch of %d writes", len(ops)), err)
	}
	if !resp.Succeeded {
		if err := s.broken(resp, "batch"); err != nil {
			return 0, err
		}
		for i, op := range ops {
			kvs := resp.Responses[i].GetResponseRange().Kvs
			var got int64
			if len(kvs) > 0 {
				got = kvs[0].ModRevision
			}
			if got != op.Rev {
				return 0, errdefs.Conflict("%s %q changed during the batch (revision %d, expected %d); nothing was written", op.Kind, op.Name, got, op.Rev)
			}
		}
		return 0, errdefs.Conflict("batch of %d writes: a compare failed; nothing was written", len(ops))
	}
	return resp.Header.Revision, nil
}
