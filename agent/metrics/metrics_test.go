package metrics_test

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/agent/journal"
	"github.com/kilnhq/kiln/agent/metrics"
	"github.com/kilnhq/kiln/internal/promtest"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// TestAgentMetrics runs two operations through a journal reporting to
// the agent's metrics, scrapes the loopback endpoint as Prometheus would
// and lints it with promtool.
func TestAgentMetrics(t *testing.T) {
	m := metrics.New()
	j, err := journal.Open(t.TempDir(), nil, journal.WithObserver(m))
	require.NoError(t, err)
	t.Cleanup(func() { j.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- m.Serve(ctx, lis, nil) }()

	ok := func(context.Context, journal.Emit) error { return nil }
	fail := func(context.Context, journal.Emit) error { return errors.New("disk gone") }
	for _, op := range []struct {
		kind, id string
		fn       journal.Func
	}{{"Wipe", "w1", ok}, {"LayImage", "l1", fail}} {
		_ = j.Start(ctx, op.kind, op.id, op.fn, func(*agentv1.OperationEvent) error { return nil })
	}
	url := "http://" + lis.Addr().String() + "/metrics"
	var s *promtest.Scrape
	require.Eventually(t, func() bool {
		s = promtest.Get(t, url)
		return s.Sum("kiln_agent_operation_duration_seconds") == 2
	}, 10*time.Second, 20*time.Millisecond, "operations not observed")
	for _, tc := range []struct{ kind, outcome string }{{"Wipe", "success"}, {"LayImage", "failure"}} {
		if got, found := s.Value("kiln_agent_operation_duration_seconds", "operation", tc.kind, "outcome", tc.outcome); !found || got != 1 {
			t.Errorf("kiln_agent_operation_duration_seconds{operation=%q,outcome=%q} count = %v (found %t), want 1", tc.kind, tc.outcome, got, found)
		}
	}
	if _, found := s.Value("process_resident_memory_bytes"); !found {
		t.Errorf("scrape has no process_resident_memory_bytes")
	}
	out := promtest.CheckMetrics(t, s.Text)
	t.Logf("promtool check metrics: ok %s", out)
	cancel()
	require.NoError(t, <-done)
}

func TestCheckLoopback(t *testing.T) {
	for _, tc := range []struct {
		addr string
		ok   bool
	}{
		{"127.0.0.1:9101", true},
		{"[::1]:9101", true},
		{"localhost:9101", true},
		{"0.0.0.0:9101", false},
		{":9101", false},
		{"10.0.0.5:9101", false},
		{"127.0.0.1", false},
	} {
		if err := metrics.CheckLoopback(tc.addr); (err == nil) != tc.ok {
			t.Errorf("CheckLoopback(%q) = %v, want ok %t", tc.addr, err, tc.ok)
		}
	}
}
