package sim

import (
	"context"
	"io"
	"sync"
	"time"

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

	mu       sync.Mutex
	progress *agentv1.Progress // the latest report, nil before the first
	seq      int               // counts reports
	changed  chan struct{}     // closed (and replaced) on each report
}

// report makes p the operation's latest progress and wakes its streams.
func (op *operation) report(p *agentv1.Progress) {
	op.mu.Lock()
	defer op.mu.Unlock()
	op.progress = p
	op.seq++
	if op.changed != nil {
		close(op.changed)
	}
	op.changed = make(chan struct{})
}

// latest returns the latest report, its sequence number and a channel
// closed on the next one.
func (op *operation) latest() (*agentv1.Progress, int, <-chan struct{}) {
	op.mu.Lock()
	defer op.mu.Unlock()
	if op.changed == nil {
		op.changed = make(chan struct{})
	}
	return op.progress, op.seq, op.changed
}

// layProgressSteps is how many progress reports a simulated lay makes.
const layProgressSteps = 10

// simulatedImageSize stands for an image whose request gives no size.
const simulatedImageSize = 4 << 30

// layProgress reports step i of layProgressSteps of laying total bytes,
// elapsed after the start, as agent/lay's fetch step does.
func layProgress(i int, total uint64, elapsed time.Duration) *agentv1.Progress {
	done := total * uint64(i) / layProgressSteps
	p := &agentv1.Progress{Step: "fetch", DoneBytes: done, TotalBytes: total, Percent: 100 * float64(done) / float64(total)}
	if s := elapsed.Seconds(); s > 0 {
		p.BytesPerSecond = float64(done) / s
		if p.BytesPerSecond > 0 {
			p.EtaSeconds = float64(total-done) / p.BytesPerSecond
		}
	}
	return p
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
	if h.journal == nil {
		h.journal = map[string]*operation{}
	}
	h.journal[id] = op
	go run(op, h.gen)
	return op, nil
}

// LayImage lays the image over LayDuration (SlowLays: longer), reporting its progress in
// tenths (bytes of the request's raw size, rate, ETA) as a real agent
// does; a fault set with FailLays fails it with a checksum mismatch.
func (a *Agent) LayImage(ctx context.Context, in *agentv1.LayImageRequest, _ ...grpc.CallOption) (grpc.ServerStreamingClient[agentv1.OperationEvent], error) {
	h := a.host
	total := in.GetRawSize()
	if total == 0 {
		total = simulatedImageSize
	}
	op, err := a.start(in.GetOperationId(), "lay-image", func(op *operation, gen int) {
		start := time.Now()
		h.mu.Lock()
		d := h.fleet.cfg.LayDuration
		if h.slowLays > 0 {
			h.slowLays--
			d = h.slowLay
		}
		h.mu.Unlock()
		op.report(layProgress(0, total, 0))
		for i := 1; i <= layProgressSteps; i++ {
			if h.fleet.sleep(h.fleet.ctx, d/layProgressSteps) != nil {
				op.interrupt()
				return
			}
			op.report(layProgress(i, total, time.Since(start)))
		}
		if !h.fleet.waitLays() {
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

// stream delivers an operation's latest progress report as it changes
// (a slow reader skips reports, as the gRPC stream of a real agent never
// does, which the controller's throttle makes no matter), then its
// terminal event once it ends.
type stream struct {
	grpc.ClientStream
	ctx  context.Context
	op   *operation
	seen int
	sent bool
}

func (s *stream) Recv() (*agentv1.OperationEvent, error) {
	if s.sent {
		return nil, io.EOF
	}
	for {
		p, seq, changed := s.op.latest()
		if seq > s.seen {
			s.seen = seq
			return &agentv1.OperationEvent{OperationId: s.op.id, Kind: s.op.kind, State: agentv1.OperationState_OPERATION_STATE_RUNNING, Message: p.GetStep(), Progress: p}, nil
		}
		select {
		case <-s.op.done:
			s.sent = true
			return &agentv1.OperationEvent{OperationId: s.op.id, Kind: s.op.kind, State: s.op.state, Error: s.op.err}, nil
		case <-changed:
		case <-s.ctx.Done():
			return nil, errgrpc.ToGRPC(errdefs.Unavailable("operation %s: %v", s.op.id, s.ctx.Err()))
		}
	}
}

func (s *stream) Header() (metadata.MD, error) { return nil, nil }
func (s *stream) Trailer() metadata.MD         { return nil }
func (s *stream) CloseSend() error             { return nil }
func (s *stream) Context() context.Context     { return s.ctx }
func (s *stream) SendMsg(any) error            { return nil }
func (s *stream) RecvMsg(any) error            { return nil }
