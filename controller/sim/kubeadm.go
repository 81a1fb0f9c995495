package sim

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/kilnhq/kiln/controller/provision"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Kubeadm simulates what the installed agents of a fleet do for the
// cluster executor (controller/clusterexec): Prepare, Preflight,
// KubeadmInit, KubeadmJoin, KubeadmReset and Probe. Long calls live in a
// journal keyed by host and operation id, as on the installed agent's
// disk: a second call with the same id re-attaches to the first and
// returns its result instead of running it again. Every call is logged
// (Calls), so tests can assert the order of bootstrap steps.
//
// These calls need the installed agent (a host booted from its laid
// disk); with no agent, or with the boot agent, they fail as the real
// agent would.
type Kubeadm struct {
	fleet *Fleet
	// duration is how long each of KubeadmInit and KubeadmJoin takes.
	duration time.Duration

	mu        sync.Mutex
	calls     []Call
	journal   map[string]*kubeadmOp // host + "/" + operation id
	nodes     map[string]string     // host -> role of the node it runs
	preflight map[string]*agentv1.Check
	notReady  map[string]bool
	caHash    string
	// kubeconfig is what KubeadmInit returns as the admin kubeconfig
	// (SetAdminKubeconfig); empty by default.
	kubeconfig string
}

// Call is one call to a simulated installed agent.
type Call struct {
	Host        string
	Method      string // "Prepare", "Preflight", "KubeadmInit", ...
	OperationID string
	// Attached is true when the call re-attached to a journalled
	// operation of the same id instead of starting one.
	Attached bool
}

// kubeadmOp is one journalled operation.
type kubeadmOp struct {
	id, kind string
	done     chan struct{}
	events   []*agentv1.OperationEvent // the last one is terminal
}

// NewKubeadm returns the kubeadm simulation of f; KubeadmInit and
// KubeadmJoin take d each.
func NewKubeadm(f *Fleet, d time.Duration) *Kubeadm {
	return &Kubeadm{
		fleet:     f,
		duration:  d,
		journal:   map[string]*kubeadmOp{},
		nodes:     map[string]string{},
		preflight: map[string]*agentv1.Check{},
		notReady:  map[string]bool{},
		caHash:    fmt.Sprintf("sha256:%x", sha256.Sum256([]byte("sim cluster CA"))),
	}
}

// SetAdminKubeconfig makes later KubeadmInit results carry kc as the
// cluster's admin kubeconfig, so that the executor drains nodes (through
// a drainer of the test's that need not use it) instead of skipping the
// drain.
func (k *Kubeadm) SetAdminKubeconfig(kc string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.kubeconfig = kc
}

func (k *Kubeadm) adminKubeconfig() string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.kubeconfig
}

// AgentDialer is an AgentDialer whose clients are the fleet's simulated
// agents with the kubeadm calls of k added.
func (k *Kubeadm) AgentDialer() provision.AgentDialer {
	return func(_ context.Context, h *typesv1.Host) (agentv1.AgentClient, error) {
		host := k.fleet.Host(h.GetMetadata().GetName())
		return &kubeadmAgent{Agent: host.agent, k: k, host: host}, nil
	}
}

// Calls returns the calls made so far, in order.
func (k *Kubeadm) Calls() []Call {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]Call(nil), k.calls...)
}

// FailPreflight makes the preflight of host report the failed check c
// (nil: pass again).
func (k *Kubeadm) FailPreflight(host string, c *agentv1.Check) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if c == nil {
		delete(k.preflight, host)
		return
	}
	k.preflight[host] = c
}

// NodeNotReady makes the node of host report NodeReady False (a kubelet
// that stopped posting status) while v is true.
func (k *Kubeadm) NodeNotReady(host string, v bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.notReady[host] = v
}

// Node returns the role of the node host runs ("" when it has not joined
// or was reset).
func (k *Kubeadm) Node(host string) string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.nodes[host]
}

// kubeadmAgent is the simulated agent of one host with the kubeadm calls.
type kubeadmAgent struct {
	*Agent
	k    *Kubeadm
	host *Host
}

func (a *kubeadmAgent) installed(method string) error {
	switch a.host.Running() {
	case "":
		return a.unavailable()
	case "boot":
		return errgrpc.ToGRPC(errdefs.FailedPrecondition("%s needs the installed agent; the boot agent runs", method))
	}
	return nil
}

func (a *kubeadmAgent) log(method, id string, attached bool) {
	a.k.calls = append(a.k.calls, Call{Host: a.host.name, Method: method, OperationID: id, Attached: attached})
}

