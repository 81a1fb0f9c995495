// Package authz decides which caller may call which controller RPC. The
// caller is the role and name in its verified client certificate; a
// caller without a certificate may only enroll.
package authz

import (
	"context"
	"crypto/x509"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
)

// Roles of client certificates.
const (
	RoleReader     = "reader"
	RoleOperator   = "operator"
	RoleAdmin      = "admin"
	RoleAgent      = "agent"
	RoleController = "controller"
	// RoleAnonymous is a caller that presented no certificate.
	RoleAnonymous = ""
)

// Caller is who made a call.
type Caller struct {
	// Role is one of the Role* constants.
	Role string
	// Name is the certificate's name: the host of an agent, the operator's
	// name, the controller's ID.
	Name string
	// Serial is the certificate's serial number, hex; empty when anonymous.
	Serial string
}

// IdentityFunc extracts role and name from a verified certificate
// (pki.Identity in production).
type IdentityFunc func(cert *x509.Certificate) (role, name string, err error)

const (
	resources  = "/kiln.controller.v1.Resources/"
	enrollment = "/kiln.controller.v1.Enrollment/"
	agents     = "/kiln.controller.v1.Agents/"
	// maintenance is the admin's service (backups): admin only.
	maintenance = "/kiln.controller.v1.Maintenance/"
)

// readOnly are the Resources methods a reader may call.
var readOnly = map[string]bool{"Get": true, "List": true, "Watch": true, "ListEvents": true, "ListControllers": true}

// adminOnly are the Resources methods only an admin may call: they hand
// out credentials (a cluster's admin kubeconfig).
var adminOnly = map[string]bool{"GetKubeconfig": true}

// auditRead are the Resources methods that read the audit log: admins may
// call them, and the roles and identities an Authorizer grants it to
// (GrantAuditRead); reading it is not part of the reader role.
var auditRead = map[string]bool{"ListAudit": true}

// Allowed reports whether role may call fullMethod
// ("/kiln.controller.v1.Resources/Apply"). Unknown methods are refused.
func Allowed(role, fullMethod string) bool {
	switch {
	case strings.HasPrefix(fullMethod, enrollment):
		return true
	case strings.HasPrefix(fullMethod, resources):
		m := strings.TrimPrefix(fullMethod, resources)
		switch role {
		case RoleAdmin:
			return true
		case RoleOperator:
			return !adminOnly[m] && !auditRead[m]
		case RoleReader:
			return readOnly[m]
		}
		return false
	case strings.HasPrefix(fullMethod, agents):
		return role == RoleAgent
	case strings.HasPrefix(fullMethod, maintenance):
		return role == RoleAdmin
	}
	return false
}

// Needed names the roles that may call fullMethod, for error messages:
// "the admin role", "the operator or admin role"; "" for unknown methods
// and for Enrollment, which anyone may call.
func Needed(fullMethod string) string {
	switch {
	case strings.HasPrefix(fullMethod, resources):
		m := strings.TrimPrefix(fullMethod, resources)
		switch {
		case adminOnly[m]:
			return "the admin role"
		case auditRead[m]:
			return "the admin role or an audit-log grant (kiln-controller run --audit-readers ROLE or ROLE:NAME)"
		case readOnly[m]:
			return "the reader, operator or admin role"
		}
		return "the operator or admin role"
	case strings.HasPrefix(fullMethod, agents):
		return "an agent certificate"
	case strings.HasPrefix(fullMethod, maintenance):
		return "the admin role"
	}
	return ""
}

type callerKey struct{}

// WithCaller returns ctx carrying c.
func WithCaller(ctx context.Context, c Caller) context.Context {
	return context.WithValue(ctx, callerKey{}, c)
}

// CallerFrom returns the caller stored by the interceptors; an anonymous
// caller when none is.
func CallerFrom(ctx context.Context) Caller {
	c, _ := ctx.Value(callerKey{}).(Caller)
	return c
}

