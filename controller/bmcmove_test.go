package controller_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/controllertest"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// TestMovingABMCNeedsItsPasswordAgain is the attack of issue 12, hole 3:
// an operator, who may not read BMC passwords, re-applies a host with its
// bmc.address (or username) pointing at a server of theirs and no
// password; the controller would keep the stored password and log in
// there with it. Changing the address, username or protocol of a BMC must
// require the password again.
func TestMovingABMCNeedsItsPasswordAgain(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t)
	rc := resourcesClient(t, env, "operator")
	_, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("move-01", "the-real-bmc-password")}})
	require.NoError(t, err)

	for _, tc := range []struct {
		name   string
		change func(r *controllerv1.Resource)
	}{
		{"address", func(r *controllerv1.Resource) { r.GetHost().Spec.Bmc.Address = "127.0.0.1:6623" }},
		{"username", func(r *controllerv1.Resource) { r.GetHost().Spec.Bmc.Username = "attacker" }},
		{"protocol", func(r *controllerv1.Resource) {
			r.GetHost().Spec.Bmc.Protocol = "redfish"
			r.GetHost().Spec.Bmc.Address = "redfish+http://127.0.0.1:6623"
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			moved := host("move-01", "")
			tc.change(moved)
			_, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{moved}})
			if code(err) != codes.InvalidArgument {
				t.Errorf("apply with a new bmc %s and no password = %v, want InvalidArgument", tc.name, err)
			} else {
				t.Logf("refused: %v", err)
			}
			got, err := rc.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "move-01"})
			require.NoError(t, err)
			want := host("move-01", "").GetHost().GetSpec().GetBmc()
			want.PasswordSet = true
			if !proto.Equal(got.GetHost().GetSpec().GetBmc(), want) {
				t.Errorf("stored bmc = %v, want it unchanged %v", got.GetHost().GetSpec().GetBmc(), want)
			}

			// With the password, the move is the operator's to make.
			withPW := host("move-01", "the-new-bmc-password")
			tc.change(withPW)
			_, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{withPW}})
			require.NoError(t, err, "apply with a new bmc %s and its password", tc.name)
			back := host("move-01", "the-real-bmc-password")
			_, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{back}})
			require.NoError(t, err)
		})
	}
}
