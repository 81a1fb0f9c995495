package store

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// TestFencedWritesRefusedAfterTermEnds: a Store fenced on an election key
// writes while the key lives; once its lease is revoked (the term ended)
// every kind of write is refused with ErrFenced and changes nothing, while
// an unfenced Store and a Store fenced on the next term still write.
func TestFencedWritesRefusedAfterTermEnds(t *testing.T) {
	s, c := newStore(t)
	ctx := context.Background()
	const leaderKey = "/kiln/v1/election/controller/term-a"
	lease, err := c.Grant(ctx, 60)
	require.NoError(t, err)
	put, err := c.Put(ctx, leaderKey, "a", clientv3.WithLease(lease.ID))
	require.NoError(t, err)
	fenced := s.Fenced(Fence{Key: leaderKey, Rev: put.Header.Revision})

	require.NoError(t, fenced.CheckFence(ctx))
	rev, err := fenced.Create(ctx, "hosts", "h1", host("h1", "52:54:00:00:00:01"))
	require.NoError(t, err, "write under a live term")
	require.NoError(t, fenced.PutSecret(ctx, "bmc/h1", []byte("pw")))

	_, err = c.Revoke(ctx, lease.ID)
	require.NoError(t, err)

	refused := map[string]error{
		"CheckFence":   fenced.CheckFence(ctx),
		"PutSecret":    fenced.PutSecret(ctx, "bmc/h1", []byte("other")),
		"DeleteSecret": fenced.DeleteSecret(ctx, "bmc/h1"),
		"Delete":       fenced.Delete(ctx, "hosts", "h1", rev),
	}
	_, refused["Create"] = fenced.Create(ctx, "hosts", "h2", host("h2", "52:54:00:00:00:02"))
	_, refused["Update"] = fenced.Update(ctx, "hosts", "h1", host("h1", "52:54:00:00:00:09"), rev)
	for op, err := range refused {
		require.True(t, errors.Is(err, ErrFenced), "%s after the term ended = %v, want ErrFenced", op, err)
		require.True(t, errdefs.IsFailedPrecondition(err), "%s: %v is not FailedPrecondition", op, err)
	}
	t.Logf("refused: %v", refused["Update"])

	// Nothing changed.
	got := host("", "")
	gotRev, err := s.Get(ctx, "hosts", "h1", got)
	require.NoError(t, err)
	require.Equal(t, rev, gotRev, "h1 revision after refused writes")
	pt, err := s.GetSecret(ctx, "bmc/h1")
	require.NoError(t, err)
	require.Equal(t, "pw", string(pt))
	_, err = s.Get(ctx, "hosts", "h2", host("", ""))
	require.True(t, errdefs.IsNotFound(err), "h2 created by a refused write: %v", err)

	// A new term (same key name, new create revision) fences afresh.
	put, err = c.Put(ctx, leaderKey, "b")
	require.NoError(t, err)
	require.True(t, errors.Is(fenced.CheckFence(ctx), ErrFenced), "old fence holds on a re-created key")
	_, err = s.Fenced(Fence{Key: leaderKey, Rev: put.Header.Revision}).Update(ctx, "hosts", "h1", host("h1", "52:54:00:00:00:09"), rev)
	require.NoError(t, err, "write under the new term")
	// A revision conflict under a live fence stays a Conflict.
	_, err = s.Fenced(Fence{Key: leaderKey, Rev: put.Header.Revision}).Update(ctx, "hosts", "h1", host("h1", "52:54:00:00:00:09"), rev)
	require.True(t, errdefs.IsConflict(err), "stale update under a live fence = %v, want Conflict", err)
}
