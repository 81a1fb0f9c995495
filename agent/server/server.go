// Package server is the agent's gRPC API (kiln.agent.v1.Agent): a thin
// adapter that validates requests, calls the host operations behind small
// interfaces, runs long operations through the operation journal and maps
// errors to gRPC codes. Only a client certificate with the controller role
// may call it (UnaryAuthz, StreamAuthz).
//
// An operation whose implementation is not wired into this build returns
// Unimplemented (errdefs.NotSupported) with the method's name, never a
// pretended success.
package server

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/agent/journal"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Emit reports progress of a long operation (journal.Emit).
type Emit = func(*agentv1.OperationEvent)

// Facter reports the host's facts.
type Facter interface {
	Facts(ctx context.Context) (*typesv1.Facts, error)
}

// FactsFunc adapts a function to Facter (host.Facts with a root bound).
type FactsFunc func(ctx context.Context) (*typesv1.Facts, error)

// Facts calls f.
func (f FactsFunc) Facts(ctx context.Context) (*typesv1.Facts, error) { return f(ctx) }

// Preparer makes the OS ready for Kubernetes.
type Preparer interface {
	Prepare(ctx context.Context, req *agentv1.PrepareRequest, emit Emit) (*agentv1.PrepareResult, error)
}

// Preflighter checks the host against a cluster.
type Preflighter interface {
	Preflight(ctx context.Context, req *agentv1.PreflightRequest) (*agentv1.PreflightReport, error)
}

// Kubeadm runs kubeadm init, join and reset.
type Kubeadm interface {
	Init(ctx context.Context, req *agentv1.KubeadmInitRequest, emit Emit) (*agentv1.KubeadmInitResult, error)
	Join(ctx context.Context, req *agentv1.KubeadmJoinRequest, emit Emit) error
	Reset(ctx context.Context, req *agentv1.KubeadmResetRequest, emit Emit) error
}

// Prober checks the node's health.
type Prober interface {
	Probe(ctx context.Context, req *agentv1.ProbeRequest) (*agentv1.ProbeResponse, error)
}

// ImageLayer streams a golden image onto a disk.
type ImageLayer interface {
	LayImage(ctx context.Context, req *agentv1.LayImageRequest, emit Emit) (*agentv1.LayImageResult, error)
}

// Wiper wipes a disk.
type Wiper interface {
	Wipe(ctx context.Context, req *agentv1.WipeRequest, emit Emit) error
}

// IdentityWriter writes the host's identity into a laid image.
type IdentityWriter interface {
	WriteIdentity(ctx context.Context, req *agentv1.WriteIdentityRequest) error
}

// DiskResolver resolves the disk a request names (its target, or its
// root device hints) to one device path (rootdisk.Resolver). A hint that
// selects no single block device is an errdefs.InvalidArgument error.
type DiskResolver interface {
	Resolve(ctx context.Context, target string, hints *typesv1.RootDeviceHints) (string, error)
}

// Rebooter reboots or powers off the host. Reboot must return before the
// host goes down, so that the controller receives the answer.
type Rebooter interface {
	Reboot(ctx context.Context, req *agentv1.RebootRequest) error
}

// LogSource serves the agent's recent log lines (logring.Ring).
type LogSource interface {
	Logs(ctx context.Context, tail int, follow bool, send func(*agentv1.LogLine) error) error
}

// Options are the implementations the service calls. Journal is required;
// any other field may be nil, and its methods then return Unimplemented.
type Options struct {
	Journal        *journal.Journal
	Facts          Facter
	Preparer       Preparer
	Preflighter    Preflighter
	Kubeadm        Kubeadm
	Prober         Prober
	ImageLayer     ImageLayer
	Wiper          Wiper
	IdentityWriter IdentityWriter
	// Disks resolves the disk of LayImage, Wipe and WriteIdentity before
	// they start; nil passes target through as a path.
	Disks    DiskResolver
	Rebooter Rebooter
	Logs     LogSource
	Log      *slog.Logger
}

