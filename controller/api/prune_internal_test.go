package api

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnhq/kiln/controller/authz"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestApplyPruneNeedsDelete calls the Apply handler itself, past the
// method-level interceptor, as callers without the right to delete: the
// handler refuses a prune before it touches the domain (the server has
// none here: reaching it would panic), and a GitSource from anyone but an
// admin.
func TestApplyPruneNeedsDelete(t *testing.T) {
	s := &resourcesServer{} // no domain: nothing may be applied
	cluster := &controllerv1.Resource{Kind: &controllerv1.Resource_Cluster{Cluster: &typesv1.Cluster{Metadata: &typesv1.ObjectMeta{Name: "edge-1"}}}}
	source := &controllerv1.Resource{Kind: &controllerv1.Resource_GitSource{GitSource: &typesv1.GitSource{Metadata: &typesv1.ObjectMeta{Name: "fleet"}}}}
	tests := []struct {
		name string
		role string
		req  *controllerv1.ApplyRequest
		want string
	}{
		{"reader prunes", authz.RoleReader, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{cluster}, Prune: &controllerv1.ApplyPrune{Selector: map[string]string{"env": "edge"}}}, "apply --prune deletes objects"},
		{"agent prunes", authz.RoleAgent, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{cluster}, Prune: &controllerv1.ApplyPrune{Selector: map[string]string{"env": "edge"}}, DryRun: true}, "apply --prune deletes objects"},
		{"operator applies a GitSource", authz.RoleOperator, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{cluster, source}}, "only the admin role may"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := authz.WithCaller(context.Background(), authz.Caller{Role: tt.role, Name: "mallory"})
			_, err := s.Apply(ctx, tt.req)
			if status.Code(err) != codes.PermissionDenied || !strings.Contains(status.Convert(err).Message(), tt.want) {
				t.Fatalf("Apply as %s = %v, want PermissionDenied containing %q", tt.role, err, tt.want)
			}
		})
	}
	ctx := authz.WithCaller(context.Background(), authz.Caller{Role: authz.RoleOperator, Name: "mallory"})
	_, err := s.Delete(ctx, &controllerv1.DeleteRequest{Kind: "gitsource", Name: "fleet"})
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("Delete gitsource as an operator = %v, want PermissionDenied", err)
	}
}
