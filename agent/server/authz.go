package server

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/kilnhq/kiln/internal/pki"
)

// authorize lets only a verified client certificate with the controller
// role through. No certificate is Unauthenticated; any other role (agent,
// admin, operator, reader) is PermissionDenied: operators act on hosts
// through the controller, never directly.
func authorize(ctx context.Context, method string) error {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return status.Errorf(codes.Unauthenticated, "%s: no peer information", method)
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok {
		return status.Errorf(codes.Unauthenticated, "%s: the agent API is served over mTLS only", method)
	}
	if len(info.State.VerifiedChains) == 0 || len(info.State.VerifiedChains[0]) == 0 {
		return status.Errorf(codes.Unauthenticated, "%s: a client certificate issued by the controller CA is required", method)
	}
	role, name, err := pki.Identity(info.State.VerifiedChains[0][0])
	if err != nil {
		return status.Errorf(codes.PermissionDenied, "%s: client certificate: %v", method, err)
	}
	if role != pki.RoleController {
		return status.Errorf(codes.PermissionDenied, "%s: role %s (%s) may not call the agent; only the controller may", method, role, name)
	}
	return nil
}

// UnaryAuthz is the unary server interceptor enforcing authorize.
func UnaryAuthz(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if err := authorize(ctx, info.FullMethod); err != nil {
		return nil, err
	}
	return handler(ctx, req)
}

// StreamAuthz is the stream server interceptor enforcing authorize.
func StreamAuthz(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if err := authorize(ss.Context(), info.FullMethod); err != nil {
		return err
	}
	return handler(srv, ss)
}
