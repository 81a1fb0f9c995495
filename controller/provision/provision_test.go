package provision

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestQueueHandsAHostToOneWorkerAtATime checks the queue semantics the
// Executor relies on.
func TestQueueHandsAHostToOneWorkerAtATime(t *testing.T) {
	q := newHostQueue(nil)
	q.Add("a")
	q.Add("a")
	q.Add("b")
	require.Equal(t, 2, q.Len(), "a host queued twice is queued once")
	name, shutdown := q.Get()
	require.False(t, shutdown)
	require.Equal(t, "a", name)
	// Queued again while a worker has it: not handed out until done.
	q.Add("a")
	name, _ = q.Get()
	require.Equal(t, "b", name)
	if got := q.Len(); got != 0 {
		t.Fatalf("Len() while a is processing = %d, want 0", got)
	}
	q.Done("a")
	name, _ = q.Get()
	require.Equal(t, "a", name, "a host added while processing is queued again when done")
	q.Done("a")
	q.Done("b")
	q.ShutDown()
	_, shutdown = q.Get()
	require.True(t, shutdown, "Get() after ShutDown")
}

// TestQueueAddAfterKeepsTheEarliest: of several delayed adds of one host
// the earliest counts; the host is queued once, when it is due.
func TestQueueAddAfterKeepsTheEarliest(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Date(2026, 12, 2, 15, 0, 0, 0, time.UTC))
	q := newHostQueue(clk)
	defer q.ShutDown()
	q.AddAfter("a", time.Hour)
	q.AddAfter("a", time.Minute)
	q.AddAfter("a", time.Hour)
	require.Zero(t, q.Len(), "nothing is due yet")
	clk.Step(time.Minute)
	require.Eventually(t, func() bool { return q.Len() == 1 }, 10*time.Second, time.Millisecond,
		"a is queued once the earliest delay (1m) is over")
	name, shutdown := q.Get()
	require.False(t, shutdown)
	require.Equal(t, "a", name)
	q.Done("a")
}

func TestClassify(t *testing.T) {
	tests := []struct {
		kind hostlife.ActionKind
		err  error
		want hostlife.Failure
	}{
		{hostlife.ActPowerOn, errdefs.Unavailable("bmc: connection refused"), hostlife.FailTransient},
		{hostlife.ActInsertMedia, errdefs.NotSupported("no virtual media"), hostlife.FailPermanent},
		{hostlife.ActSetBoot, errdefs.PermissionDenied("bad credentials"), hostlife.FailPermanent},
		{hostlife.ActLayImage, errgrpc.FromGRPC(errgrpc.ToGRPC(errdefs.Unavailable("stream broke"))), hostlife.FailUnreachable},
		{hostlife.ActLayImage, &operationError{"operation x failed: sha256 mismatch"}, hostlife.FailAgent},
		{hostlife.ActWriteIdentity, errdefs.FailedPrecondition("no image"), hostlife.FailAgent},
		{hostlife.ActCheckBMC, errdefs.FailedPrecondition("redfish service has no SessionService: set spec.bmc.auth"), hostlife.FailPermanent},
		{hostlife.ActWipe, fmt.Errorf("wrapped: %w", errdefs.InvalidArgument("no target")), hostlife.FailPermanent},
		// The agent's refusal of a root-disk hint, as it crosses gRPC: only
		// a new hint helps, so the host goes to Error at once.
		{hostlife.ActLayImage, follow(&refused{errgrpc.ToGRPC(fmt.Errorf("lay image: %w", errdefs.InvalidArgument("root device hint serial=X matches none of this host's disks: /dev/sda (447.1 GiB, serial S45P)")))}, nil), hostlife.FailPermanent},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%s/%v", tt.kind, tt.err), func(t *testing.T) {
			if got := classify(tt.kind, tt.err); got != tt.want {
				t.Errorf("classify(%q, %v) = %v, want %v", tt.kind, tt.err, got, tt.want)
			}
		})
	}
}

// refused is a stream whose call the agent refused before the operation
// started.
type refused struct{ err error }

func (r *refused) Recv() (*agentv1.OperationEvent, error) { return nil, r.err }

type opEvents []*agentv1.OperationEvent

func (e *opEvents) Recv() (*agentv1.OperationEvent, error) {
	if len(*e) == 0 {
		return nil, io.EOF
	}
	ev := (*e)[0]
	*e = (*e)[1:]
	return ev, nil
}

func TestFollow(t *testing.T) {
	running := &agentv1.OperationEvent{OperationId: "op", State: agentv1.OperationState_OPERATION_STATE_RUNNING}
	tests := []struct {
		name    string
		evs     opEvents
		wantErr func(error) bool
	}{
		{"succeeded", opEvents{running, {OperationId: "op", State: agentv1.OperationState_OPERATION_STATE_SUCCEEDED}}, func(err error) bool { return err == nil }},
		{"failed", opEvents{running, {OperationId: "op", State: agentv1.OperationState_OPERATION_STATE_FAILED, Error: "sha256 mismatch"}},
			func(err error) bool { var o *operationError; return errors.As(err, &o) }},
		{"interrupted", opEvents{{OperationId: "op", State: agentv1.OperationState_OPERATION_STATE_INTERRUPTED}},
			func(err error) bool { var o *operationError; return errors.As(err, &o) }},
		{"stream ends early", opEvents{running}, errdefs.IsUnavailable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			evs := tt.evs
			if err := follow(&evs, nil); !tt.wantErr(err) {
				t.Errorf("follow(%s) = %v", tt.name, err)
			}
		})
	}
}

// rebootAgent answers Facts with mode and counts reboots.
type rebootAgent struct {
	agentv1.AgentClient
	mode    string
	reboots int
}

func (a *rebootAgent) Facts(context.Context, *agentv1.FactsRequest, ...grpc.CallOption) (*agentv1.FactsResponse, error) {
	if a.mode == "" {
		return nil, errgrpc.ToGRPC(errdefs.Unavailable("connection refused"))
	}
	return &agentv1.FactsResponse{Facts: &typesv1.Facts{AgentMode: a.mode}}, nil
}

func (a *rebootAgent) Reboot(context.Context, *agentv1.RebootRequest, ...grpc.CallOption) (*agentv1.RebootResponse, error) {
	a.reboots++
	return &agentv1.RebootResponse{}, nil
}

// TestRebootUnlessAgent: BootDisk run again after a restart does not
// reboot the installed agent its first run already booted.
func TestRebootUnlessAgent(t *testing.T) {
	for _, tt := range []struct {
		mode    string
		reboots int
		err     func(error) bool
	}{
		{"boot", 1, func(err error) bool { return err == nil }},
		{"installed", 0, func(err error) bool { return err == nil }},
		{"", 0, errdefs.IsUnavailable},
	} {
		a := &rebootAgent{mode: tt.mode}
		e := New(Deps{Agents: func(context.Context, *typesv1.Host) (agentv1.AgentClient, error) { return a, nil }}, Config{}, nil)
		err := e.do(context.Background(), &typesv1.Host{}, hostlife.Action{Kind: hostlife.ActReboot, UnlessAgent: "installed"})
		require.True(t, tt.err(err), "agent %q: err %v", tt.mode, err)
		require.Equal(t, tt.reboots, a.reboots, "agent %q: reboots", tt.mode)
	}
}
