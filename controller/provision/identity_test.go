package provision

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/pki"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

type identityAgent struct {
	agentv1.AgentClient
	written []*agentv1.WriteIdentityRequest
}

func (a *identityAgent) WriteIdentity(_ context.Context, req *agentv1.WriteIdentityRequest, _ ...grpc.CallOption) (*agentv1.WriteIdentityResponse, error) {
	a.written = append(a.written, req)
	return &agentv1.WriteIdentityResponse{}, nil
}

// TestWriteIdentityRecordsTheInstalledAgentSerial: the certificate the
// controller writes for the installed agent becomes the host's latest, so
// the installed agent is accepted after the reboot, while the boot agent
// it replaces stays accepted until then, also when the step runs again.
func TestWriteIdentityRecordsTheInstalledAgentSerial(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	emb, err := store.StartEmbedded(ctx, store.EmbeddedConfig{DataDir: filepath.Join(t.TempDir(), "etcd")})
	require.NoError(t, err)
	defer emb.Close()
	cl, err := store.Dial(emb.Endpoints(), nil)
	require.NoError(t, err)
	defer cl.Close()
	st := store.New(cl)
	ca, err := pki.NewCA("test", time.Now())
	require.NoError(t, err)

	const name = "node-1"
	const bootSerial = "b007"
	_, err = st.Create(ctx, HostsKind, name, &typesv1.Host{
		Metadata: &typesv1.ObjectMeta{Name: name},
		Status:   &typesv1.HostStatus{Agent: &typesv1.AgentStatus{CertificateSerial: bootSerial}},
	})
	require.NoError(t, err)

	agent := &identityAgent{}
	e := New(Deps{
		Store:    st,
		Agents:   func(context.Context, *typesv1.Host) (agentv1.AgentClient, error) { return agent, nil },
		Identity: CAIdentity(ca, "https://127.0.0.1:7443", time.Hour, nil),
	}, Config{}, nil)
	serialOf := func(i int) string {
		c, err := pki.ParseCertificatePEM(agent.written[i].GetCertificatePem())
		require.NoError(t, err)
		return c.SerialNumber.Text(16)
	}
	check := func(serial string, want bool) {
		t.Helper()
		h := &typesv1.Host{}
		_, err := st.Get(ctx, HostsKind, name, h)
		require.NoError(t, err)
		if err := enrollment.CheckSerial(h, serial); (err == nil) != want {
			t.Errorf("CheckSerial(%s) = %v, want accepted %v (status.agent %v)", serial, err, want, h.GetStatus().GetAgent())
		}
	}

	act := hostlife.Action{Kind: hostlife.ActWriteIdentity, Target: "/dev/vda"}
	require.NoError(t, e.do(ctx, &typesv1.Host{Metadata: &typesv1.ObjectMeta{Name: name}}, act))
	check(serialOf(0), true)
	check(bootSerial, true)

	// The step runs again (a retry): the first installed certificate was
	// never used and is revoked; the boot agent's is still accepted.
	require.NoError(t, e.do(ctx, &typesv1.Host{Metadata: &typesv1.ObjectMeta{Name: name}}, act))
	check(serialOf(1), true)
	check(bootSerial, true)
	check(serialOf(0), false)
}
