package cli

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/kilnconfig"
	"github.com/kilnhq/kiln/internal/pki"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

const moveBMCPassword = "M0ve-BMC-Passw0rd"

const moveHostYAML = `apiVersion: kiln.dev/v1
kind: Host
metadata:
  name: rack1-01
  labels: {rack: r1}
spec:
  bootMac: "52:54:00:12:34:56"
  online: true
  bmc:
    protocol: ipmi
    address: 127.0.0.1:9001
    username: admin
    password: ` + moveBMCPassword + `
`

// TestMoveToFreshController moves a fleet between two real controllers
// (embedded etcd each) with kilnctl move: operators and readers cannot
// move (nothing is paused); a target that holds resources is refused
// before the source is paused; the move prints its steps, never a secret;
// afterwards the target has every resource (same uids), the BMC password
// and the source's CA: the source's admin kilnconfig and the agent's
// certificate work there, and it accepts writes; the source stays paused,
// says MOVED and where in kilnctl move --status and in the error of every
// write.
func TestMoveToFreshController(t *testing.T) {
	if testing.Short() {
		t.Skip("starts three controllers with embedded etcd")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	src := controllertest.Start(t)
	dst := controllertest.Start(t)
	hostFile := filepath.Join(t.TempDir(), "host.yaml")
	require.NoError(t, os.WriteFile(hostFile, []byte(moveHostYAML), 0o600))
	mustKilnctl(t, src.AdminConfigPath, "apply", "-f", hostFile)
	before := getHost(ctx, t, src, src.AdminConfigPath)
	agentKey, agentCert := enrollAgent(ctx, t, src, "agent-a")

	// Only an admin moves.
	for _, role := range []string{"reader", "operator"} {
		_, err := kilnctl(t, src.ConfigFor(t, role, "mv-"+role), "move", "--to-kilnconfig", dst.AdminConfigPath)
		require.True(t, errdefs.IsPermissionDenied(err), "%s's move: %v", role, err)
		_, err = kilnctl(t, src.ConfigFor(t, role, "mv-"+role), "move", "--resume")
		require.True(t, errdefs.IsPermissionDenied(err), "%s's resume: %v", role, err)
		t.Logf("%s: %v", role, err)
	}
	require.Equal(t, "not paused\n", mustKilnctl(t, src.AdminConfigPath, "move", "--status"))

	// A target with a fleet of its own is refused; nothing is paused.
	busy := controllertest.Start(t)
	mustKilnctl(t, busy.AdminConfigPath, "apply", "-f", hostFile)
	_, err := kilnctl(t, src.AdminConfigPath, "move", "--to-kilnconfig", busy.AdminConfigPath)
	require.True(t, errdefs.IsFailedPrecondition(err), "move to a controller with resources: %v", err)
	require.ErrorContains(t, err, "a move needs a fresh controller")
	t.Logf("busy target: %v", err)
	require.Equal(t, "not paused\n", mustKilnctl(t, src.AdminConfigPath, "move", "--status"))
	require.Equal(t, "not paused\n", mustKilnctl(t, busy.AdminConfigPath, "move", "--status"))

	out := mustKilnctl(t, src.AdminConfigPath, "move", "--to-kilnconfig", dst.AdminConfigPath)
	t.Logf("kilnctl move:\n%s", out)
	for _, want := range []string{"target " + dst.Addr + " is fresh", "source " + src.Addr + " paused", "copy of " + src.Addr,
		"adopted it", "verified", "hosts 2", "target " + dst.Addr + " resumed", "marked moved"} {
		require.Contains(t, out, want)
	}
	require.NotContains(t, out, moveBMCPassword)
	require.NotContains(t, out, "AGE-SECRET-KEY")

	// The target: the source's CA, resources, secrets; it takes writes.
	srcCfg, err := kilnconfig.Load(src.AdminConfigPath)
	require.NoError(t, err)
	srcCfg.Server = dst.Addr
	onTarget := filepath.Join(t.TempDir(), "source-admin-on-target.yaml")
	require.NoError(t, kilnconfig.Write(onTarget, srcCfg))
	after := getHost(ctx, t, dst, onTarget)
	require.Equal(t, before.GetMetadata().GetUid(), after.GetMetadata().GetUid(), "host uid on the target")
	require.Equal(t, before.GetMetadata().GetGeneration(), after.GetMetadata().GetGeneration())
	pw, err := dst.Store().GetSecret(ctx, "bmc/rack1-01")
	require.NoError(t, err)
	require.Equal(t, moveBMCPassword, string(pw), "BMC password on the target")
	// The agent trusts the source's CA only, and the target serves with it.
	asAgent := *dst
	asAgent.CAPEM = src.CAPEM
	_, err = controllerv1.NewAgentsClient(asAgent.DialCert(t, agentCert, agentKey)).Heartbeat(ctx, &controllerv1.HeartbeatRequest{AgentAddress: "127.0.0.1:7444", Version: "test"})
	require.NoError(t, err, "the agent's certificate on the target")
	require.Equal(t, "not paused\n", mustKilnctl(t, onTarget, "move", "--status"))
	// It takes writes (resumed).
	mustKilnctl(t, onTarget, "delete", "host", "agent-a")

	// The source: paused, moved, and says where.
	status := mustKilnctl(t, src.AdminConfigPath, "move", "--status")
	require.Contains(t, status, "MOVED to "+dst.Addr)
	other := filepath.Join(t.TempDir(), "other.yaml")
	require.NoError(t, os.WriteFile(other, []byte(strings.ReplaceAll(moveHostYAML, "rack1-01", "rack1-02")), 0o600))
	_, err = kilnctl(t, src.ConfigFor(t, "operator", "late-op"), "apply", "-f", other)
	require.True(t, errdefs.IsFailedPrecondition(err), "apply on the moved source: %v", err)
	require.ErrorContains(t, err, "moved to "+dst.Addr)
	require.NotContains(t, err.Error(), moveBMCPassword)
	t.Logf("apply on the source after the move: %v", err)
	// An agent's heartbeat to the moved source is answered with where the
	// fleet went (the agent follows: cmd/kiln-agent TestFollowMove), and
	// writes nothing.
	hb, err := controllerv1.NewAgentsClient(src.DialCert(t, agentCert, agentKey)).Heartbeat(ctx, &controllerv1.HeartbeatRequest{AgentAddress: "127.0.0.1:7444", Version: "test"})
	require.NoError(t, err, "an agent's heartbeat to the moved source")
	require.Equal(t, dst.Addr, hb.GetMovedTo(), "the moved source's heartbeat answer")
	// Only to the host's own certificate: an operator's is refused.
	_, err = controllerv1.NewAgentsClient(src.Dial(t, src.ConfigFor(t, "operator", "late-op"))).Heartbeat(ctx, &controllerv1.HeartbeatRequest{AgentAddress: "127.0.0.1:7444", Version: "test"})
	require.Error(t, err, "an operator certificate's heartbeat to the moved source")
	// A second move to the (no longer fresh) target is refused.
	_, err = kilnctl(t, src.AdminConfigPath, "move", "--to-kilnconfig", onTarget)
	require.Error(t, err, "move again to a target that runs the fleet")
}

func getHost(ctx context.Context, t *testing.T, env *controllertest.Env, config string) *typesv1.Host {
	t.Helper()
	r, err := controllerv1.NewResourcesClient(env.Dial(t, config)).Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "rack1-01"})
	require.NoError(t, err)
	return r.GetHost()
}

func enrollAgent(ctx context.Context, t *testing.T, env *controllertest.Env, name string) (keyPEM, certPEM []byte) {
	t.Helper()
	keyPEM, csr, err := pki.NewKeyAndCSR(name)
	require.NoError(t, err)
	resp, err := controllerv1.NewEnrollmentClient(env.DialAnonymous(t)).Enroll(ctx, &controllerv1.EnrollRequest{
		Token: env.Token(t, name, time.Hour), CsrDer: csr, Host: name,
		Facts: &typesv1.Facts{Hostname: name, AgentMode: "boot", BootSource: "pxe"},
	})
	require.NoError(t, err)
	return keyPEM, resp.GetCertificatePem()
}
