// Package api is the gRPC edge of the controller: thin adapters that check
// requests, call the domain services (resources, enrollment) and map their
// errors to gRPC status codes. Who may call what is decided before these
// handlers run, by package authz.
package api

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/authz"
	"github.com/kilnhq/kiln/controller/clusterexec"
	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/resources"
	"github.com/kilnhq/kiln/controller/shard"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// Register registers the three controller services on srv. Open watches
// end with Unavailable when life ends (the controller is shutting down),
// so that a graceful stop does not wait for them and clients reconnect,
// possibly to another replica. st is the store the sealed cluster
// credentials are read from (GetKubeconfig); al is the audit log ListAudit
// reads (nil: the controller keeps none).
//
// ctl returns the controller replicas and their shards (ListControllers;
// nil: Unimplemented).
func Register(life context.Context, srv *grpc.Server, res *resources.Service, enr *enrollment.Service, ev *events.Recorder, st clusterexec.Store, al AuditLog, ctl ControllersFunc) {
	controllerv1.RegisterResourcesServer(srv, &resourcesServer{life: life, res: res, enr: enr, events: ev, store: st, audit: al, controllers: ctl})
	controllerv1.RegisterEnrollmentServer(srv, &enrollmentServer{enr: enr})
	controllerv1.RegisterAgentsServer(srv, &agentsServer{enr: enr})
}

type resourcesServer struct {
	controllerv1.UnimplementedResourcesServer
	life   context.Context
	res    *resources.Service
	enr    *enrollment.Service
	events *events.Recorder
	store  clusterexec.Store
	audit  AuditLog
	// controllers answers ListControllers.
	controllers ControllersFunc
}

// ControllersFunc returns the controller replicas and their shards
// (shard.Observe). It returns Unavailable-class errors when etcd does not
// answer.
type ControllersFunc func(ctx context.Context) (shard.Overview, error)

// ListControllers returns the controller replicas, the leader, and the
// shards each holds with its hosts.
func (s *resourcesServer) ListControllers(ctx context.Context, _ *controllerv1.ListControllersRequest) (*controllerv1.ListControllersResponse, error) {
	if s.controllers == nil {
		return nil, errgrpc.ToGRPC(errdefs.NotSupported("list controllers: not served by this controller"))
	}
	ov, err := s.controllers(ctx)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	out := &controllerv1.ListControllersResponse{Shards: int32(ov.Shards), UnownedHosts: int64(ov.UnownedHosts), Hosts: int64(ov.Hosts)}
	for _, u := range ov.Unowned {
		out.UnownedShards = append(out.UnownedShards, int32(u))
	}
	for _, r := range ov.Replicas {
		c := &controllerv1.ControllerReplica{Id: r.ID, Leader: r.Leader, Registered: r.Registered, ShardMember: r.Member, Hosts: int64(r.Hosts)}
		for _, sh := range r.Shards {
			c.Shards = append(c.Shards, int32(sh))
		}
		out.Controllers = append(out.Controllers, c)
	}
	return out, nil
}

func (s *resourcesServer) Apply(ctx context.Context, req *controllerv1.ApplyRequest) (*controllerv1.ApplyResponse, error) {
	if len(req.GetResources()) == 0 {
		return nil, errgrpc.ToGRPC(errdefs.InvalidArgument("apply: no resources"))
	}
	if err := adminOnlyKinds(ctx, "apply", req.GetResources()...); err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	if p := req.GetPrune(); p != nil {
		results, err := s.applyPrune(ctx, req.GetResources(), p.GetSelector(), req.GetDryRun())
		if err != nil {
			return nil, errgrpc.ToGRPC(err)
		}
		return &controllerv1.ApplyResponse{Results: results}, nil
	}
	results, err := s.res.Apply(ctx, req.GetResources(), req.GetDryRun())
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &controllerv1.ApplyResponse{Results: results}, nil
}

// applyPrune applies resources and deletes what the selector matches and
// they do not name, in one transaction. Deleting is its own right: a
// caller who may apply but not delete is refused before anything is
// written.
func (s *resourcesServer) applyPrune(ctx context.Context, objs []*controllerv1.Resource, selector map[string]string, dryRun bool) ([]*controllerv1.ApplyResult, error) {
	caller := authz.CallerFrom(ctx)
	if !authz.Allowed(caller.Role, controllerv1.Resources_Delete_FullMethodName) {
		return nil, errdefs.PermissionDenied("apply --prune deletes objects: it needs %s, which may delete; nothing was applied", authz.Needed(controllerv1.Resources_Delete_FullMethodName))
	}
	prunes, err := s.res.PruneCandidates(ctx, selector, objs)
	if err != nil {
		return nil, err
	}
	return s.res.ApplyBatch(ctx, objs, prunes, dryRun)
}

