package store

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/seal/sealtest"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/seal"
)

// TestResealSecrets re-seals a store written by a controller before key
// ids (version-1 values) under a new key, leaves a value no key opens as
// it is with an error naming it, and re-seals nothing on a second run.
func TestResealSecrets(t *testing.T) {
	ctx := testCtx(t)
	_, cl := startEtcd(t)
	oldKey := bytes.Repeat([]byte{1}, seal.KeySize)
	newKey := bytes.Repeat([]byte{2}, seal.KeySize)
	paths := []string{"ca/key", "bmc/h1", "bmc/h2"}
	for _, p := range paths {
		_, err := cl.Put(ctx, SecretKey(p), string(sealtest.SealV1(t, oldKey, []byte("pw-"+p), []byte(SecretKey(p)))))
		require.NoError(t, err)
	}
	ring, err := seal.NewRing(newKey, oldKey)
	require.NoError(t, err)
	st := New(cl, WithSealer(ring), WithLogger(testLogger(t)))

	var seen []string
	res, err := st.ResealSecrets(ctx, func(p string) { seen = append(seen, p) })
	require.NoError(t, err)
	if res.Secrets != 3 || res.Resealed != 3 || len(seen) != 3 {
		t.Errorf("ResealSecrets() = %+v, progress %v; want 3 secrets, 3 re-sealed", res, seen)
	}
	ids, err := st.SecretKeyIDs(ctx)
	require.NoError(t, err)
	onlyNew, err := seal.New(newKey)
	require.NoError(t, err)
	for _, p := range paths {
		require.Equal(t, seal.IDOf(newKey).String(), ids[p], "key of %s", p)
		resp, err := cl.Get(ctx, SecretKey(p))
		require.NoError(t, err)
		pt, err := onlyNew.Open(resp.Kvs[0].Value, []byte(SecretKey(p)))
		require.NoError(t, err)
		require.Equal(t, "pw-"+p, string(pt))
	}
	res, err = st.ResealSecrets(ctx, nil)
	require.NoError(t, err)
	require.Equal(t, 0, res.Resealed, "second run re-sealed again")

	// A value under a key the ring does not hold is left as it is.
	foreign := sealtest.SealV1(t, bytes.Repeat([]byte{9}, seal.KeySize), []byte("x"), []byte(SecretKey("bmc/h9")))
	_, err = cl.Put(ctx, SecretKey("bmc/h9"), string(foreign))
	require.NoError(t, err)
	_, err = st.ResealSecrets(ctx, nil)
	if !errdefs.IsPermissionDenied(err) {
		t.Fatalf("ResealSecrets(a value no key opens) = %v, want PermissionDenied", err)
	}
	require.ErrorContains(t, err, "bmc/h9")
	resp, err := cl.Get(ctx, SecretKey("bmc/h9"))
	require.NoError(t, err)
	require.Equal(t, foreign, resp.Kvs[0].Value, "the value no key opens was changed")
}
