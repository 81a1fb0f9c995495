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

	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestQueueHandsAHostToOneWorkerAtATime(t *testing.T) {
	q := newQueue()
	q.add("a")
	q.add("a")
	q.add("b")
	require.Equal(t, 2, q.len(), "a host queued twice is queued once")
	name, ok := q.get()
	require.True(t, ok)
	require.Equal(t, "a", name)
	// Queued again while a worker has it: not handed out until done.
	q.add("a")
	name, _ = q.get()
	require.Equal(t, "b", name)
	if got := q.len(); got != 0 {
		t.Fatalf("len() while a is processing = %d, want 0", got)
	}
	q.done("a")
	name, _ = q.get()
	require.Equal(t, "a", name, "a host added while processing is queued again when done")
	q.done("a")
	q.done("b")
	q.close()
	_, ok = q.get()
	require.False(t, ok, "get() after close")
}

func TestQueueAddAfterKeepsTheEarliest(t *testing.T) {
	q := newQueue()
	now := time.Now()
	q.addAfter("a", time.Hour, now)
	q.addAfter("a", time.Millisecond, now)
	q.addAfter("a", time.Hour, now)
	name, ok := q.get() // blocks until the 1 ms timer fires
	require.True(t, ok)
	require.Equal(t, "a", name)
	q.mu.Lock()
	pending := len(q.timers)
	q.mu.Unlock()
	require.Zero(t, pending, "the later times were dropped for the earlier one")
	q.close()
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
		{hostlife.ActLayImage, follow(&refused{errgrpc.ToGRPC(fmt.Errorf("lay image: %w", errdefs.InvalidArgument("root device hint serial=X matches none of this host's disks: /dev/sda (447.1 GiB, serial S45P)")))}), hostlife.FailPermanent},
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

type events []*agentv1.OperationEvent

func (e *events) Recv() (*agentv1.OperationEvent, error) {
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
		evs     events
		wantErr func(error) bool
	}{
		{"succeeded", events{running, {OperationId: "op", State: agentv1.OperationState_OPERATION_STATE_SUCCEEDED}}, func(err error) bool { return err == nil }},
		{"failed", events{running, {OperationId: "op", State: agentv1.OperationState_OPERATION_STATE_FAILED, Error: "sha256 mismatch"}},
			func(err error) bool { var o *operationError; return errors.As(err, &o) }},
		{"interrupted", events{{OperationId: "op", State: agentv1.OperationState_OPERATION_STATE_INTERRUPTED}},
			func(err error) bool { var o *operationError; return errors.As(err, &o) }},
		{"stream ends early", events{running}, errdefs.IsUnavailable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			evs := tt.evs
			if err := follow(&evs); !tt.wantErr(err) {
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
