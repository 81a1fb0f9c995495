package store

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// auditNames lists the audit log's entries (wrapped strings), oldest
// first.
func auditNames(t *testing.T, s *Store, since time.Time) []string {
	t.Helper()
	var out []string
	err := s.ListAudit(context.Background(), since, func() proto.Message { return &wrapperspb.StringValue{} }, func(m proto.Message) bool {
		out = append(out, m.(*wrapperspb.StringValue).GetValue())
		return true
	})
	require.NoError(t, err)
	return out
}

// TestPruneAudit keeps ten entries a day apart and prunes them by age and
// then by count, as the controller's retention does.
func TestPruneAudit(t *testing.T) {
	if testing.Short() {
		t.Skip("starts embedded etcd")
	}
	s, _ := newStore(t)
	ctx := context.Background()
	day0 := time.Date(2026, 11, 1, 12, 0, 0, 0, time.UTC)
	for i := range 10 {
		require.NoError(t, s.AppendAudit(ctx, AuditRecord{Time: day0.Add(time.Duration(i) * 24 * time.Hour), Msg: wrapperspb.String(string(rune('a' + i)))}))
	}
	require.Equal(t, []string{"a", "b", "c", "d", "e", "f", "g", "h", "i", "j"}, auditNames(t, s, time.Time{}))
	require.Equal(t, []string{"h", "i", "j"}, auditNames(t, s, day0.Add(7*24*time.Hour)), "ListAudit since day 7")

	// Older than day 3 goes: a, b, c.
	n, err := s.PruneAudit(ctx, day0.Add(3*24*time.Hour), 0)
	require.NoError(t, err)
	if got := auditNames(t, s, time.Time{}); n != 3 || len(got) != 7 || got[0] != "d" {
		t.Errorf("PruneAudit(day 3, no count) deleted %d, left %q; want 3 deleted, d to j left", n, got)
	}
	// At most 4: d, e, f go.
	n, err = s.PruneAudit(ctx, time.Time{}, 4)
	require.NoError(t, err)
	if got := auditNames(t, s, time.Time{}); n != 3 || len(got) != 4 || got[0] != "g" {
		t.Errorf("PruneAudit(no age, 4) deleted %d, left %q; want 3 deleted, g to j left", n, got)
	}
	// Nothing to do is no error.
	n, err = s.PruneAudit(ctx, day0, 100)
	require.NoError(t, err)
	require.Zero(t, n)
}

// TestAuditedWriteIsOneTransaction: a write refused by its revision check
// stores no audit record, and one that succeeds stores exactly one.
func TestAuditedWriteIsOneTransaction(t *testing.T) {
	if testing.Short() {
		t.Skip("starts embedded etcd")
	}
	s, _ := newStore(t)
	ctx := context.Background()
	now := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	rev, err := s.CreateAudited(ctx, "things", "x", wrapperspb.String("v1"), AuditRecord{Time: now, Msg: wrapperspb.String("create x")})
	require.NoError(t, err)
	_, err = s.UpdateAudited(ctx, "things", "x", wrapperspb.String("v2"), rev+100, AuditRecord{Time: now, Msg: wrapperspb.String("stale update x")})
	require.Error(t, err)
	require.NoError(t, s.DeleteAudited(ctx, "things", "x", 0, AuditRecord{Time: now.Add(time.Second), Msg: wrapperspb.String("delete x")}))
	require.Equal(t, []string{"create x", "delete x"}, auditNames(t, s, time.Time{}))
	_, err = s.Create(ctx, "audit", "x", wrapperspb.String("forged"))
	require.Error(t, err, "kind audit must be reserved")
}
