package store

import (
	"bytes"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/seal"
)

// TestAdoptIntoFreshStore: a fresh store adopts another's backup: its own
// CA and secrets are replaced, the backup's secrets open under its own key,
// its inventory matches the source's, and it stays paused adopting; a
// backup whose key is wrong writes nothing; a store with resources is
// refused and left as it was (not paused); adopting again from the same
// source works, from another is refused.
func TestAdoptIntoFreshStore(t *testing.T) {
	ctx := testCtx(t)
	src, _ := newStore(t)
	_, err := src.Create(ctx, "hosts", "h1", host("h1", "52:54:00:00:00:01"))
	require.NoError(t, err)
	require.NoError(t, src.PutSecret(ctx, "bmc/h1", []byte("adopt-pw")))
	_, err = src.client.Put(ctx, Prefix+PKIKind+"/ca.crt", "source CA")
	require.NoError(t, err)
	var backup bytes.Buffer
	_, err = src.Backup(ctx, &backup)
	require.NoError(t, err)
	srcSealer := src.sealer

	dst, _ := newStore(t)
	require.NoError(t, dst.PutSecret(ctx, "ca/key", []byte("target's own CA key")))
	_, err = dst.client.Put(ctx, Prefix+PKIKind+"/ca.crt", "target CA")
	require.NoError(t, err)

	// The wrong key: nothing written, not paused.
	wrong, err := seal.LoadOrCreateKey(filepath.Join(t.TempDir(), "other.key"))
	require.NoError(t, err)
	_, err = dst.Adopt(ctx, bytes.NewReader(backup.Bytes()), wrong, "src:7443", time.Now())
	require.True(t, errdefs.IsPermissionDenied(err), "adopt with the wrong key = %v", err)
	p, err := dst.Paused(ctx)
	require.NoError(t, err)
	require.Nil(t, p, "paused by a refused adoption")

	info, err := dst.Adopt(ctx, bytes.NewReader(backup.Bytes()), srcSealer, "src:7443", time.Now())
	require.NoError(t, err)
	require.Equal(t, 1, info.Secrets)
	pt, err := dst.GetSecret(ctx, "bmc/h1")
	require.NoError(t, err)
	require.Equal(t, "adopt-pw", string(pt), "the source's secret under the target's key")
	_, err = dst.GetSecret(ctx, "ca/key")
	require.True(t, errdefs.IsNotFound(err), "the target's own CA key after the adoption: %v", err)
	p, err = dst.Paused(ctx)
	require.NoError(t, err)
	require.NotNil(t, p)
	require.Equal(t, "src:7443", p.From)
	_, err = dst.Create(ctx, "hosts", "h2", host("h2", "52:54:00:00:00:02"))
	require.True(t, errors.Is(err, ErrPaused), "write while adopting: %v", err)
	srcInv, _, err := src.Inventory(ctx)
	require.NoError(t, err)
	dstInv, _, err := dst.Inventory(ctx)
	require.NoError(t, err)
	require.Equal(t, srcInv, dstInv, "inventories after the adoption")
	t.Logf("inventory: %+v", dstInv)

	// Again from the same source (a move run again): fine. From another:
	// refused.
	_, err = dst.Adopt(ctx, bytes.NewReader(backup.Bytes()), srcSealer, "src:7443", time.Now())
	require.NoError(t, err, "adopt again from the same source")
	_, err = dst.Adopt(ctx, bytes.NewReader(backup.Bytes()), srcSealer, "other:7443", time.Now())
	require.True(t, errdefs.IsFailedPrecondition(err), "adopt from another source while adopting = %v", err)

	// A store with a fleet of its own is refused, left unpaused.
	busy, _ := newStore(t)
	rev, err := busy.Create(ctx, "hosts", "mine", host("mine", "52:54:00:00:00:03"))
	require.NoError(t, err)
	_, err = busy.Adopt(ctx, bytes.NewReader(backup.Bytes()), srcSealer, "src:7443", time.Now())
	require.True(t, errdefs.IsFailedPrecondition(err), "adopt into a store with resources = %v", err)
	require.ErrorContains(t, err, "hosts/mine")
	p, err = busy.Paused(ctx)
	require.NoError(t, err)
	require.Nil(t, p, "a refused adoption left the store paused")
	got, err := busy.Get(ctx, "hosts", "mine", host("", ""))
	require.NoError(t, err)
	require.Equal(t, rev, got)
	_, err = busy.Get(ctx, "hosts", "h1", host("", ""))
	require.True(t, errdefs.IsNotFound(err), "a refused adoption wrote h1: %v", err)
}
