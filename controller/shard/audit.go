package shard

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Kinds of audit records.
const (
	// KindClaim: the member created the shard key (the record is written
	// in the claim's transaction; Rev is the key's create revision).
	KindClaim = "claim"
	// KindRelease: the member deleted its key on a rebalance or shutdown
	// (written in the delete's transaction; Rev is the delete's revision).
	KindRelease = "release"
	// KindLost: the key was deleted by etcd (its lease expired or was
	// revoked): written by the first live member whose watch saw the
	// delete; Rev is the delete's revision.
	KindLost = "lost"
)

// Record is one ownership transition of a shard. A claim is stored under
// AuditPrefix/<shard>/claim/<member>-<nanoseconds> in the claim's own
// transaction; the end of that ownership (a release or a loss) under
// AuditPrefix/<shard>/end/<create revision of the key>, written once
// (only if absent), so an ownership has one claim and at most one end.
type Record struct {
	Shard  int    `json:"shard"`
	Kind   string `json:"kind"`
	Member string `json:"member"`
	// Held is the create revision of the shard key this ownership was.
	Held int64 `json:"held"`
	// Rev is the etcd revision of the transition: the key's create
	// revision for a claim, the delete's revision for a release or loss.
	Rev int64 `json:"rev"`
	// By is who wrote the record (the member itself, or for a loss the
	// member whose watch saw it).
	By   string    `json:"by"`
	Time time.Time `json:"time"`
}

func claimKey(shard int, member string, now time.Time) string {
	return fmt.Sprintf("%s%04d/claim/%s-%d", AuditPrefix, shard, member, now.UnixNano())
}

func endKey(shard int, held int64) string {
	return fmt.Sprintf("%s%04d/end/%020d", AuditPrefix, shard, held)
}

// ReadAudit returns every audit record, ordered by revision (claims
// before ends at one revision). It returns Unavailable-class errors from
// etcd as they come.
func ReadAudit(ctx context.Context, client *clientv3.Client) ([]Record, error) {
	resp, err := client.Get(ctx, AuditPrefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("read shard audit: %w", err)
	}
	out := make([]Record, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var r Record
		if err := json.Unmarshal(kv.Value, &r); err != nil {
			return nil, fmt.Errorf("shard audit record %s: %w", kv.Key, err)
		}
		// A claim and a release are written in the transaction they
		// record: their revision is the record's own.
		if r.Rev == 0 {
			r.Rev = kv.CreateRevision
		}
		if r.Kind == KindClaim {
			r.Held = kv.CreateRevision
		}
		out = append(out, r)
	}
	slices.SortStableFunc(out, func(a, b Record) int {
		if a.Rev != b.Rev {
			return int(a.Rev - b.Rev)
		}
		return strings.Compare(kindOrder(a.Kind), kindOrder(b.Kind))
	})
	return out, nil
}

func kindOrder(k string) string {
	if k == KindClaim {
		return "0"
	}
	return "1"
}

// Overlap is two ownerships of one shard that overlapped in revisions.
type Overlap struct {
	Shard         int
	First, Second Record
}

func (o Overlap) String() string {
	return fmt.Sprintf("shard %d: %s claimed at revision %d, %s claimed at revision %d before the first ownership ended",
		o.Shard, o.First.Member, o.First.Rev, o.Second.Member, o.Second.Rev)
}

// Check checks an audit log (any order) for what sharding promises: on
// every shard, each ownership ends (released or lost) at a revision before
// the next ownership's claim. An ownership without an end must be the
// shard's last (held now, or its end not recorded because no member was
// alive to see it: then it overlaps nothing recorded). It returns the
// overlaps found and, for records it cannot pair, an error.
func Check(records []Record) ([]Overlap, error) {
	type own struct {
		claim Record
		end   *Record
	}
	byShard := map[int]map[int64]*own{}
	get := func(r Record) *own {
		m := byShard[r.Shard]
		if m == nil {
			m = map[int64]*own{}
			byShard[r.Shard] = m
		}
		o := m[r.Held]
		if o == nil {
			o = &own{}
			m[r.Held] = o
		}
		return o
	}
	var errs []string
	for _, r := range records {
		o := get(r)
		switch r.Kind {
		case KindClaim:
			o.claim = r
		case KindRelease, KindLost:
			if o.end != nil {
				errs = append(errs, fmt.Sprintf("shard %d ownership %d ended twice", r.Shard, r.Held))
			}
			rr := r
			o.end = &rr
		default:
			errs = append(errs, fmt.Sprintf("shard %d: unknown record kind %q", r.Shard, r.Kind))
		}
	}
	var overlaps []Overlap
	for _, s := range slices.Sorted(maps.Keys(byShard)) {
		m := byShard[s]
		helds := slices.Sorted(maps.Keys(m))
		for i, h := range helds {
			o := m[h]
			if o.claim.Kind == "" {
				errs = append(errs, fmt.Sprintf("shard %d ownership %d ended without a recorded claim", s, h))
				continue
			}
			if o.end != nil && o.end.Rev < o.claim.Rev {
				errs = append(errs, fmt.Sprintf("shard %d ownership %d ended at %d before its claim", s, h, o.end.Rev))
			}
			if i+1 == len(helds) {
				continue
			}
			next := m[helds[i+1]]
			if o.end == nil || o.end.Rev >= next.claim.Rev {
				overlaps = append(overlaps, Overlap{Shard: s, First: o.claim, Second: next.claim})
			}
		}
	}
	if len(errs) > 0 {
		return overlaps, fmt.Errorf("shard audit: %s", strings.Join(errs, "; "))
	}
	return overlaps, nil
}

// parseShardKey returns the shard number of a shard key.
func parseShardKey(key string) (int, bool) {
	rest, ok := strings.CutPrefix(key, KeyPrefix)
	if !ok {
		return 0, false
	}
	n, err := strconv.Atoi(rest)
	return n, err == nil
}
