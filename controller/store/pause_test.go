package store

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// TestPauseRefusesEveryWrite: once a move pauses the controller, every
// kind of write through any Store of its etcd (unfenced as the API's,
// fenced as a leader's reconcilers') is refused with ErrPaused, says where
// the controller moved, and changes nothing; a second pause keeps the
// first record; a backup leaves the pause out; after Resume writes work.
func TestPauseRefusesEveryWrite(t *testing.T) {
	s, c := newStore(t)
	ctx := testCtx(t)
	const leaderKey = "/kiln/v1/election/controller/term-a"
	put, err := c.Put(ctx, leaderKey, "a")
	require.NoError(t, err)
	fenced := s.Fenced(Fence{Key: leaderKey, Rev: put.Header.Revision})
	rev, err := s.Create(ctx, "hosts", "h1", host("h1", "52:54:00:00:00:01"))
	require.NoError(t, err)
	require.NoError(t, s.PutSecret(ctx, "bmc/h1", []byte("pw")))

	p, err := s.Paused(ctx)
	require.NoError(t, err)
	require.Nil(t, p, "paused before any pause")
	since := time.Date(2026, 12, 6, 16, 0, 0, 0, time.UTC)
	got, err := s.Pause(ctx, Pause{MovedTo: "10.0.0.9:7443", By: "ops", Since: since})
	require.NoError(t, err)
	require.Equal(t, "10.0.0.9:7443", got.MovedTo)
	again, err := s.Pause(ctx, Pause{MovedTo: "elsewhere:1", By: "other", Since: since.Add(time.Hour)})
	require.NoError(t, err)
	require.Equal(t, got, again, "a second pause keeps the first record")

	for name, st := range map[string]*Store{"unfenced": s, "fenced": fenced} {
		refused := map[string]error{
			"PutSecret":    st.PutSecret(ctx, "bmc/h1", []byte("other")),
			"DeleteSecret": st.DeleteSecret(ctx, "bmc/h1"),
			"Delete":       st.Delete(ctx, "hosts", "h1", rev),
		}
		_, refused["Create"] = st.Create(ctx, "hosts", "h2", host("h2", "52:54:00:00:00:02"))
		_, refused["Update"] = st.Update(ctx, "hosts", "h1", host("h1", "52:54:00:00:00:09"), rev)
		if st.fence != nil {
			refused["CheckFence"] = st.CheckFence(ctx)
		}
		for op, err := range refused {
			require.True(t, errors.Is(err, ErrPaused), "%s %s while paused = %v, want ErrPaused", name, op, err)
			require.False(t, errors.Is(err, ErrFenced), "%s %s while paused = %v: not fenced", name, op, err)
			require.True(t, errdefs.IsFailedPrecondition(err), "%s %s: %v is not FailedPrecondition", name, op, err)
			require.Contains(t, err.Error(), "moving to 10.0.0.9:7443", "%s %s", name, op)
		}
		t.Logf("%s Update while paused: %v", name, refused["Update"])
	}
	// Nothing changed.
	gotRev, err := s.Get(ctx, "hosts", "h1", host("", ""))
	require.NoError(t, err)
	require.Equal(t, rev, gotRev)
	pt, err := s.GetSecret(ctx, "bmc/h1")
	require.NoError(t, err)
	require.Equal(t, "pw", string(pt))

	// The pause is in etcd: a new Store (a restarted controller) sees it.
	s2 := New(c, WithSealer(s.sealer))
	p, err = s2.Paused(ctx)
	require.NoError(t, err)
	require.NotNil(t, p)
	_, err = s2.Create(ctx, "hosts", "h3", host("h3", "52:54:00:00:00:03"))
	require.True(t, errors.Is(err, ErrPaused), "Create through a new Store while paused = %v", err)
	moved, err := s2.MarkMoved(ctx)
	require.NoError(t, err)
	require.True(t, moved.Moved)
	_, err = s2.Create(ctx, "hosts", "h3", host("h3", "52:54:00:00:00:03"))
	require.ErrorContains(t, err, "moved to 10.0.0.9:7443")

	// A backup taken while paused does not carry the pause.
	var buf bytes.Buffer
	_, err = s.Backup(ctx, &buf)
	require.NoError(t, err)
	s3, _ := newStore(t)
	_, err = s3.Restore(ctx, &buf, RestoreOptions{})
	require.NoError(t, err)
	p, err = s3.Paused(ctx)
	require.NoError(t, err)
	require.Nil(t, p, "restored copy of a paused controller is paused")

	// Resume: writes work again.
	require.NoError(t, s.Resume(ctx))
	_, err = fenced.Update(ctx, "hosts", "h1", host("h1", "52:54:00:00:00:09"), rev)
	require.NoError(t, err, "fenced write after resume")
	require.NoError(t, s.PutSecret(ctx, "bmc/h1", []byte("new")))
}

// TestPauseStopsAndResumeReleasesWaiters: UntilPaused ends its context
// when a pause is recorded, and WaitResumed returns when it is removed.
func TestPauseStopsAndResumeReleasesWaiters(t *testing.T) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	require.NoError(t, s.WaitResumed(ctx), "WaitResumed when not paused")
	pctx, cancel := s.UntilPaused(ctx)
	defer cancel()
	select {
	case <-pctx.Done():
		t.Fatal("UntilPaused ended before any pause")
	default:
	}
	_, err := s.Pause(ctx, Pause{MovedTo: "b:7443", By: "ops", Since: time.Now()})
	require.NoError(t, err)
	select {
	case <-pctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("UntilPaused did not end within 10s of the pause")
	}
	pctx2, cancel2 := s.UntilPaused(ctx)
	defer cancel2()
	select {
	case <-pctx2.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("UntilPaused on a paused controller did not end at once")
	}
	short, scancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer scancel()
	require.ErrorIs(t, s.WaitResumed(short), context.DeadlineExceeded, "WaitResumed while paused")
	done := make(chan error, 1)
	go func() { done <- s.WaitResumed(ctx) }()
	require.NoError(t, s.Resume(ctx))
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("WaitResumed did not return within 10s of the resume")
	}
}
