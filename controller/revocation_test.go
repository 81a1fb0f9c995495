package controller_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/internal/pki"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// TestSupersededAgentCertificateIsRefused is the attack of issue 12, hole
// 5: an agent certificate that was superseded (the host enrolled again) or
// that belongs to a host deleted and applied again keeps heartbeating and
// renewing. Only the host's current certificate (and, after a renewal, the
// one it replaced until the new one is used) may call the controller.
func TestSupersededAgentCertificateIsRefused(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t)
	const name = "revoke-01"
	heartbeat := func(a *agent) error {
		_, err := controllerv1.NewAgentsClient(env.DialCert(t, a.certPEM, a.keyPEM)).Heartbeat(ctx,
			&controllerv1.HeartbeatRequest{AgentAddress: "127.0.0.1:7444", Version: "test"})
		return err
	}
	renew := func(a *agent) (*agent, error) {
		keyPEM, csr, err := pki.NewKeyAndCSR(name)
		require.NoError(t, err)
		resp, err := controllerv1.NewAgentsClient(env.DialCert(t, a.certPEM, a.keyPEM)).Renew(ctx, &controllerv1.RenewRequest{CsrDer: csr})
		if err != nil {
			return nil, err
		}
		return &agent{host: name, certPEM: resp.GetCertificatePem(), keyPEM: keyPEM}, nil
	}
	refused := func(what string, err error) {
		t.Helper()
		if code(err) != codes.PermissionDenied {
			t.Errorf("%s = %v, want PermissionDenied", what, err)
		} else {
			t.Logf("%s refused: %v", what, err)
		}
	}

	first, err := enroll(ctx, t, env, env.Token(t, name, time.Hour), name)
	require.NoError(t, err)
	require.NoError(t, heartbeat(first), "heartbeat of the enrolled agent")

	// Renewal: the old certificate stays usable until the new one is used
	// (the agent's open connection keeps presenting it), then not.
	renewed, err := renew(first)
	require.NoError(t, err)
	require.NoError(t, heartbeat(first), "heartbeat with the certificate just renewed, before the new one is used")
	require.NoError(t, heartbeat(renewed), "heartbeat with the renewed certificate")
	refused("heartbeat with the certificate replaced by renewal, once the new one is in use", heartbeat(first))
	_, err = renew(first)
	refused("renew with the certificate replaced by renewal", err)

	// Re-enrollment revokes every earlier certificate at once.
	second, err := enroll(ctx, t, env, env.Token(t, name, time.Hour), name)
	require.NoError(t, err)
	refused("heartbeat with a certificate superseded by re-enrollment", heartbeat(renewed))
	_, err = renew(renewed)
	refused("renew with a certificate superseded by re-enrollment", err)
	require.NoError(t, heartbeat(second), "heartbeat of the re-enrolled agent")

	// Delete and apply the host again: its old certificate is not the new
	// host's.
	rc := resourcesClient(t, env, "admin")
	_, err = rc.Delete(ctx, &controllerv1.DeleteRequest{Kind: "hosts", Name: name})
	require.NoError(t, err)
	_, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host(name, "pw")}})
	require.NoError(t, err)
	refused("heartbeat of a deleted and re-applied host's old agent", heartbeat(second))
	_, err = renew(second)
	refused("renew of a deleted and re-applied host's old agent", err)
}
