package heartbeat_test

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kilnhq/kiln/agent/heartbeat"
	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// agents is an Agents service that fails the first failN heartbeats.
type agents struct {
	controllerv1.UnimplementedAgentsServer
	mu    sync.Mutex
	failN int
	reqs  []*controllerv1.HeartbeatRequest
}

func (a *agents) Heartbeat(ctx context.Context, req *controllerv1.HeartbeatRequest) (*controllerv1.HeartbeatResponse, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.reqs = append(a.reqs, req)
	if len(a.reqs) <= a.failN {
		return nil, errgrpc.ToGRPC(errdefs.Unavailable("store: etcd leader changed"))
	}
	return &controllerv1.HeartbeatResponse{Host: "h1"}, nil
}

func (a *agents) requests() []*controllerv1.HeartbeatRequest {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]*controllerv1.HeartbeatRequest(nil), a.reqs...)
}

type facts struct{}

func (facts) Facts(context.Context) (*typesv1.Facts, error) {
	return &typesv1.Facts{Hostname: "h1"}, nil
}

func TestRetriesThenSucceeds(t *testing.T) {
	srv := &agents{failN: 2}
	s := grpc.NewServer()
	controllerv1.RegisterAgentsServer(s, srv)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go s.Serve(lis)
	t.Cleanup(s.Stop)

	la := &heartbeat.LocalAddr{}
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithContextDialer(la.Dialer()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var results []error
	var mu sync.Mutex
	successes := make(chan struct{}, 10)
	loop := heartbeat.New(heartbeat.Options{
		Client:   controllerv1.NewAgentsClient(conn),
		Address:  heartbeat.Advertise(":7441", la),
		Facts:    facts{},
		Version:  "v0.1.0",
		Interval: time.Millisecond,
		Backoff:  backoff.Policy{Base: time.Millisecond, Max: 5 * time.Millisecond, Factor: 2},
		Observe: func(_ *controllerv1.HeartbeatResponse, err error) {
			mu.Lock()
			results = append(results, err)
			mu.Unlock()
			if err == nil {
				successes <- struct{}{}
			}
		},
	})
	done := make(chan error)
	go func() { done <- loop.Run(ctx) }()
	<-successes
	<-successes
	cancel()
	require.NoError(t, <-done)

	mu.Lock()
	defer mu.Unlock()
	require.GreaterOrEqual(t, len(results), 4)
	for i, err := range results[:2] {
		if !errdefs.IsUnavailable(err) {
			t.Errorf("heartbeat %d error = %v, want Unavailable", i, err)
		}
	}
	require.NoError(t, results[2])
	reqs := srv.requests()
	if reqs[2].GetFacts().GetHostname() != "h1" {
		t.Errorf("first successful heartbeat facts = %v, want facts sent until one succeeds", reqs[2].GetFacts())
	}
	if reqs[3].GetFacts() != nil {
		t.Errorf("heartbeat after facts were delivered carries facts again: %v", reqs[3].GetFacts())
	}
	if got, want := reqs[3].GetAgentAddress(), "127.0.0.1:7441"; got != want {
		t.Errorf("advertised address = %q, want %q", got, want)
	}
	require.Equal(t, "v0.1.0", reqs[3].GetVersion())
}

func TestAdvertise(t *testing.T) {
	tests := []struct{ listen, want string }{
		{"10.0.0.5:7441", "10.0.0.5:7441"},
		{"node1.lab:7441", "node1.lab:7441"},
		{":7441", ""},
		{"0.0.0.0:7441", ""},
		{"[::]:7441", ""},
	}
	for _, tt := range tests {
		if got := heartbeat.Advertise(tt.listen, &heartbeat.LocalAddr{})(); got != tt.want {
			t.Errorf("Advertise(%q)() = %q, want %q", tt.listen, got, tt.want)
		}
	}
}

// hashAgents is an Agents service that holds the facts of one hash and
// asks for the facts whenever a heartbeat names another.
type hashAgents struct {
	controllerv1.UnimplementedAgentsServer
	mu   sync.Mutex
	held string
	reqs []*controllerv1.HeartbeatRequest
}

func (a *hashAgents) Heartbeat(_ context.Context, req *controllerv1.HeartbeatRequest) (*controllerv1.HeartbeatResponse, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.reqs = append(a.reqs, req)
	if req.GetFacts() != nil {
		a.held = req.GetFactsSha256()
	}
	return &controllerv1.HeartbeatResponse{Host: "h1", FactsWanted: req.GetFactsSha256() != a.held}, nil
}

// TestFactsSentAsHash: every heartbeat carries the facts' hash; the facts
// go on the first heartbeat and, when the controller asks (it lost them:
// a restart, another replica), at once on the next one, not again after.
func TestFactsSentAsHash(t *testing.T) {
	srv := &hashAgents{}
	s := grpc.NewServer()
	controllerv1.RegisterAgentsServer(s, srv)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go s.Serve(lis)
	t.Cleanup(s.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	beats := make(chan struct{}, 100)
	loop := heartbeat.New(heartbeat.Options{
		Client:   controllerv1.NewAgentsClient(conn),
		Facts:    facts{},
		Version:  "v0.1.0",
		Interval: 20 * time.Millisecond,
		Observe: func(_ *controllerv1.HeartbeatResponse, err error) {
			if err == nil {
				beats <- struct{}{}
			}
		},
	})
	done := make(chan error)
	go func() { done <- loop.Run(ctx) }()
	for range 3 {
		<-beats
	}
	srv.mu.Lock()
	srv.held = "" // the controller forgets the facts
	srv.mu.Unlock()
	for range 4 {
		<-beats
	}
	cancel()
	require.NoError(t, <-done)

	srv.mu.Lock()
	defer srv.mu.Unlock()
	var withFacts []int
	for i, r := range srv.reqs {
		if len(r.GetFactsSha256()) != 64 {
			t.Errorf("heartbeat %d facts_sha256 = %q, want a sha256", i, r.GetFactsSha256())
		}
		if r.GetFacts() != nil {
			withFacts = append(withFacts, i)
		}
	}
	// The first heartbeat, then the one right after the controller asked.
	require.Len(t, withFacts, 2, "heartbeats with facts: %v", withFacts)
	require.Equal(t, 0, withFacts[0])
	asked := withFacts[1] - 1
	require.Nil(t, srv.reqs[asked].GetFacts(), "the heartbeat that was answered facts_wanted")
}
