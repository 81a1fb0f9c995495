package sim

import (
	"context"
	"io"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

type agentClient = agentv1.AgentClient

// Agent is the simulated agent of a host, as the controller's gRPC client
// sees it: calls fail with Unavailable while no agent runs, and long
// operations live in a journal keyed by operation id (a second call with
// the same id re-attaches) that a power off or reboot ends, as the boot
// agent's in-memory journal does. Calls the simulation does not model
// (Prepare, Preflight, kubeadm, Probe, Logs) are not for the lifecycle
// executor and must not be made.
type Agent struct {
	agentv1.AgentClient // nil: only the calls below are modelled
	host                *Host
}

var _ agentv1.AgentClient = (*Agent)(nil)

// operation is one journalled agent operation.
type operation struct {
	id, kind string
	done     chan struct{}
	once     sync.Once
	state    agentv1.OperationState
	err      string
}

func (op *operation) finish(state agentv1.OperationState, err string) {
	op.once.Do(func() {
		op.state, op.err = state, err
		close(op.done)
	})
}

func (op *operation) interrupt() {
	op.finish(agentv1.OperationState_OPERATION_STATE_INTERRUPTED, "agent restarted")
}

func (a *Agent) unavailable() error {
	return errgrpc.ToGRPC(errdefs.Unavailable("agent of %s: connection refused", a.host.name))
}

// Facts reports the running agent's facts.
func (a *Agent) Facts(context.Context, *agentv1.FactsRequest, ...grpc.CallOption) (*agentv1.FactsResponse, error) {
	h := a.host
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.running == "" {
		return nil, a.unavailable()
	}
	return &agentv1.FactsResponse{Facts: &typesv1.Facts{Hostname: h.name, AgentMode: h.running, BootSource: h.bootSource}}, nil
}

// start journals a new operation, or returns the one of the same id.
func (a *Agent) start(id, kind string, run func(op *operation, gen int)) (*operation, error) {
	h := a.host
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.running == "" {
		return nil, a.unavailable()
	}
	if h.running != "boot" {
		return nil, errgrpc.ToGRPC(errdefs.FailedPrecondition("%s needs the boot agent; the %s agent runs", kind, h.running))
	}
	if id == "" {
		return nil, errgrpc.ToGRPC(errdefs.InvalidArgument("%s: operation id is required", kind))
	}
	if op, ok := h.journal[id]; ok {
		return op, nil
	}
	op := &operation{id: id, kind: kind, done: make(chan struct{}), state: agentv1.OperationState_OPERATION_STATE_RUNNING}
	h.journal[id] = op
	go run(op, h.gen)
	return op, nil
}

// LayImage lays the image after LayDuration; a fault set with FailLays
// fails it with a checksum mismatch.
func (a *Agent) LayImage(ctx context.Context, in *agentv1.LayImageRequest, _ ...grpc.CallOption) (grpc.ServerStreamingClient[agentv1.OperationEvent], error) {
	h := a.host
	op, err := a.start(in.GetOperationId(), "lay-image", func(op *operation, gen int) {
		if h.fleet.sleep(h.fleet.ctx, h.fleet.cfg.LayDuration) != nil {
			op.interrupt()
			return
		}
		h.mu.Lock()
		defer h.mu.Unlock()
		if h.gen != gen {
			op.interrupt()
			return
		}
		if h.layFaults > 0 {
			h.layFaults--
			op.finish(agentv1.OperationState_OPERATION_STATE_FAILED, "sha256 mismatch: image stream truncated")
			return
		}
		h.diskImage, h.identity = in.GetUrl(), false
		h.lays++
		op.finish(agentv1.OperationState_OPERATION_STATE_SUCCEEDED, "")
	})
	if err != nil {
		return nil, err
	}
	return &stream{ctx: ctx, op: op}, nil
}

// Wipe blanks the disk after WipeDuration.
func (a *Agent) Wipe(ctx context.Context, in *agentv1.WipeRequest, _ ...grpc.CallOption) (grpc.ServerStreamingClient[agentv1.OperationEvent], error) {
	h := a.host
	op, err := a.start(in.GetOperationId(), "wipe", func(op *operation, gen int) {
		if h.fleet.sleep(h.fleet.ctx, h.fleet.cfg.WipeDuration) != nil {
			op.interrupt()
			return
		}
		h.mu.Lock()
		defer h.mu.Unlock()
		if h.gen != gen {
			op.interrupt()
			return
		}
		h.diskImage, h.identity = "", false
		op.finish(agentv1.OperationState_OPERATION_STATE_SUCCEEDED, "")
	})
	if err != nil {
		return nil, err
	}
	return &stream{ctx: ctx, op: op}, nil
}

// Operation re-attaches to a journalled operation.
func (a *Agent) Operation(ctx context.Context, in *agentv1.OperationRequest, _ ...grpc.CallOption) (grpc.ServerStreamingClient[agentv1.OperationEvent], error) {
	h := a.host
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.running == "" {
		return nil, a.unavailable()
	}
	op, ok := h.journal[in.GetOperationId()]
	if !ok {
		return nil, errgrpc.ToGRPC(errdefs.NotFound("operation %q not found", in.GetOperationId()))
	}
	return &stream{ctx: ctx, op: op}, nil
}

// WriteIdentity marks the laid image as personalised: only then does it
// boot into the installed agent.
func (a *Agent) WriteIdentity(_ context.Context, in *agentv1.WriteIdentityRequest, _ ...grpc.CallOption) (*agentv1.WriteIdentityResponse, error) {
	h := a.host
	h.mu.Lock()
	defer h.mu.Unlock()
	switch {
	case h.running == "":
		return nil, a.unavailable()
	case h.running != "boot":
		return nil, errgrpc.ToGRPC(errdefs.FailedPrecondition("write identity needs the boot agent"))
	case h.diskImage == "":
		return nil, errgrpc.ToGRPC(errdefs.FailedPrecondition("write identity: %s holds no image", in.GetTarget()))
	}
	h.identity = true
	return &agentv1.WriteIdentityResponse{}, nil
}

// Reboot answers, then restarts the host.
func (a *Agent) Reboot(context.Context, *agentv1.RebootRequest, ...grpc.CallOption) (*agentv1.RebootResponse, error) {
	h := a.host
	h.mu.Lock()
	running := h.running
	h.mu.Unlock()
	if running == "" {
		return nil, a.unavailable()
	}
	go h.reboot()
	return &agentv1.RebootResponse{}, nil
}

// stream delivers the terminal event of an operation once it ends.
type stream struct {
	grpc.ClientStream
	ctx  context.Context
	op   *operation
	sent bool
}

func (s *stream) Recv() (*agentv1.OperationEvent, error) {
	if s.sent {
		return nil, io.EOF
	}
	select {
	case <-s.op.done:
	case <-s.ctx.Done():
		return nil, errgrpc.ToGRPC(errdefs.Unavailable("operation %s: %v", s.op.id, s.ctx.Err()))
	}
	s.sent = true
	return &agentv1.OperationEvent{OperationId: s.op.id, Kind: s.op.kind, State: s.op.state, Error: s.op.err}, nil
}

func (s *stream) Header() (metadata.MD, error) { return nil, nil }
func (s *stream) Trailer() metadata.MD         { return nil }
func (s *stream) CloseSend() error             { return nil }
func (s *stream) Context() context.Context     { return s.ctx }
func (s *stream) SendMsg(any) error            { return nil }
func (s *stream) RecvMsg(any) error            { return nil }
