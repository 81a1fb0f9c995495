package store

import (
	"context"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// SecretKey returns the etcd key of a sealed secret: /kiln/v1/secrets/<path>.
func SecretKey(path string) string { return Prefix + secretsKind + "/" + path }

// PutSecret seals plaintext and stores it at path (for example
// "bmc/rack1-01" or "ca/key"), replacing any previous value. The sealed
// value is bound to its key: copied to another path it no longer opens.
// It returns FailedPrecondition when the Store has no Sealer.
func (s *Store) PutSecret(ctx context.Context, path string, plaintext []byte) error {
	key, err := s.secretKey(path)
	if err != nil {
		return err
	}
	sealed, err := s.sealer.Seal(plaintext, []byte(key))
	if err != nil {
		return err
	}
	resp, err := s.client.Txn(ctx).If(s.guard()...).Then(clientv3.OpPut(key, string(sealed))).Else(s.orElse()...).Commit()
	if err != nil {
		return etcdErr(ctx, "put secret "+path, err)
	}
	if !resp.Succeeded {
		if err := s.broken(resp, "put secret "+path); err != nil {
			return err
		}
		return s.fencedErr("put secret " + path)
	}
	return nil
}

// GetSecret reads and opens the secret at path. It returns NotFound when
// there is none and PermissionDenied when the stored value does not open
// under this Store's key (another key file, tampering, or a value moved
// from another path).
func (s *Store) GetSecret(ctx context.Context, path string) ([]byte, error) {
	key, err := s.secretKey(path)
	if err != nil {
		return nil, err
	}
	resp, err := s.client.Get(ctx, key)
	if err != nil {
		return nil, etcdErr(ctx, "get secret "+path, err)
	}
	if len(resp.Kvs) == 0 {
		return nil, errdefs.NotFound("secret %q not found", path)
	}
	pt, err := s.sealer.Open(resp.Kvs[0].Value, []byte(key))
	if err != nil {
		return nil, errdefs.PermissionDenied("secret %q: %w", path, err)
	}
	return pt, nil
}

// DeleteSecret removes the secret at path. It returns NotFound when there
// is none.
func (s *Store) DeleteSecret(ctx context.Context, path string) error {
	key, err := secretPath(path)
	if err != nil {
		return err
	}
	resp, err := s.client.Txn(ctx).If(s.guard()...).Then(clientv3.OpDelete(key)).Else(s.orElse()...).Commit()
	if err != nil {
		return etcdErr(ctx, "delete secret "+path, err)
	}
	if !resp.Succeeded {
		if err := s.broken(resp, "delete secret "+path); err != nil {
			return err
		}
		return s.fencedErr("delete secret " + path)
	}
	if resp.Responses[0].GetResponseDeleteRange().Deleted == 0 {
		return errdefs.NotFound("secret %q not found", path)
	}
	return nil
}

func (s *Store) secretKey(path string) (string, error) {
	if s.sealer == nil {
		return "", errdefs.FailedPrecondition("secret %q: store has no sealing key configured", path)
	}
	return secretPath(path)
}

// secretPath validates a secret path: '/'-separated segments, each a valid
// name other than "." and "..".
func secretPath(path string) (string, error) {
	if path == "" {
		return "", errdefs.InvalidArgument("empty secret path")
	}
	for _, seg := range strings.Split(path, "/") {
		if seg == "." || seg == ".." {
			return "", errdefs.InvalidArgument("secret path %q: segment %q not allowed", path, seg)
		}
		if err := checkName(seg); err != nil {
			return "", errdefs.InvalidArgument("secret path %q: %w", path, err)
		}
	}
	return SecretKey(path), nil
}

// SecretOp is a change to a sealed secret written in the same etcd
// transaction as a resource (CreateAudited, UpdateAudited, DeleteAudited),
// so that a crash between the two cannot leave a secret without its
// resource or a resource without its secret.
type SecretOp struct {
	path      string
	plaintext []byte
	delete    bool
}

// PutSecretOp seals plaintext into the secret at path with the write.
func PutSecretOp(path string, plaintext []byte) SecretOp {
	return SecretOp{path: path, plaintext: plaintext}
}

// DeleteSecretOp removes the secret at path (if any) with the write.
func DeleteSecretOp(path string) SecretOp {
	return SecretOp{path: path, delete: true}
}

// extraOps are the etcd operations of an audit record and secret changes.
func (s *Store) extraOps(rec AuditRecord, secrets []SecretOp) ([]clientv3.Op, error) {
	ops, err := rec.ops()
	if err != nil {
		return nil, err
	}
	for _, op := range secrets {
		if op.delete {
			key, err := secretPath(op.path)
			if err != nil {
				return nil, err
			}
			ops = append(ops, clientv3.OpDelete(key))
			continue
		}
		key, err := s.secretKey(op.path)
		if err != nil {
			return nil, err
		}
		sealed, err := s.sealer.Seal(op.plaintext, []byte(key))
		if err != nil {
			return nil, err
		}
		ops = append(ops, clientv3.OpPut(key, string(sealed)))
	}
	return ops, nil
}

// CollectOrphanSecrets deletes the sealed secrets under prefix (for
// example "bmc/") whose resource of kind, named by the rest of the secret's
// path, does not exist: what a crash left behind before secrets were
// written with their resources. Each delete compares, in its transaction,
// that the resource still does not exist and the secret is unchanged, so a
// concurrent create is never robbed of its secret. It returns how many it
// deleted.
func (s *Store) CollectOrphanSecrets(ctx context.Context, prefix, kind string) (int, error) {
	if err := checkKind(kind); err != nil {
		return 0, err
	}
	base := SecretKey(prefix)
	resp, err := s.client.Get(ctx, base, clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return 0, etcdErr(ctx, "list secrets "+prefix, err)
	}
	n := 0
	for _, kv := range resp.Kvs {
		name := strings.TrimPrefix(string(kv.Key), base)
		key, err := resourceKey(kind, name)
		if err != nil {
			continue // not a resource's secret
		}
		tx, err := s.client.Txn(ctx).
			If(s.guard(
				clientv3.Compare(clientv3.CreateRevision(key), "=", 0),
				clientv3.Compare(clientv3.ModRevision(string(kv.Key)), "=", kv.ModRevision))...).
			Then(clientv3.OpDelete(string(kv.Key))).
			Commit()
		if err != nil {
			return n, etcdErr(ctx, "delete orphaned secret "+prefix+name, err)
		}
		if tx.Succeeded {
			n++
		}
	}
	return n, nil
}

// CommitIf writes ops, the audit record and the secret changes in one etcd
// transaction if every comparison holds, and reports whether they did. It
// is for the controller's own records outside the resource API (the CA
// during a rotation); resources use CreateAudited and its kin. It returns
// Unavailable when etcd does not answer.
func (s *Store) CommitIf(ctx context.Context, cmps []clientv3.Cmp, ops []clientv3.Op, rec AuditRecord, secrets ...SecretOp) (bool, error) {
	extra, err := s.extraOps(rec, secrets)
	if err != nil {
		return false, err
	}
	resp, err := s.client.Txn(ctx).If(cmps...).Then(append(ops, extra...)...).Commit()
	if err != nil {
		return false, errdefs.Unavailable("etcd: %w", err)
	}
	return resp.Succeeded, nil
}