// start journals an operation, or returns the one of the same id.
func (a *kubeadmAgent) start(ctx context.Context, method, id string, d time.Duration, run func() *agentv1.OperationEvent) (grpc.ServerStreamingClient[agentv1.OperationEvent], error) {
	if err := a.installed(method); err != nil {
		return nil, err
	}
	if id == "" {
		return nil, errgrpc.ToGRPC(errdefs.InvalidArgument("%s: operation id is required", method))
	}
	k := a.k
	k.mu.Lock()
	defer k.mu.Unlock()
	key := a.host.name + "/" + id
	if op, ok := k.journal[key]; ok {
		a.log(method, id, true)
		return &opStream{ctx: ctx, op: op}, nil
	}
	a.log(method, id, false)
	op := &kubeadmOp{id: id, kind: method, done: make(chan struct{})}
	k.journal[key] = op
	go func() {
		_ = k.fleet.sleep(k.fleet.ctx, d)
		ev := run()
		ev.OperationId, ev.Kind = id, method
		events := []*agentv1.OperationEvent{ev}
		if ev.GetResult() != nil {
			// As the agent does: the result in its own event, then the
			// terminal state.
			events = []*agentv1.OperationEvent{
				{OperationId: id, Kind: method, State: agentv1.OperationState_OPERATION_STATE_RUNNING, Message: "done", Result: ev.Result},
				{OperationId: id, Kind: method, State: ev.GetState()},
			}
		}
		k.mu.Lock()
		op.events = events
		k.mu.Unlock()
		close(op.done)
	}()
	return &opStream{ctx: ctx, op: op}, nil
}

func succeeded() *agentv1.OperationEvent {
	return &agentv1.OperationEvent{State: agentv1.OperationState_OPERATION_STATE_SUCCEEDED}
}

// Prepare reports the OS as prepared.
func (a *kubeadmAgent) Prepare(ctx context.Context, in *agentv1.PrepareRequest, _ ...grpc.CallOption) (grpc.ServerStreamingClient[agentv1.OperationEvent], error) {
	return a.start(ctx, "Prepare", in.GetOperationId(), 0, func() *agentv1.OperationEvent {
		ev := succeeded()
		ev.Result = &agentv1.OperationEvent_Prepare{Prepare: &agentv1.PrepareResult{Changed: true}}
		return ev
	})
}

// Preflight passes unless FailPreflight set a failed check for the host.
func (a *kubeadmAgent) Preflight(_ context.Context, in *agentv1.PreflightRequest, _ ...grpc.CallOption) (*agentv1.PreflightReport, error) {
	if err := a.installed("Preflight"); err != nil {
		return nil, err
	}
	k := a.k
	k.mu.Lock()
	defer k.mu.Unlock()
	a.log("Preflight", "", false)
	checks := []*agentv1.Check{{Name: "br_netfilter", Passed: true, Severity: agentv1.Severity_SEVERITY_ERROR}}
	if c := k.preflight[a.host.name]; c != nil {
		checks = append(checks, c)
		if c.GetSeverity() == agentv1.Severity_SEVERITY_ERROR && !c.GetPassed() {
			return &agentv1.PreflightReport{Checks: checks, Passed: false}, nil
		}
	}
	return &agentv1.PreflightReport{Checks: checks, Passed: true}, nil
}

// KubeadmInit makes the host the first control-plane node; the result
// carries the cluster's CA hash and (made-up) join credentials, and no
// admin kubeconfig.
func (a *kubeadmAgent) KubeadmInit(ctx context.Context, in *agentv1.KubeadmInitRequest, _ ...grpc.CallOption) (grpc.ServerStreamingClient[agentv1.OperationEvent], error) {
	host := a.host.name
	return a.start(ctx, "KubeadmInit", in.GetOperationId(), a.k.duration, func() *agentv1.OperationEvent {
		a.k.mu.Lock()
		a.k.nodes[host] = "control-plane"
		a.k.mu.Unlock()
		ev := succeeded()
		ev.Result = &agentv1.OperationEvent_KubeadmInit{KubeadmInit: &agentv1.KubeadmInitResult{
			CaHash:         a.k.caHash,
			JoinToken:      "abcdef.0123456789abcdef",
			CertificateKey: fmt.Sprintf("%x", sha256.Sum256([]byte("certificate key "+host))),
			// No kubeconfig by default: a simulated cluster has no API
			// server to drain nodes through (the executor skips the drain
			// and says so). SetAdminKubeconfig gives one, for tests whose
			// own drainer uses it.
			Kubeconfig:        a.k.adminKubeconfig(),
			ApiServerEndpoint: in.GetCluster().GetControlPlaneEndpoint(),
		}}
		return ev
	})
}