// Service implements agentv1.AgentServer.
type Service struct {
	agentv1.UnimplementedAgentServer
	o   Options
	log *slog.Logger
}

var _ agentv1.AgentServer = (*Service)(nil)

// New returns the Agent service over o.
func New(o Options) *Service {
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Service{o: o, log: log.With("component", "agent-api")}
}

// NewGRPCServer returns a gRPC server with the Agent service registered,
// serving TLS with tlsConf (identity.ServerTLS) behind the authorization
// interceptors. A connection's write buffer is returned to a pool between
// writes rather than kept (the controller's connection is idle most of the
// time; docs/bench/agent.md).
func NewGRPCServer(tlsConf *tls.Config, svc *Service) *grpc.Server {
	s := grpc.NewServer(
		grpc.Creds(credentials.NewTLS(tlsConf)),
		grpc.SharedWriteBuffer(true),
		grpc.ChainUnaryInterceptor(UnaryAuthz),
		grpc.ChainStreamInterceptor(StreamAuthz),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
	)
	agentv1.RegisterAgentServer(s, svc)
	return s
}

// GracePeriod is how long Serve waits for calls to finish after ctx is
// done before it cuts the remaining streams (followers of long operations;
// the operations themselves are stopped by the journal's Close).
const GracePeriod = 5 * time.Second

// Serve serves s on lis until ctx is done, then stops: gracefully for
// GracePeriod, then forcibly. It blocks until s has stopped.
func Serve(ctx context.Context, s *grpc.Server, lis net.Listener) error {
	done := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
			t := time.AfterFunc(GracePeriod, s.Stop)
			s.GracefulStop()
			t.Stop()
		case <-done:
		}
	}()
	err := s.Serve(lis)
	close(done)
	if ctx.Err() != nil {
		return nil
	}
	return err
}

func notWired(method string) error {
	return errgrpc.ToGRPC(errdefs.NotSupported("%s is not available in this agent build", method))
}

// Facts reports the host's facts.
func (s *Service) Facts(ctx context.Context, _ *agentv1.FactsRequest) (*agentv1.FactsResponse, error) {
	if s.o.Facts == nil {
		return nil, notWired("Facts")
	}
	f, err := s.o.Facts.Facts(ctx)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &agentv1.FactsResponse{Facts: f}, nil
}

// Preflight checks the host against a cluster.
func (s *Service) Preflight(ctx context.Context, req *agentv1.PreflightRequest) (*agentv1.PreflightReport, error) {
	if s.o.Preflighter == nil {
		return nil, notWired("Preflight")
	}
	if req.GetCluster() == nil {
		return nil, errgrpc.ToGRPC(errdefs.InvalidArgument("preflight: cluster is required"))
	}
	rep, err := s.o.Preflighter.Preflight(ctx, req)
	return rep, errgrpc.ToGRPC(err)
}

// Probe checks the node's health.
func (s *Service) Probe(ctx context.Context, req *agentv1.ProbeRequest) (*agentv1.ProbeResponse, error) {
	if s.o.Prober == nil {
		return nil, notWired("Probe")
	}
	resp, err := s.o.Prober.Probe(ctx, req)
	return resp, errgrpc.ToGRPC(err)
}

// WriteIdentity writes the host's identity into a laid image.
func (s *Service) WriteIdentity(ctx context.Context, req *agentv1.WriteIdentityRequest) (*agentv1.WriteIdentityResponse, error) {
	if s.o.IdentityWriter == nil {
		return nil, notWired("WriteIdentity")
	}
	if (req.GetTarget() == "" && req.GetRootDeviceHints() == nil) || req.GetHostname() == "" {
		return nil, errgrpc.ToGRPC(errdefs.InvalidArgument("write identity: target (or root_device_hints) and hostname are required"))
	}
	target, err := s.resolve(ctx, "write identity", req.GetTarget(), req.GetRootDeviceHints())
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	req = proto.CloneOf(req)
	req.Target, req.RootDeviceHints = target, nil
	if err := s.o.IdentityWriter.WriteIdentity(ctx, req); err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &agentv1.WriteIdentityResponse{}, nil
}