// Authorizer holds the interceptors.
type Authorizer struct {
	identity IdentityFunc
	// auditGrants are "role" and "role:name" entries that may read the
	// audit log besides admins.
	auditGrants map[string]bool
}

// GrantAuditRead lets callers read the audit log besides admins: each
// grant is a role ("operator": every operator certificate) or a role and
// a certificate name ("reader:alice"). Call it before serving. It returns
// InvalidArgument for an unknown role or an empty name.
func (a *Authorizer) GrantAuditRead(grants ...string) error {
	for _, g := range grants {
		role, name, hasName := strings.Cut(g, ":")
		switch role {
		case RoleReader, RoleOperator, RoleAdmin:
		default:
			return errdefs.InvalidArgument("audit-log grant %q: role %q is not reader, operator or admin", g, role)
		}
		if hasName && name == "" {
			return errdefs.InvalidArgument("audit-log grant %q: empty name after the colon (want ROLE or ROLE:NAME)", g)
		}
		if a.auditGrants == nil {
			a.auditGrants = map[string]bool{}
		}
		a.auditGrants[g] = true
	}
	return nil
}

// allowed is Allowed with the Authorizer's grants.
func (a *Authorizer) allowed(c Caller, method string) bool {
	if Allowed(c.Role, method) {
		return true
	}
	m, ok := strings.CutPrefix(method, resources)
	if !ok || !auditRead[m] || c.Role == RoleAnonymous || c.Role == RoleAgent || c.Role == RoleController {
		return false
	}
	return a.auditGrants[c.Role] || a.auditGrants[c.Role+":"+c.Name]
}

// Identify returns the caller of ctx from its verified certificate, an
// anonymous caller when it has none or the certificate names no valid
// identity. It decides nothing; auditing uses it to name refused callers.
func (a *Authorizer) Identify(ctx context.Context) Caller {
	c, err := a.callerOf(ctx)
	if err != nil {
		return Caller{}
	}
	return c
}

// New returns an Authorizer that reads identities with id.
func New(id IdentityFunc) *Authorizer { return &Authorizer{identity: id} }

// callerOf reads the verified leaf certificate of the call's TLS peer.
func (a *Authorizer) callerOf(ctx context.Context) (Caller, error) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return Caller{}, nil
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(info.State.VerifiedChains) == 0 || len(info.State.VerifiedChains[0]) == 0 {
		return Caller{}, nil
	}
	leaf := info.State.VerifiedChains[0][0]
	role, name, err := a.identity(leaf)
	if err != nil {
		return Caller{}, errdefs.PermissionDenied("client certificate: %v", err)
	}
	return Caller{Role: role, Name: name, Serial: leaf.SerialNumber.Text(16)}, nil
}

func (a *Authorizer) authorize(ctx context.Context, method string) (context.Context, error) {
	c, err := a.callerOf(ctx)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	if !a.allowed(c, method) {
		who := "unauthenticated caller"
		if c.Role != RoleAnonymous {
			who = "role " + c.Role + " (" + c.Name + ")"
		}
		if need := Needed(method); need != "" {
			return nil, errgrpc.ToGRPC(errdefs.PermissionDenied("%s may not call %s: it needs %s", who, method, need))
		}
		return nil, errgrpc.ToGRPC(errdefs.PermissionDenied("%s may not call %s", who, method))
	}
	return WithCaller(ctx, c), nil
}

// Unary is the unary server interceptor.
func (a *Authorizer) Unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	ctx, err := a.authorize(ctx, info.FullMethod)
	if err != nil {
		return nil, err
	}
	return handler(ctx, req)
}

// Stream is the stream server interceptor.
func (a *Authorizer) Stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	ctx, err := a.authorize(ss.Context(), info.FullMethod)
	if err != nil {
		return err
	}
	return handler(srv, &wrappedStream{ServerStream: ss, ctx: ctx})
}

type wrappedStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (w *wrappedStream) Context() context.Context { return w.ctx }