// KubeadmJoin joins the host; it fails unless the token and CA hash are
// those KubeadmInit returned (and the certificate key for a control
// plane).
func (a *kubeadmAgent) KubeadmJoin(ctx context.Context, in *agentv1.KubeadmJoinRequest, _ ...grpc.CallOption) (grpc.ServerStreamingClient[agentv1.OperationEvent], error) {
	host := a.host.name
	return a.start(ctx, "KubeadmJoin", in.GetOperationId(), a.k.duration, func() *agentv1.OperationEvent {
		switch {
		case in.GetCaHash() != a.k.caHash:
			return &agentv1.OperationEvent{State: agentv1.OperationState_OPERATION_STATE_FAILED, Error: "discovery: CA hash mismatch"}
		case in.GetToken() == "":
			return &agentv1.OperationEvent{State: agentv1.OperationState_OPERATION_STATE_FAILED, Error: "discovery: no bootstrap token"}
		case in.GetControlPlane() && in.GetCertificateKey() == "":
			return &agentv1.OperationEvent{State: agentv1.OperationState_OPERATION_STATE_FAILED, Error: "control-plane join: no certificate key"}
		}
		role := "worker"
		if in.GetControlPlane() {
			role = "control-plane"
		}
		a.k.mu.Lock()
		a.k.nodes[host] = role
		a.k.mu.Unlock()
		return succeeded()
	})
}

// KubeadmReset makes the host leave the cluster.
func (a *kubeadmAgent) KubeadmReset(ctx context.Context, in *agentv1.KubeadmResetRequest, _ ...grpc.CallOption) (grpc.ServerStreamingClient[agentv1.OperationEvent], error) {
	host := a.host.name
	return a.start(ctx, "KubeadmReset", in.GetOperationId(), 0, func() *agentv1.OperationEvent {
		a.k.mu.Lock()
		delete(a.k.nodes, host)
		a.k.mu.Unlock()
		return succeeded()
	})
}

// Probe reports the node Ready, with cluster DNS resolving and (on a
// control plane) a healthy etcd member, once the host has joined.
func (a *kubeadmAgent) Probe(_ context.Context, _ *agentv1.ProbeRequest, _ ...grpc.CallOption) (*agentv1.ProbeResponse, error) {
	if err := a.installed("Probe"); err != nil {
		return nil, err
	}
	k := a.k
	k.mu.Lock()
	defer k.mu.Unlock()
	a.log("Probe", "", false)
	role := k.nodes[a.host.name]
	if role == "" {
		return &agentv1.ProbeResponse{Conditions: []*typesv1.Condition{
			conditions.New("NodeReady", conditions.False, "NotJoined", "the host has not joined a cluster"),
		}}, nil
	}
	ready := conditions.New("NodeReady", conditions.True, "KubeletReady", "")
	if k.notReady[a.host.name] {
		ready = conditions.New("NodeReady", conditions.False, "NodeStatusUnknown", "Kubelet stopped posting node status")
	}
	conds := []*typesv1.Condition{
		conditions.New("KubeletHealthy", conditions.True, "Healthy", ""),
		ready,
		conditions.New("ClusterDNSResolves", conditions.True, "Resolved", "kubernetes.default.svc.cluster.local resolved"),
	}
	if role == "control-plane" {
		conds = append(conds, conditions.New("EtcdMemberHealthy", conditions.True, "Healthy", ""))
	}
	return &agentv1.ProbeResponse{Conditions: conds, Healthy: true}, nil
}

// opStream delivers the final events of a journalled operation once it
// ends.
type opStream struct {
	grpc.ClientStream
	ctx  context.Context
	op   *kubeadmOp
	next int
}

func (s *opStream) Recv() (*agentv1.OperationEvent, error) {
	select {
	case <-s.op.done:
	case <-s.ctx.Done():
		return nil, errgrpc.ToGRPC(errdefs.Unavailable("operation %s: %v", s.op.id, s.ctx.Err()))
	}
	if s.next >= len(s.op.events) {
		return nil, io.EOF
	}
	s.next++
	return s.op.events[s.next-1], nil
}

func (s *opStream) Header() (metadata.MD, error) { return nil, nil }
func (s *opStream) Trailer() metadata.MD         { return nil }
func (s *opStream) CloseSend() error             { return nil }
func (s *opStream) Context() context.Context     { return s.ctx }
func (s *opStream) SendMsg(any) error            { return nil }
func (s *opStream) RecvMsg(any) error            { return nil }