// Reboot reboots or powers off the host.
func (s *Service) Reboot(ctx context.Context, req *agentv1.RebootRequest) (*agentv1.RebootResponse, error) {
	if s.o.Rebooter == nil {
		return nil, notWired("Reboot")
	}
	s.log.Warn("reboot requested", "power_off", req.GetPowerOff())
	if err := s.o.Rebooter.Reboot(ctx, req); err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &agentv1.RebootResponse{}, nil
}

// Prepare runs (or re-attaches to) a prepare operation.
func (s *Service) Prepare(req *agentv1.PrepareRequest, stream agentv1.Agent_PrepareServer) error {
	if s.o.Preparer == nil {
		return notWired("Prepare")
	}
	return s.operation(stream.Context(), "prepare", req.GetOperationId(), stream.Send, func(ctx context.Context, emit journal.Emit) error {
		res, err := s.o.Preparer.Prepare(ctx, req, emit)
		if err != nil {
			return err
		}
		emit(&agentv1.OperationEvent{Message: "prepared", Result: &agentv1.OperationEvent_Prepare{Prepare: res}})
		return nil
	})
}

// KubeadmInit runs (or re-attaches to) kubeadm init.
func (s *Service) KubeadmInit(req *agentv1.KubeadmInitRequest, stream agentv1.Agent_KubeadmInitServer) error {
	if s.o.Kubeadm == nil {
		return notWired("KubeadmInit")
	}
	if req.GetCluster().GetKubernetesVersion() == "" {
		return errgrpc.ToGRPC(errdefs.InvalidArgument("kubeadm init: cluster.kubernetes_version is required (never looked up)"))
	}
	return s.operation(stream.Context(), "kubeadm-init", req.GetOperationId(), stream.Send, func(ctx context.Context, emit journal.Emit) error {
		res, err := s.o.Kubeadm.Init(ctx, req, emit)
		if err != nil {
			return err
		}
		emit(&agentv1.OperationEvent{Message: "initialized", Result: &agentv1.OperationEvent_KubeadmInit{KubeadmInit: res}})
		return nil
	})
}

// KubeadmJoin runs (or re-attaches to) kubeadm join.
func (s *Service) KubeadmJoin(req *agentv1.KubeadmJoinRequest, stream agentv1.Agent_KubeadmJoinServer) error {
	if s.o.Kubeadm == nil {
		return notWired("KubeadmJoin")
	}
	var missing []string
	for _, f := range []struct{ name, v string }{
		{"api_server_endpoint", req.GetApiServerEndpoint()},
		{"token", req.GetToken()},
		{"ca_hash", req.GetCaHash()},
		{"cluster.kubernetes_version", req.GetCluster().GetKubernetesVersion()},
	} {
		if f.v == "" {
			missing = append(missing, f.name)
		}
	}
	if len(missing) > 0 {
		return errgrpc.ToGRPC(errdefs.InvalidArgument("kubeadm join: %s required", strings.Join(missing, ", ")))
	}
	return s.operation(stream.Context(), "kubeadm-join", req.GetOperationId(), stream.Send, func(ctx context.Context, emit journal.Emit) error {
		return s.o.Kubeadm.Join(ctx, req, emit)
	})
}

// KubeadmReset runs (or re-attaches to) kubeadm reset.
func (s *Service) KubeadmReset(req *agentv1.KubeadmResetRequest, stream agentv1.Agent_KubeadmResetServer) error {
	if s.o.Kubeadm == nil {
		return notWired("KubeadmReset")
	}
	return s.operation(stream.Context(), "kubeadm-reset", req.GetOperationId(), stream.Send, func(ctx context.Context, emit journal.Emit) error {
		return s.o.Kubeadm.Reset(ctx, req, emit)
	})
}

