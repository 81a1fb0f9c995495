package server_test

import (
	"context"
	"errors"
	"io"
	"sort"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnhq/kiln/agent/agenttest"
	"github.com/kilnhq/kiln/agent/server"
	"github.com/kilnhq/kiln/host"
	"github.com/kilnhq/kiln/internal/pki"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func staticFacts(ctx context.Context) (*typesv1.Facts, error) {
	return &typesv1.Facts{Hostname: "host-a", CpuCount: 2}, nil
}

// wiper is a Wiper that waits for release and counts its runs.
type wiper struct {
	runs    atomic.Int32
	release chan struct{}
	err     error
}

func (w *wiper) Wipe(ctx context.Context, req *agentv1.WipeRequest, emit server.Emit) error {
	w.runs.Add(1)
	emit(&agentv1.OperationEvent{Message: "wiping " + req.GetTarget()})
	select {
	case <-w.release:
		return w.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// drain reads a stream of events to its end.
func drain(s interface {
	Recv() (*agentv1.OperationEvent, error)
}) ([]*agentv1.OperationEvent, error) {
	var evs []*agentv1.OperationEvent
	for {
		ev, err := s.Recv()
		if errors.Is(err, io.EOF) {
			return evs, nil
		}
		if err != nil {
			return evs, err
		}
		evs = append(evs, ev)
	}
}

func TestAuthorization(t *testing.T) {
	w := &wiper{release: make(chan struct{})}
	close(w.release)
	a := agenttest.Start(t, server.Options{Facts: server.FactsFunc(staticFacts), Wiper: w})
	foreign := agenttest.NewCA(t)

	tests := []struct {
		name   string
		issuer *pki.CA
		role   pki.Role
		want   codes.Code
	}{
		{"no certificate", nil, "", codes.Unauthenticated},
		{"agent certificate", a.CA, pki.RoleAgent, codes.PermissionDenied},
		{"reader certificate", a.CA, pki.RoleReader, codes.PermissionDenied},
		{"operator certificate", a.CA, pki.RoleOperator, codes.PermissionDenied},
		{"admin certificate", a.CA, pki.RoleAdmin, codes.PermissionDenied},
		// Refused in the TLS handshake: the certificate does not verify.
		{"controller certificate of another CA", foreign, pki.RoleController, codes.Unavailable},
		{"controller certificate", a.CA, pki.RoleController, codes.OK},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := a.Client(t, agenttest.ClientTLS(t, a.CA, tt.issuer, tt.role, "someone"))
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()

			_, err := c.Facts(ctx, &agentv1.FactsRequest{})
			if got := status.Code(err); got != tt.want {
				t.Errorf("Facts() as %s = %v (%v), want %v", tt.name, got, err, tt.want)
			}
			stream, err := c.Wipe(ctx, &agentv1.WipeRequest{OperationId: "w-" + string(tt.role), Target: "/dev/null"})
			if err == nil {
				_, err = drain(stream)
			}
			if got := status.Code(err); got != tt.want {
				t.Errorf("Wipe() as %s = %v (%v), want %v", tt.name, got, err, tt.want)
			}
		})
	}
	require.Equal(t, int32(1), w.runs.Load(), "only the controller's Wipe may run")
}

func TestNotWiredIsUnimplemented(t *testing.T) {
	a := agenttest.Start(t, server.Options{})
	c := a.Controller(t)
	ctx := context.Background()

	_, err := c.Facts(ctx, &agentv1.FactsRequest{})
	require.Equal(t, codes.Unimplemented, status.Code(err), "Facts: %v", err)
	stream, err := c.Prepare(ctx, &agentv1.PrepareRequest{OperationId: "p1"})
	require.NoError(t, err)
	_, err = drain(stream)
	require.Equal(t, codes.Unimplemented, status.Code(err), "Prepare: %v", err)
	require.Contains(t, status.Convert(err).Message(), "Prepare is not available")
}

func TestValidation(t *testing.T) {
	a := agenttest.Start(t, server.Options{Wiper: &wiper{}})
	c := a.Controller(t)
	stream, err := c.Wipe(context.Background(), &agentv1.WipeRequest{OperationId: "w1"})
	require.NoError(t, err)
	_, err = drain(stream)
	require.Equal(t, codes.InvalidArgument, status.Code(err), "Wipe without target: %v", err)

	stream, err = c.Wipe(context.Background(), &agentv1.WipeRequest{OperationId: "../../etc/x", Target: "/dev/null"})
	require.NoError(t, err)
	_, err = drain(stream)
	require.Equal(t, codes.InvalidArgument, status.Code(err), "Wipe with a path as id: %v", err)
}

// TestReattach: a controller loses its stream in the middle of a wipe,
// reconnects, re-attaches by id and sees the result; calling Wipe again
// with the same id does not wipe twice.
func TestReattach(t *testing.T) {
	w := &wiper{release: make(chan struct{})}
	a := agenttest.Start(t, server.Options{Wiper: w})
	c := a.Controller(t)

	ctx, cancel := context.WithCancel(context.Background())
	stream, err := c.Wipe(ctx, &agentv1.WipeRequest{OperationId: "wipe-7", Target: "/dev/vdb"})
	require.NoError(t, err)
	first, err := stream.Recv()
	require.NoError(t, err)
	require.Equal(t, agentv1.OperationState_OPERATION_STATE_RUNNING, first.GetState())
	cancel() // the controller goes away

	again, err := c.Wipe(context.Background(), &agentv1.WipeRequest{OperationId: "wipe-7", Target: "/dev/vdb"})
	require.NoError(t, err)
	close(w.release)
	evs, err := drain(again)
	require.NoError(t, err)

	op, err := c.Operation(context.Background(), &agentv1.OperationRequest{OperationId: "wipe-7"})
	require.NoError(t, err)
	evs2, err := drain(op)
	require.NoError(t, err)
	for name, got := range map[string][]*agentv1.OperationEvent{"Wipe again": evs, "Operation": evs2} {
		require.NotEmpty(t, got, name)
		term := got[len(got)-1]
		if term.GetState() != agentv1.OperationState_OPERATION_STATE_SUCCEEDED || term.GetOperationId() != "wipe-7" || term.GetKind() != "wipe" {
			t.Errorf("%s: terminal event = %v, want wipe-7 wipe SUCCEEDED", name, term)
		}
	}
	require.Equal(t, int32(1), w.runs.Load(), "the wipe ran %d times, want 1", w.runs.Load())

	_, err = drain(must(c.Operation(context.Background(), &agentv1.OperationRequest{OperationId: "nope"})))
	require.Equal(t, codes.NotFound, status.Code(err), "Operation(nope): %v", err)
}

func TestFailedOperationIsAnEventNotAnError(t *testing.T) {
	w := &wiper{release: make(chan struct{}), err: errors.New("blkdiscard /dev/vdb: device busy")}
	close(w.release)
	a := agenttest.Start(t, server.Options{Wiper: w})
	evs, err := drain(must(a.Controller(t).Wipe(context.Background(), &agentv1.WipeRequest{Target: "/dev/vdb"})))
	require.NoError(t, err)
	term := evs[len(evs)-1]
	if term.GetState() != agentv1.OperationState_OPERATION_STATE_FAILED || term.GetError() != "blkdiscard /dev/vdb: device busy" {
		t.Errorf("Wipe() terminal = %v, want FAILED with the error", term)
	}
	require.NotEmpty(t, term.GetOperationId(), "an operation without id gets a fresh one")
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// BenchmarkFactsRPC measures one Facts call over loopback mTLS with a
// fixed answer (the RPC's own cost) and with the real host.Facts.
func BenchmarkFactsRPC(b *testing.B) {
	for _, bc := range []struct {
		name  string
		facts server.FactsFunc
	}{
		{"static", staticFacts},
		{"host", func(ctx context.Context) (*typesv1.Facts, error) { return host.Facts(ctx, "/") }},
	} {
		b.Run(bc.name, func(b *testing.B) {
			a := agenttest.Start(b, server.Options{Facts: bc.facts})
			c := a.Controller(b)
			ctx := context.Background()
			_, err := c.Facts(ctx, &agentv1.FactsRequest{}) // handshake outside the loop
			require.NoError(b, err)
			var lat []time.Duration
			for b.Loop() {
				start := time.Now()
				if _, err := c.Facts(ctx, &agentv1.FactsRequest{}); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(start))
			}
			sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
			b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
		})
	}
}