// adminOnlyKinds refuses a non-admin caller's write of a GitSource: the
// controller applies a GitSource's repository with its own authority, so
// creating, changing or deleting one is an admin's decision (an operator
// could otherwise make the controller apply a repository of their choice,
// or stop one an admin set up). It returns PermissionDenied.
func adminOnlyKinds(ctx context.Context, verb string, objs ...*controllerv1.Resource) error {
	caller := authz.CallerFrom(ctx)
	if caller.Role == authz.RoleAdmin {
		return nil
	}
	for _, r := range objs {
		if g := r.GetGitSource(); g != nil {
			return errdefs.PermissionDenied("%s GitSource %q: only the admin role may (a GitSource applies its repository with the controller's authority); nothing was applied", verb, g.GetMetadata().GetName())
		}
	}
	return nil
}

func (s *resourcesServer) Get(ctx context.Context, req *controllerv1.GetRequest) (*controllerv1.Resource, error) {
	r, err := s.res.Get(ctx, req.GetKind(), req.GetName())
	if err == nil {
		s.lastSeen(r)
	}
	return r, errgrpc.ToGRPC(err)
}

// lastSeen puts into a Host this replica serves the time it last received
// a heartbeat from the host's agent, when that is newer than the stored
// one: a heartbeat that changes nothing is not written (controller/liveness),
// so the stored status.agent.lastHeartbeat can lag by up to the liveness
// refresh. Hosts whose agents report to another replica keep the stored
// time.
func (s *resourcesServer) lastSeen(r *controllerv1.Resource) {
	h := r.GetHost()
	a := h.GetStatus().GetAgent()
	if a == nil || s.enr == nil {
		return
	}
	seen, ok := s.enr.Tracker().LastSeen(h.GetMetadata().GetName())
	if ok && (a.GetLastHeartbeat() == nil || seen.After(a.GetLastHeartbeat().AsTime())) {
		a.LastHeartbeat = timestamppb.New(seen)
	}
}

func (s *resourcesServer) List(ctx context.Context, req *controllerv1.ListRequest) (*controllerv1.ListResponse, error) {
	items, next, err := s.res.List(ctx, req.GetKind(), req.GetLabelSelector(), req.GetLimit(), req.GetContinue())
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	for _, r := range items {
		s.lastSeen(r)
	}
	return &controllerv1.ListResponse{Items: items, Continue: next}, nil
}

func (s *resourcesServer) Delete(ctx context.Context, req *controllerv1.DeleteRequest) (*controllerv1.DeleteResponse, error) {
	if k, err := resources.LookupKind(req.GetKind()); err == nil && k.Plural == "gitsources" && authz.CallerFrom(ctx).Role != authz.RoleAdmin {
		return nil, errgrpc.ToGRPC(errdefs.PermissionDenied("delete GitSource %q: only the admin role may (a GitSource applies its repository with the controller's authority)", req.GetName()))
	}
	if err := s.res.Delete(ctx, req.GetKind(), req.GetName()); err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &controllerv1.DeleteResponse{}, nil
}

func (s *resourcesServer) Watch(req *controllerv1.WatchRequest, stream controllerv1.Resources_WatchServer) error {
	if _, err := resources.LookupKind(req.GetKind()); err != nil {
		return errgrpc.ToGRPC(err)
	}
	// Headers tell the client the watch is accepted before any change
	// arrives.
	if err := stream.SendHeader(metadata.MD{}); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	defer context.AfterFunc(s.life, cancel)()
	err := s.res.Watch(ctx, req.GetKind(), req.GetName(), stream.Send)
	if s.life.Err() != nil {
		return errgrpc.ToGRPC(errdefs.Unavailable("controller is shutting down: watch again"))
	}
	if err != nil && stream.Context().Err() != nil {
		return nil // the client went away
	}
	return errgrpc.ToGRPC(err)
}

func (s *resourcesServer) ListEvents(ctx context.Context, req *controllerv1.ListEventsRequest) (*controllerv1.ListEventsResponse, error) {
	kind := req.GetObjectKind()
	if kind != "" {
		k, err := resources.LookupKind(kind)
		if err != nil {
			return nil, errgrpc.ToGRPC(err)
		}
		kind = k.Plural
	} else if req.GetObjectName() != "" {
		return nil, errgrpc.ToGRPC(errdefs.InvalidArgument("list events: object_name needs object_kind"))
	}
	evs, err := s.events.List(ctx, kind, req.GetObjectName(), req.GetLimit())
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &controllerv1.ListEventsResponse{Events: evs}, nil
}

func (s *resourcesServer) CreateToken(ctx context.Context, req *controllerv1.CreateTokenRequest) (*controllerv1.CreateTokenResponse, error) {
	var ttl time.Duration
	if req.GetTtl() != "" {
		d, err := time.ParseDuration(req.GetTtl())
		if err != nil || d <= 0 {
			return nil, errgrpc.ToGRPC(errdefs.InvalidArgument("create token: ttl %q is not a positive Go duration such as 30m or 2h", req.GetTtl()))
		}
		ttl = d
	}
	tok, expires, err := s.enr.CreateToken(ctx, ttl, req.GetHost(), req.GetDescription())
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &controllerv1.CreateTokenResponse{
		Token:   tok.String(),
		Expires: timestamppb.New(expires),
		CaHash:  s.enr.CAHash(),
	}, nil
}

