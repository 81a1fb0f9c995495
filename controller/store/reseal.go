package store

import (
	"context"
	"fmt"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/seal"
)

// ResealResult counts what ResealSecrets did.
type ResealResult struct {
	// Secrets is how many sealed secrets the store holds.
	Secrets int
	// Resealed is how many were sealed under another key (or in the
	// version-1 format) and are now sealed under the current key.
	Resealed int
	// Conflicts is how many writes lost to a concurrent change and were
	// retried on the new value.
	Conflicts int
}

// resealAttempts bounds the retries of one secret that keeps changing.
const resealAttempts = 10

// resealPage is how many secrets one read fetches.
const resealPage = 256

// ResealSecrets seals every secret of the store (everything under
// /kiln/v1/secrets/) that is not sealed under the Store's current key
// again under it, each in an etcd transaction that compares the value's
// mod revision, so a concurrent write is never overwritten: the secret is
// read again and, if still needed, re-sealed. progress, when not nil, is
// called after each secret re-sealed with its path.
//
// It returns FailedPrecondition when the Store has no Sealer,
// PermissionDenied naming the secret when one does not open under any
// key of the ring (nothing is lost: it is left as it is), Conflict when a
// secret changed resealAttempts times in a row, and Unavailable when etcd
// does not answer. Re-running after any error carries on where it
// stopped.
func (s *Store) ResealSecrets(ctx context.Context, progress func(path string)) (ResealResult, error) {
	var res ResealResult
	if s.sealer == nil {
		return res, errdefs.FailedPrecondition("re-seal secrets: store has no sealing key configured")
	}
	prefix := SecretKey("")
	start := prefix
	end := clientv3.GetPrefixRangeEnd(prefix)
	for {
		resp, err := s.client.Get(ctx, start, clientv3.WithRange(end), clientv3.WithLimit(resealPage),
			clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
		if err != nil {
			return res, etcdErr(ctx, "re-seal secrets: list", err)
		}
		for _, kv := range resp.Kvs {
			res.Secrets++
			key := string(kv.Key)
			done, conflicts, err := s.reseal(ctx, key, kv.Value, kv.ModRevision)
			res.Conflicts += conflicts
			if err != nil {
				return res, err
			}
			if done {
				res.Resealed++
				if progress != nil {
					progress(strings.TrimPrefix(key, prefix))
				}
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return res, nil
		}
		start = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

// reseal seals the value at key under the current key unless it already
// is, retrying on a concurrent change. It reports whether it wrote.
func (s *Store) reseal(ctx context.Context, key string, val []byte, rev int64) (bool, int, error) {
	path := strings.TrimPrefix(key, SecretKey(""))
	conflicts := 0
	for range resealAttempts {
		id, named, err := seal.SealedWith(val)
		if err != nil {
			return false, conflicts, fmt.Errorf("re-seal secret %q: %w", path, err)
		}
		if named && id == s.sealer.CurrentID() {
			return false, conflicts, nil
		}
		pt, err := s.sealer.Open(val, []byte(key))
		if err != nil {
			return false, conflicts, errdefs.PermissionDenied("re-seal secret %q: it does not open under any key of the ring (%w); it is left as it is", path, err)
		}
		sealed, err := s.sealer.Seal(pt, []byte(key))
		clear(pt)
		if err != nil {
			return false, conflicts, fmt.Errorf("re-seal secret %q: %w", path, err)
		}
		resp, err := s.client.Txn(ctx).
			If(clientv3.Compare(clientv3.ModRevision(key), "=", rev)).
			Then(clientv3.OpPut(key, string(sealed))).
			Else(clientv3.OpGet(key)).
			Commit()
		if err != nil {
			return false, conflicts, etcdErr(ctx, "re-seal secret "+path, err)
		}
		if resp.Succeeded {
			return true, conflicts, nil
		}
		conflicts++
		kvs := resp.Responses[0].GetResponseRange().Kvs
		if len(kvs) == 0 {
			return false, conflicts, nil // Deleted meanwhile: nothing to re-seal.
		}
		val, rev = kvs[0].Value, kvs[0].ModRevision
		s.log.Debug("secret changed while re-sealing, retrying", "path", path, "rev", rev)
	}
	return false, conflicts, errdefs.Conflict("re-seal secret %q: it changed %d times in a row while being re-sealed; run the rotation again", path, resealAttempts)
}

// SecretKeyIDs returns, for every sealed secret of the store, the id of the
// key it is sealed under ("v1" for a version-1 value, which names none),
// by path. It opens nothing.
func (s *Store) SecretKeyIDs(ctx context.Context) (map[string]string, error) {
	prefix := SecretKey("")
	resp, err := s.client.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, etcdErr(ctx, "list secrets", err)
	}
	out := make(map[string]string, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		path := strings.TrimPrefix(string(kv.Key), prefix)
		id, named, err := seal.SealedWith(kv.Value)
		switch {
		case err != nil:
			return nil, fmt.Errorf("secret %q: %w", path, err)
		case named:
			out[path] = id.String()
		default:
			out[path] = "v1"
		}
	}
	return out, nil
}
