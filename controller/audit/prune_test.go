package audit

import (
	"context"
	"log/slog"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/kilnhq/kiln/controller/store"
)

// TestPrune runs the retention loop on a real store: the first round
// applies the age and the count limits, a later round prunes what was
// written since, and the loop returns once its context ends.
func TestPrune(t *testing.T) {
	if testing.Short() {
		t.Skip("starts embedded etcd")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	emb, err := store.StartEmbedded(ctx, store.EmbeddedConfig{DataDir: filepath.Join(t.TempDir(), "etcd")})
	require.NoError(t, err)
	t.Cleanup(emb.Close)
	cl, err := store.Dial(emb.Endpoints(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { cl.Close() })
	st := store.New(cl)

	day0 := time.Date(2026, 11, 1, 12, 0, 0, 0, time.UTC)
	add := func(day float64, name string) {
		require.NoError(t, st.AppendAudit(ctx, store.AuditRecord{Time: day0.Add(time.Duration(day * float64(24*time.Hour))), Msg: wrapperspb.String(name)}))
	}
	for i := range 10 {
		add(float64(i), string(rune('a'+i)))
	}
	names := func() []string {
		var out []string
		require.NoError(t, st.ListAudit(ctx, time.Time{}, func() proto.Message { return &wrapperspb.StringValue{} }, func(m proto.Message) bool {
			out = append(out, m.(*wrapperspb.StringValue).GetValue())
			return true
		}))
		return out
	}
	waitFor := func(want []string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			got := names()
			if slices.Equal(got, want) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("audit log = %q, want %q within 10s", got, want)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	pctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		// Now is day 9: five days' age keeps e..j, three entries keep h..j.
		Prune(pctx, st, Retention{MaxAge: 5 * 24 * time.Hour, MaxEntries: 3, Interval: 50 * time.Millisecond},
			func() time.Time { return day0.Add(9 * 24 * time.Hour) }, slog.New(slog.DiscardHandler))
	}()
	waitFor([]string{"h", "i", "j"})
	add(9.5, "k")
	waitFor([]string{"i", "j", "k"})
	stop()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Prune did not return within 5s of its context ending")
	}
}
