package store

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// auditKind is the key segment of the audit log; no resource kind may use
// it.
const auditKind = "audit"

// AuditPrefix is where audit records live:
// AuditPrefix + "<unix nanoseconds, 20 digits>-<random>", so that key
// order is time order.
const AuditPrefix = Prefix + auditKind + "/"

// AuditRecord is one audit log entry to store with a write. A zero
// AuditRecord (Msg nil) stores nothing.
type AuditRecord struct {
	// Time orders the log and is what retention by age compares.
	Time time.Time
	// Msg is the entry (controllerv1.AuditEntry); the store does not look
	// inside.
	Msg proto.Message
}

// auditTimeKey is the key prefix of records at t.
func auditTimeKey(t time.Time) string {
	return AuditPrefix + fmt.Sprintf("%020d", t.UnixNano())
}

// ops returns the put of the record, none for a zero record.
func (r AuditRecord) ops() ([]clientv3.Op, error) {
	if r.Msg == nil {
		return nil, nil
	}
	val, err := marshal.Marshal(r.Msg)
	if err != nil {
		return nil, errdefs.InvalidArgument("audit record: encode: %w", err)
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	return []clientv3.Op{clientv3.OpPut(auditTimeKey(r.Time)+"-"+hex.EncodeToString(b[:]), string(val))}, nil
}

// AppendAudit stores rec alone, for writes that are not one store
// transaction (enrollment, certificates, refused calls). It returns
// Unavailable when etcd cannot answer.
func (s *Store) AppendAudit(ctx context.Context, rec AuditRecord) error {
	ops, err := rec.ops()
	if err != nil || len(ops) == 0 {
		return err
	}
	if _, err := s.client.Txn(ctx).Then(ops...).Commit(); err != nil {
		return etcdErr(ctx, "append audit record", err)
	}
	return nil
}

// auditPage is how many audit records ListAudit reads per etcd request.
const auditPage = 1000

// ListAudit calls fn with every audit record at or after since, oldest
// first, decoding each into a message from newMsg, until fn returns false.
// All pages read one revision.
func (s *Store) ListAudit(ctx context.Context, since time.Time, newMsg func() proto.Message, fn func(proto.Message) bool) error {
	start := AuditPrefix
	if !since.IsZero() && since.UnixNano() > 0 {
		start = auditTimeKey(since)
	}
	end := clientv3.GetPrefixRangeEnd(AuditPrefix)
	var rev int64
	for {
		opts := []clientv3.OpOption{clientv3.WithRange(end), clientv3.WithLimit(auditPage), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend)}
		if rev > 0 {
			opts = append(opts, clientv3.WithRev(rev))
		}
		resp, err := s.client.Get(ctx, start, opts...)
		if err != nil {
			return etcdErr(ctx, "list audit log", err)
		}
		rev = resp.Header.Revision
		for _, kv := range resp.Kvs {
			m := newMsg()
			if err := proto.Unmarshal(kv.Value, m); err != nil {
				return fmt.Errorf("list audit log: decode %s: %w", kv.Key, err)
			}
			if !fn(m) {
				return nil
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return nil
		}
		start = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

// PruneAudit deletes the audit records older than before (none when
// before is zero) and then the oldest records beyond the newest
// maxEntries (no count limit when maxEntries <= 0). It returns how many
// it deleted. Several replicas may prune at once: each delete is a range
// delete, idempotent.
func (s *Store) PruneAudit(ctx context.Context, before time.Time, maxEntries int64) (int64, error) {
	var n int64
	if !before.IsZero() && before.UnixNano() > 0 {
		resp, err := s.client.Delete(ctx, AuditPrefix, clientv3.WithRange(auditTimeKey(before)))
		if err != nil {
			return n, etcdErr(ctx, "prune audit log by age", err)
		}
		n += resp.Deleted
	}
	if maxEntries <= 0 {
		return n, nil
	}
	end := clientv3.GetPrefixRangeEnd(AuditPrefix)
	cnt, err := s.client.Get(ctx, AuditPrefix, clientv3.WithRange(end), clientv3.WithCountOnly())
	if err != nil {
		return n, etcdErr(ctx, "count audit log", err)
	}
	excess := cnt.Count - maxEntries
	for excess > 0 {
		// Delete the oldest excess keys, a page at a time, up to and
		// including the last key of the page.
		page := min(excess, int64(auditPage))
		resp, err := s.client.Get(ctx, AuditPrefix, clientv3.WithRange(end), clientv3.WithLimit(page),
			clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend), clientv3.WithKeysOnly())
		if err != nil {
			return n, etcdErr(ctx, "prune audit log by count", err)
		}
		if len(resp.Kvs) == 0 {
			break
		}
		last := string(resp.Kvs[len(resp.Kvs)-1].Key)
		del, err := s.client.Delete(ctx, AuditPrefix, clientv3.WithRange(last+"\x00"))
		if err != nil {
			return n, etcdErr(ctx, "prune audit log by count", err)
		}
		n += del.Deleted
		excess -= int64(len(resp.Kvs))
	}
	return n, nil
}
