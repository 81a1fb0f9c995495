package store

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestSecretWrittenWithItsResource: a Host and its sealed password are one
// transaction. Before, the password was sealed first and a kill -9
// between the writes (or a failed Host write) left an orphaned secret
// (issue 12, hole 6).
func TestSecretWrittenWithItsResource(t *testing.T) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	h := &typesv1.Host{Metadata: &typesv1.ObjectMeta{Name: "h1"}}

	_, err := s.CreateAudited(ctx, "hosts", "h1", h, AuditRecord{}, PutSecretOp("bmc/h1", []byte("pw-1")))
	require.NoError(t, err)
	got, err := s.GetSecret(ctx, "bmc/h1")
	require.NoError(t, err)
	require.Equal(t, "pw-1", string(got))

	// A create that fails (the Host exists) writes no secret either.
	_, err = s.CreateAudited(ctx, "hosts", "h1", h, AuditRecord{}, PutSecretOp("bmc/h1", []byte("pw-2")))
	require.True(t, errdefs.IsAlreadyExists(err), "CreateAudited(existing) = %v, want AlreadyExists", err)
	got, err = s.GetSecret(ctx, "bmc/h1")
	require.NoError(t, err)
	if string(got) != "pw-1" {
		t.Errorf("after a refused create: secret = %q, want the first password kept", got)
	}

	// An update with a stale revision writes no secret; a good one does.
	rev, err := s.Get(ctx, "hosts", "h1", &typesv1.Host{})
	require.NoError(t, err)
	_, err = s.UpdateAudited(ctx, "hosts", "h1", h, rev+100, AuditRecord{}, PutSecretOp("bmc/h1", []byte("pw-3")))
	require.True(t, errdefs.IsConflict(err), "UpdateAudited(stale) = %v, want Conflict", err)
	got, _ = s.GetSecret(ctx, "bmc/h1")
	if string(got) != "pw-1" {
		t.Errorf("after a refused update: secret = %q, want the first password kept", got)
	}
	_, err = s.UpdateAudited(ctx, "hosts", "h1", h, rev, AuditRecord{}, PutSecretOp("bmc/h1", []byte("pw-4")))
	require.NoError(t, err)
	got, _ = s.GetSecret(ctx, "bmc/h1")
	require.Equal(t, "pw-4", string(got))

	// Delete takes the secret with it.
	require.NoError(t, s.DeleteAudited(ctx, "hosts", "h1", 0, AuditRecord{}, DeleteSecretOp("bmc/h1")))
	if _, err := s.GetSecret(ctx, "bmc/h1"); !errdefs.IsNotFound(err) {
		t.Errorf("GetSecret after DeleteAudited with DeleteSecretOp = %v, want NotFound", err)
	}
}

// TestCollectOrphanSecrets: the secrets a crash left without their Host
// (the state of a store written before secrets went with their
// resources) are collected; a Host's own secret stays.
func TestCollectOrphanSecrets(t *testing.T) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	_, err := s.CreateAudited(ctx, "hosts", "real", &typesv1.Host{Metadata: &typesv1.ObjectMeta{Name: "real"}}, AuditRecord{}, PutSecretOp("bmc/real", []byte("pw")))
	require.NoError(t, err)
	// The old apply path sealed the password, then crashed before the Host.
	require.NoError(t, s.PutSecret(ctx, "bmc/ghost", []byte("pw")))
	require.NoError(t, s.PutSecret(ctx, "ca/key", []byte("not a host's")))

	n, err := s.CollectOrphanSecrets(ctx, "bmc/", "hosts")
	require.NoError(t, err)
	if n != 1 {
		t.Errorf("CollectOrphanSecrets = %d, want 1 (bmc/ghost)", n)
	}
	if _, err := s.GetSecret(ctx, "bmc/ghost"); !errdefs.IsNotFound(err) {
		t.Errorf("orphan bmc/ghost after collection: %v, want NotFound", err)
	}
	for _, p := range []string{"bmc/real", "ca/key"} {
		if _, err := s.GetSecret(ctx, p); err != nil {
			t.Errorf("secret %s after collection: %v, want kept", p, err)
		}
	}
	if n, err := s.CollectOrphanSecrets(ctx, "bmc/", "hosts"); err != nil || n != 0 {
		t.Errorf("second CollectOrphanSecrets = %d, %v, want 0, nil", n, err)
	}
}
