package api

import (
	"context"
	"log/slog"
	"net"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/audit"
	"github.com/kilnhq/kiln/controller/authz"
	"github.com/kilnhq/kiln/controller/limits"
	"github.com/kilnhq/kiln/controller/resources"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// AuditLog is where audit entries are appended and read (store.Store).
type AuditLog interface {
	AppendAudit(ctx context.Context, rec store.AuditRecord) error
	ListAudit(ctx context.Context, since time.Time, newMsg func() proto.Message, fn func(proto.Message) bool) error
}

var _ AuditLog = (*store.Store)(nil)

// writes are the RPCs whose every call is audited, by verb. Every other
// RPC is audited only when it is refused (reads would drown the log;
// heartbeats are an agent's status reports, not changes anyone asked
// for).
var writes = map[string]string{
	"/kiln.controller.v1.Resources/Apply":         "apply",
	"/kiln.controller.v1.Resources/Delete":        "delete",
	"/kiln.controller.v1.Resources/CreateToken":   "create-token",
	"/kiln.controller.v1.Resources/GetKubeconfig": "get-kubeconfig",
	"/kiln.controller.v1.Enrollment/Enroll":       "enroll",
	"/kiln.controller.v1.Agents/Renew":            "renew",
}

// Auditor is the pair of interceptors that audit API calls. It must run
// outside the authorizer (before it in the chain) so that it sees refused
// calls.
type Auditor struct {
	log      AuditLog
	identify func(context.Context) authz.Caller
	clock    func() time.Time
	logger   *slog.Logger
	// refusals bounds the entries of refused calls per caller, so that a
	// caller hammering the API with calls it may not make cannot push
	// real entries out of the log through retention.
	refusals *limits.Limiter
}

// RefusalRecords is how many refused calls of one caller are recorded:
// bursts of 30, then one per 10 seconds (8,640 a day). Refusals beyond
// are counted in the controller's log, not recorded.
var RefusalRecords = limits.Rate{PerSecond: 0.1, Burst: 30}

// NewAuditor returns an Auditor appending to log; identify names callers
// (authz.Authorizer.Identify).
func NewAuditor(log AuditLog, identify func(context.Context) authz.Caller, clock func() time.Time, logger *slog.Logger) *Auditor {
	if clock == nil {
		clock = time.Now
	}
	return &Auditor{log: log, identify: identify, clock: clock, logger: logger.With("component", "audit"), refusals: limits.NewLimiter(RefusalRecords, clock)}
}

// verb names a method for the log: its write verb, else its RPC name in
// lower case with dashes ("ListAudit" is "list-audit").
func verb(fullMethod string) (string, bool) {
	if v, ok := writes[fullMethod]; ok {
		return v, true
	}
	m := fullMethod[strings.LastIndex(fullMethod, "/")+1:]
	var b strings.Builder
	for i, r := range m {
		if r >= 'A' && r <= 'Z' {
			if i > 0 {
				b.WriteByte('-')
			}
			r += 'a' - 'A'
		}
		b.WriteRune(r)
	}
	return b.String(), false
}

// refusal reports whether err refused the caller (its identity or role),
// as opposed to failing its request.
func refusal(err error) bool {
	switch status.Code(err) {
	case codes.PermissionDenied, codes.Unauthenticated:
		return true
	}
	return false
}

// Unary is the unary server interceptor.
func (a *Auditor) Unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	v, isWrite := verb(info.FullMethod)
	caller := a.identify(ctx)
	call := audit.NewCall(caller, v, a.clock)
	resp, err := handler(audit.WithCall(ctx, call), req)
	switch {
	case info.FullMethod == heartbeat:
		// Heartbeats are never recorded, refused ones neither: a
		// superseded agent is refused every interval, forever.
	case maintenanceWrites[info.FullMethod] && !refusal(err):
		// The pause of a move stops the whole controller: recorded
		// always, on the controller (AppendAudit is not paused).
		call.Note(call.Entry("Controller", ""))
		a.finish(ctx, call, req, resp, err)
	case isWrite && !refusal(err) && !dryRun(req):
		a.finish(ctx, call, req, resp, err)
	case refusal(err) && a.recordRefusal(ctx, caller, v):
		a.finish(ctx, call, req, resp, err)
	}
	return resp, err
}

