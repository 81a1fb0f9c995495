package store

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestBatch: a batch stores every write or none; one stale revision
// refuses all of it.
func TestBatch(t *testing.T) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	revA, err := s.Create(ctx, "hosts", "a", host("a", "aa:aa:aa:aa:aa:01"))
	require.NoError(t, err)
	revB, err := s.Create(ctx, "hosts", "b", host("b", "aa:aa:aa:aa:aa:02"))
	require.NoError(t, err)

	// b changes behind the batch's back: nothing of the batch is stored.
	_, err = s.Update(ctx, "hosts", "b", host("b", "aa:aa:aa:aa:aa:22"), revB)
	require.NoError(t, err)
	_, err = s.Batch(ctx, []BatchOp{
		{Kind: "hosts", Name: "c", Msg: host("c", "aa:aa:aa:aa:aa:03")},
		{Kind: "hosts", Name: "a", Rev: revA, Msg: host("a", "aa:aa:aa:aa:aa:11")},
		{Kind: "hosts", Name: "b", Rev: revB, Delete: true},
	})
	if !errdefs.IsConflict(err) {
		t.Fatalf("Batch with a stale revision = %v, want Conflict", err)
	}
	require.Contains(t, err.Error(), `hosts "b" changed`)
	_, err = s.Get(ctx, "hosts", "c", &typesv1.Host{})
	require.True(t, errdefs.IsNotFound(err), "c was created by a refused batch")
	a := &typesv1.Host{}
	_, err = s.Get(ctx, "hosts", "a", a)
	require.NoError(t, err)
	require.Equal(t, "aa:aa:aa:aa:aa:01", a.GetSpec().GetBootMac())

	// With current revisions every write happens.
	b := &typesv1.Host{}
	revB, err = s.Get(ctx, "hosts", "b", b)
	require.NoError(t, err)
	_, err = s.Batch(ctx, []BatchOp{
		{Kind: "hosts", Name: "c", Msg: host("c", "aa:aa:aa:aa:aa:03")},
		{Kind: "hosts", Name: "a", Rev: revA, Msg: host("a", "aa:aa:aa:aa:aa:11")},
		{Kind: "hosts", Name: "b", Rev: revB, Delete: true},
	})
	require.NoError(t, err)
	_, err = s.Get(ctx, "hosts", "c", &typesv1.Host{})
	require.NoError(t, err)
	_, err = s.Get(ctx, "hosts", "b", &typesv1.Host{})
	require.True(t, errdefs.IsNotFound(err))
	_, err = s.Get(ctx, "hosts", "a", a)
	require.NoError(t, err)
	require.Equal(t, "aa:aa:aa:aa:aa:11", a.GetSpec().GetBootMac())
}
