package trust

import (
	"context"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
	"github.com/kilnhq/kiln/internal/seal"
)

// The CA certificate is stored in the clear; its key is a sealed secret.
const (
	CertKey    = store.Prefix + "pki/ca.crt"
	KeySecret  = "ca/key"
	commonName = "kiln-controller-ca"
)

// LoadOrCreate returns the CA stored in etcd, creating it on the first
// start. Replicas starting together agree on one CA: the certificate and
// its sealed key are written in one transaction only if no CA exists yet.
func LoadOrCreate(ctx context.Context, st *store.Store, sealer *seal.Sealer, now time.Time) (*pki.CA, error) {
	if ca, err := Load(ctx, st); !errdefs.IsNotFound(err) {
		return ca, err
	}
	ca, err := pki.NewCA(commonName, now)
	if err != nil {
		return nil, err
	}
	keyPEM, err := ca.KeyPEM()
	if err != nil {
		return nil, err
	}
	keyPath := store.SecretKey(KeySecret)
	sealed, err := sealer.Seal(keyPEM, []byte(keyPath))
	if err != nil {
		return nil, fmt.Errorf("seal CA key: %w", err)
	}
	resp, err := st.Client().Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(CertKey), "=", 0)).
		Then(clientv3.OpPut(CertKey, string(ca.CertPEM())), clientv3.OpPut(keyPath, string(sealed))).
		Commit()
	if err != nil {
		return nil, errdefs.Unavailable("store CA: etcd: %w", err)
	}
	if !resp.Succeeded {
		// Another replica was first.
		return Load(ctx, st)
	}
	return ca, nil
}

// Load reads the stored CA. It returns NotFound when there is none and
// PermissionDenied when its key does not open with this sealing key.
func Load(ctx context.Context, st *store.Store) (*pki.CA, error) {
	resp, err := st.Client().Get(ctx, CertKey)
	if err != nil {
		return nil, errdefs.Unavailable("load CA: etcd: %w", err)
	}
	if len(resp.Kvs) == 0 {
		return nil, errdefs.NotFound("no CA stored")
	}
	keyPEM, err := st.GetSecret(ctx, KeySecret)
	if err != nil {
		return nil, fmt.Errorf("load CA key (is --secret-key-file the key this controller's data was sealed with?): %w", err)
	}
	return pki.LoadCA(resp.Kvs[0].Value, keyPEM)
}