// dryRun reports whether req is an apply that stores nothing.
func dryRun(req any) bool {
	r, ok := req.(*controllerv1.ApplyRequest)
	return ok && r.GetDryRun()
}

// heartbeat is the agents' heartbeat RPC.
const heartbeat = "/kiln.controller.v1.Agents/Heartbeat"

// recordRefusal reports whether a refused call of caller is recorded
// (RefusalRecords), logging the ones that are not.
func (a *Auditor) recordRefusal(ctx context.Context, caller authz.Caller, verb string) bool {
	key := caller.Role + ":" + caller.Name
	if caller.Role == authz.RoleAnonymous {
		key = "addr:"
		if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
			key += p.Addr.String()
			if h, _, err := net.SplitHostPort(p.Addr.String()); err == nil {
				key = "addr:" + h
			}
		}
	}
	if ok, _ := a.refusals.Allow(key); ok {
		return true
	}
	a.logger.Warn("refused call not recorded in the audit log: caller over its refusal records", "caller", key, "verb", verb, "rate", RefusalRecords.String())
	return false
}

// backupMethod is the Maintenance service's backup RPC: a stream, and a read,
// but of everything including the sealing key, so every call is audited.
// adoptMethod (a move's target) replaces the whole store: audited always.
const (
	backupMethod = "/kiln.controller.v1.Maintenance/Backup"
	adoptMethod  = "/kiln.controller.v1.Maintenance/Adopt"
)

// maintenanceWrites are the unary Maintenance calls that change the whole
// controller (kilnctl move): audited always.
var maintenanceWrites = map[string]bool{
	"/kiln.controller.v1.Maintenance/Pause":  true,
	"/kiln.controller.v1.Maintenance/Resume": true,
}

// Stream is the stream server interceptor: streams (watches) are reads,
// audited only when refused; backups are audited always.
func (a *Auditor) Stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	err := handler(srv, ss)
	if (info.FullMethod == backupMethod || info.FullMethod == adoptMethod) && !refusal(err) {
		v, _ := verb(info.FullMethod)
		call := audit.NewCall(a.identify(ss.Context()), v, a.clock)
		e := call.Entry("Controller", "")
		call.Note(e)
		a.finish(ss.Context(), call, nil, nil, err)
		return err
	}
	if refusal(err) {
		v, _ := verb(info.FullMethod)
		caller := a.identify(ss.Context())
		if a.recordRefusal(ss.Context(), caller, v) {
			a.finish(ss.Context(), audit.NewCall(caller, v, a.clock), nil, nil, err)
		}
	}
	return err
}

// finish appends the entries the domain did not store with its write: its
// noted entries, or one per object named in the request when it noted
// none (a refused call, a request refused before any object, a verb the
// domain does not audit itself).
func (a *Auditor) finish(ctx context.Context, call *audit.Call, req, resp any, err error) {
	entries := call.Pending()
	if !call.Noted() {
		entries = objects(call, req, resp)
	}
	refused := refusal(err)
	// The record outlives a caller that hung up.
	ctx = context.WithoutCancel(ctx)
	for _, e := range entries {
		if e.Result == "" {
			audit.SetResult(e, errgrpc.FromGRPC(err), refused)
		}
		if aerr := a.log.AppendAudit(ctx, audit.Record(e)); aerr != nil {
			a.logger.Error("audit record not stored", "verb", e.GetVerb(), "kind", e.GetKind(), "name", e.GetName(), "user", e.GetUser(), "err", aerr)
		}
	}
}