// LayImage runs (or re-attaches to) the laying of an image.
func (s *Service) LayImage(req *agentv1.LayImageRequest, stream agentv1.Agent_LayImageServer) error {
	if s.o.ImageLayer == nil {
		return notWired("LayImage")
	}
	// The image layer validates the rest (hashes, format, block map).
	if req.GetUrl() == "" || (req.GetTarget() == "" && req.GetRootDeviceHints() == nil) {
		return errgrpc.ToGRPC(errdefs.InvalidArgument("lay image: url and target (or root_device_hints) are required"))
	}
	// The disk is chosen before the operation starts, so that a hint that
	// selects none (or two) is refused with its class (InvalidArgument:
	// only a new hint helps) rather than failing as an operation.
	target, err := s.resolve(stream.Context(), "lay image", req.GetTarget(), req.GetRootDeviceHints())
	if err != nil {
		return errgrpc.ToGRPC(err)
	}
	req = proto.CloneOf(req)
	req.Target, req.RootDeviceHints = target, nil
	return s.operation(stream.Context(), "lay-image", req.GetOperationId(), stream.Send, func(ctx context.Context, emit journal.Emit) error {
		res, err := s.o.ImageLayer.LayImage(ctx, req, emit)
		if err != nil {
			return err
		}
		emit(&agentv1.OperationEvent{Message: "image laid and verified", Result: &agentv1.OperationEvent_LayImage{LayImage: res}})
		return nil
	})
}

// Wipe runs (or re-attaches to) the wiping of a disk.
func (s *Service) Wipe(req *agentv1.WipeRequest, stream agentv1.Agent_WipeServer) error {
	if s.o.Wiper == nil {
		return notWired("Wipe")
	}
	if req.GetTarget() == "" && req.GetRootDeviceHints() == nil {
		return errgrpc.ToGRPC(errdefs.InvalidArgument("wipe: target (or root_device_hints) is required"))
	}
	target, err := s.resolve(stream.Context(), "wipe", req.GetTarget(), req.GetRootDeviceHints())
	if err != nil {
		return errgrpc.ToGRPC(err)
	}
	req = proto.CloneOf(req)
	req.Target, req.RootDeviceHints = target, nil
	return s.operation(stream.Context(), "wipe", req.GetOperationId(), stream.Send, func(ctx context.Context, emit journal.Emit) error {
		return s.o.Wiper.Wipe(ctx, req, emit)
	})
}

// resolve returns the device path target and hints name, through
// Options.Disks when set.
func (s *Service) resolve(ctx context.Context, what, target string, hints *typesv1.RootDeviceHints) (string, error) {
	if s.o.Disks == nil {
		if target == "" {
			return "", errdefs.InvalidArgument("%s: root_device_hints need a disk resolver, which this agent lacks: send target", what)
		}
		return target, nil
	}
	path, err := s.o.Disks.Resolve(ctx, target, hints)
	if err != nil {
		return "", fmt.Errorf("%s: %w", what, err)
	}
	return path, nil
}

// Logs streams the agent's recent log lines, and with follow new ones.
func (s *Service) Logs(req *agentv1.LogsRequest, stream agentv1.Agent_LogsServer) error {
	if s.o.Logs == nil {
		return notWired("Logs")
	}
	return errgrpc.ToGRPC(s.o.Logs.Logs(stream.Context(), int(req.GetTail()), req.GetFollow(), stream.Send))
}

// Operation re-attaches to an operation by id.
func (s *Service) Operation(req *agentv1.OperationRequest, stream agentv1.Agent_OperationServer) error {
	if req.GetOperationId() == "" {
		return errgrpc.ToGRPC(errdefs.InvalidArgument("operation: operation_id is required"))
	}
	return errgrpc.ToGRPC(s.o.Journal.Follow(stream.Context(), req.GetOperationId(), stream.Send))
}

// operation starts fn in the journal as id (a fresh id when empty) and
// streams its events. A failed operation is a FAILED terminal event, not
// an RPC error; RPC errors are for calls that could not start or follow.
func (s *Service) operation(ctx context.Context, kind, id string, send journal.Send, fn journal.Func) error {
	if id == "" {
		id = journal.NewID()
	}
	return errgrpc.ToGRPC(s.o.Journal.Start(ctx, kind, id, fn, send))
}
