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
	resp, err := s.client.Txn(ctx).If(s.guard()...).Then(clientv3.OpPut(key, string(sealed))).Commit()
	if err != nil {
		return etcdErr(ctx, "put secret "+path, err)
	}
	if !resp.Succeeded {
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
	resp, err := s.client.Txn(ctx).If(s.guard()...).Then(clientv3.OpDelete(key)).Commit()
	if err != nil {
		return etcdErr(ctx, "delete secret "+path, err)
	}
	if !resp.Succeeded {
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