// objects makes the entries of a call from its request and response.
func objects(call *audit.Call, req, resp any) []*controllerv1.AuditEntry {
	switch r := req.(type) {
	case *controllerv1.ApplyRequest:
		var out []*controllerv1.AuditEntry
		for _, res := range r.GetResources() {
			kind, name := "", ""
			if k, obj, err := resources.Unwrap(res); err == nil {
				kind, name = k.Name, resources.Meta(obj).GetName()
			}
			out = append(out, call.Entry(kind, name))
		}
		if len(out) == 0 {
			out = append(out, call.Entry("", ""))
		}
		return out
	case *controllerv1.DeleteRequest:
		return []*controllerv1.AuditEntry{call.Entry(kindName(r.GetKind()), r.GetName())}
	case *controllerv1.GetRequest:
		return []*controllerv1.AuditEntry{call.Entry(kindName(r.GetKind()), r.GetName())}
	case *controllerv1.ListRequest:
		return []*controllerv1.AuditEntry{call.Entry(kindName(r.GetKind()), "")}
	case *controllerv1.CreateTokenRequest:
		// The token's ID, never its secret: "<id>.<secret>".
		tr, _ := resp.(*controllerv1.CreateTokenResponse)
		id, _, _ := strings.Cut(tr.GetToken(), ".")
		e := call.Entry("Token", id)
		if r.GetHost() != "" {
			e.Message = "bound to host " + r.GetHost()
		}
		return []*controllerv1.AuditEntry{e}
	case *controllerv1.GetKubeconfigRequest:
		return []*controllerv1.AuditEntry{call.Entry("Cluster", r.GetCluster())}
	case *controllerv1.ListAuditRequest:
		return []*controllerv1.AuditEntry{call.Entry("AuditLog", "")}
	case *controllerv1.EnrollRequest:
		host := r.GetHost()
		if er, _ := resp.(*controllerv1.EnrollResponse); er.GetHost() != "" {
			host = er.GetHost()
		}
		e := call.Entry("Host", host)
		// The enrolling agent has no certificate yet: it is known by its
		// token's ID (the part before the dot; the secret is never kept).
		if id, _, ok := strings.Cut(r.GetToken(), "."); ok && len(id) <= 64 {
			e.User = "token:" + id
		}
		return []*controllerv1.AuditEntry{e}
	case *controllerv1.RenewRequest, *controllerv1.HeartbeatRequest:
		// An agent acts on its own host, the name in its certificate.
		e := call.Entry("Host", "")
		e.Name = e.GetUser()
		return []*controllerv1.AuditEntry{e}
	}
	return []*controllerv1.AuditEntry{call.Entry("", "")}
}

// kindName is a kind's canonical name ("hosts" is "Host"), or what was
// given when it is unknown.
func kindName(kind string) string {
	if k, err := resources.LookupKind(kind); err == nil {
		return k.Name
	}
	return kind
}

// defaultAuditLimit is how many entries ListAudit returns unless asked.
const defaultAuditLimit = 1000

// maxAuditLimit bounds one ListAudit answer (the message size limit).
const maxAuditLimit = 10_000

func (s *resourcesServer) ListAudit(ctx context.Context, req *controllerv1.ListAuditRequest) (*controllerv1.ListAuditResponse, error) {
	if s.audit == nil {
		return nil, errgrpc.ToGRPC(errdefs.NotSupported("list audit: this controller keeps no audit log"))
	}
	limit := req.GetLimit()
	switch {
	case limit < 0:
		return nil, errgrpc.ToGRPC(errdefs.InvalidArgument("list audit: negative limit %d", limit))
	case limit == 0:
		limit = defaultAuditLimit
	case limit > maxAuditLimit:
		return nil, errgrpc.ToGRPC(errdefs.InvalidArgument("list audit: limit %d is over %d: narrow with --since, --user or --kind", limit, maxAuditLimit))
	}
	kind := req.GetKind()
	if kind != "" {
		kind = kindName(kind)
	}
	var since time.Time
	if req.GetSince() != nil {
		since = req.GetSince().AsTime()
	}
	// Keep the newest limit entries: a ring of the last ones seen.
	ring := make([]*controllerv1.AuditEntry, 0, min(limit, 1024))
	start := 0
	err := s.audit.ListAudit(ctx, since, func() proto.Message { return &controllerv1.AuditEntry{} }, func(m proto.Message) bool {
		e := m.(*controllerv1.AuditEntry)
		if (req.GetUser() != "" && e.GetUser() != req.GetUser()) || (kind != "" && !strings.EqualFold(e.GetKind(), kind)) {
			return true
		}
		if int64(len(ring)) < limit {
			ring = append(ring, e)
			return true
		}
		ring[start] = e
		start = (start + 1) % len(ring)
		return true
	})
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	out := append(ring[start:len(ring):len(ring)], ring[:start]...)
	return &controllerv1.ListAuditResponse{Entries: out}, nil
}
