package logring

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

func lines(t *testing.T, r *Ring, tail int) []string {
	t.Helper()
	var got []string
	require.NoError(t, r.Logs(context.Background(), tail, false, func(l *agentv1.LogLine) error {
		got = append(got, l.GetLine())
		return nil
	}))
	return got
}

func TestTail(t *testing.T) {
	r := New(3)
	log := slog.New(slog.NewTextHandler(r, &slog.HandlerOptions{ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}}))
	for i := range 5 {
		log.Info("step", "n", i)
	}
	tests := []struct {
		tail int
		want []string
	}{
		{2, []string{"level=INFO msg=step n=3", "level=INFO msg=step n=4"}},
		{0, []string{"level=INFO msg=step n=2", "level=INFO msg=step n=3", "level=INFO msg=step n=4"}},
		{10, []string{"level=INFO msg=step n=2", "level=INFO msg=step n=3", "level=INFO msg=step n=4"}},
	}
	for _, tt := range tests {
		if got := lines(t, r, tt.tail); strings.Join(got, "|") != strings.Join(tt.want, "|") {
			t.Errorf("Logs(tail %d) = %q, want %q", tt.tail, got, tt.want)
		}
	}
}

func TestFollow(t *testing.T) {
	r := New(100)
	fmt.Fprintln(r, "before")
	ctx, cancel := context.WithCancel(context.Background())
	got := make(chan string, 10)
	done := make(chan error)
	go func() {
		done <- r.Logs(ctx, 1, true, func(l *agentv1.LogLine) error {
			got <- l.GetLine()
			return nil
		})
	}()
	require.Equal(t, "before", <-got)
	fmt.Fprintln(r, "after")
	require.Equal(t, "after", <-got)
	cancel()
	require.NoError(t, <-done)
}
