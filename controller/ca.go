package controller

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
	caCertKey    = store.Prefix + "pki/ca.crt"
	caKeySecret  = "ca/key"
	caCommonName = "kiln-controller-ca"
)

// loadOrCreateCA returns the CA stored in etcd, creating it on the first
// start. Replicas starting together agree on one CA: the certificate and
// its sealed key are written in one transaction only if no CA exists yet.
func loadOrCreateCA(ctx context.Context, st *store.Store, sealer *seal.Sealer, now time.Time) (*pki.CA, error) {
	if ca, err := loadCA(ctx, st); !errdefs.IsNotFound(err) {
		return ca, err
	}
	ca, err := pki.NewCA(caCommonName, now)
	if err != nil {
		return nil, err
	}
	keyPEM, err := ca.KeyPEM()
	if err != nil {
		return nil, err
	}
	keyPath := store.SecretKey(caKeySecret)
	sealed, err := sealer.Seal(keyPEM, []byte(keyPath))
	if err != nil {
		return nil, fmt.Errorf("seal CA key: %w", err)
	}
	resp, err := st.Client().Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(caCertKey), "=", 0)).
		Then(clientv3.OpPut(caCertKey, string(ca.CertPEM())), clientv3.OpPut(keyPath, string(sealed))).
		Commit()
	if err != nil {
		return nil, errdefs.Unavailable("store CA: etcd: %w", err)
	}
	if !resp.Succeeded {
		// Another replica was first.
		return loadCA(ctx, st)
	}
	return ca, nil
}

// loadCA reads the stored CA. It returns NotFound when there is none and
// PermissionDenied when its key does not open with this sealing key.
func loadCA(ctx context.Context, st *store.Store) (*pki.CA, error) {
	resp, err := st.Client().Get(ctx, caCertKey)
	if err != nil {
		return nil, errdefs.Unavailable("load CA: etcd: %w", err)
	}
	if len(resp.Kvs) == 0 {
		return nil, errdefs.NotFound("no CA stored")
	}
	keyPEM, err := st.GetSecret(ctx, caKeySecret)
	if err != nil {
		return nil, fmt.Errorf("load CA key (is --secret-key-file the key this controller's data was sealed with?): %w", err)
	}
	return pki.LoadCA(resp.Kvs[0].Value, keyPEM)
}