// GetKubeconfig returns the admin kubeconfig sealed in the cluster's
// bootstrap secret. authz lets only admins call it. Each call is recorded
// as an event on the cluster naming the caller; the kubeconfig itself is
// never logged, recorded or put in an error.
func (s *resourcesServer) GetKubeconfig(ctx context.Context, req *controllerv1.GetKubeconfigRequest) (*controllerv1.GetKubeconfigResponse, error) {
	name := req.GetCluster()
	if name == "" {
		return nil, errgrpc.ToGRPC(errdefs.InvalidArgument("get kubeconfig: no cluster named"))
	}
	if s.store == nil {
		return nil, errgrpc.ToGRPC(errdefs.NotSupported("get kubeconfig: this controller serves no cluster credentials"))
	}
	if _, err := s.res.Get(ctx, "Cluster", name); err != nil {
		if errdefs.IsNotFound(err) {
			return nil, errgrpc.ToGRPC(errdefs.NotFound("cluster %s not found", name))
		}
		return nil, errgrpc.ToGRPC(err)
	}
	b, err := clusterexec.LoadBootstrap(ctx, s.store, name)
	switch {
	case errdefs.IsNotFound(err) || (err == nil && b.Kubeconfig == ""):
		return nil, errgrpc.ToGRPC(errdefs.FailedPrecondition(
			"cluster %s has no kubeconfig yet: its first control plane has not finished kubeadm init; see kilnctl describe cluster %s", name, name))
	case errdefs.IsPermissionDenied(err):
		// The caller is allowed; the controller's key is not.
		return nil, errgrpc.ToGRPC(errdefs.FailedPrecondition(
			"cluster %s: its sealed credentials do not open under this controller's secret key (started with another --secret-key-file?)", name))
	case errdefs.IsUnavailable(err) || errors.Is(err, errdefs.ErrDeadlineExceeded) || ctx.Err() != nil:
		return nil, errgrpc.ToGRPC(err)
	case err != nil:
		// Whatever else went wrong, the error may quote the secret
		// (a decoding error): say only where to look.
		return nil, errgrpc.ToGRPC(fmt.Errorf("cluster %s: its sealed bootstrap credentials are unreadable", name))
	}
	c := authz.CallerFrom(ctx)
	if s.events != nil {
		s.events.Record(ctx, "clusters", name, events.Normal, "KubeconfigFetched",
			fmt.Sprintf("admin kubeconfig fetched by %s %q (certificate serial %s)", c.Role, c.Name, c.Serial))
	}
	return &controllerv1.GetKubeconfigResponse{Kubeconfig: []byte(b.Kubeconfig)}, nil
}

type enrollmentServer struct {
	controllerv1.UnimplementedEnrollmentServer
	enr *enrollment.Service
}

func (s *enrollmentServer) Enroll(ctx context.Context, req *controllerv1.EnrollRequest) (*controllerv1.EnrollResponse, error) {
	res, err := s.enr.Enroll(ctx, enrollment.EnrollRequest{
		Token:  req.GetToken(),
		CSRDER: req.GetCsrDer(),
		Host:   req.GetHost(),
		Facts:  req.GetFacts(),
	})
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &controllerv1.EnrollResponse{CertificatePem: res.CertPEM, CaPem: res.CAPEM, Host: res.Host}, nil
}

type agentsServer struct {
	controllerv1.UnimplementedAgentsServer
	enr *enrollment.Service
}

// agentHost is the caller's host and certificate serial, from its
// certificate only.
func agentHost(ctx context.Context) (string, string, error) {
	c := authz.CallerFrom(ctx)
	if c.Role != authz.RoleAgent || c.Name == "" || c.Serial == "" {
		return "", "", errdefs.PermissionDenied("only agent certificates may call the Agents service")
	}
	return c.Name, c.Serial, nil
}

func (s *agentsServer) Heartbeat(ctx context.Context, req *controllerv1.HeartbeatRequest) (*controllerv1.HeartbeatResponse, error) {
	host, serial, err := agentHost(ctx)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	res, err := s.enr.Heartbeat(ctx, host, serial, enrollment.HeartbeatRequest{
		AgentAddress: req.GetAgentAddress(),
		Facts:        req.GetFacts(),
		Version:      req.GetVersion(),
		FactsSHA256:  req.GetFactsSha256(),
	})
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &controllerv1.HeartbeatResponse{
		Host:             host,
		IntervalSeconds:  int32(res.Interval / time.Second),
		CaBundlePem:      s.enr.TrustPEM(),
		RenewCertificate: res.RenewCertificate,
		FactsWanted:      res.FactsWanted,
		MovedTo:          res.MovedTo,
	}, nil
}

func (s *agentsServer) Renew(ctx context.Context, req *controllerv1.RenewRequest) (*controllerv1.RenewResponse, error) {
	host, serial, err := agentHost(ctx)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	certPEM, err := s.enr.Renew(ctx, host, serial, req.GetCsrDer())
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &controllerv1.RenewResponse{CertificatePem: certPEM, CaBundlePem: s.enr.TrustPEM()}, nil
}
