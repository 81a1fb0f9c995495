package controller_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// TestPauseForMove is the source side of kilnctl move on a real controller
// (embedded etcd): only an admin may pause, resume or read the pause; once
// paused, every mutating call (an admin's and an operator's Apply and
// Delete, a token, an agent's heartbeat) is refused with
// FailedPrecondition saying where the controller moved, reads still
// answer, the reconcilers stop, and a restarted controller is still
// paused; a backup taken while paused works; after Resume writes work
// again.
func TestPauseForMove(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := t.TempDir()
	env := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) { c.DataDir = dir }))
	admin := resourcesClient(t, env, "admin")
	_, err := admin.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("rack1-01", "pause-pw")}})
	require.NoError(t, err)
	ag, err := enroll(ctx, t, env, env.Token(t, "agent-a", time.Hour), "agent-a")
	require.NoError(t, err)
	beat := func(env *controllertest.Env) (*controllerv1.HeartbeatResponse, error) {
		return controllerv1.NewAgentsClient(env.DialCert(t, ag.certPEM, ag.keyPEM)).Heartbeat(ctx, &controllerv1.HeartbeatRequest{AgentAddress: "127.0.0.1:7444", Version: "test"})
	}
	heartbeat := func(env *controllertest.Env) error {
		_, err := beat(env)
		return err
	}
	require.NoError(t, heartbeat(env))

	// Only an admin: the attacker with an operator or reader certificate
	// can neither pause (stop the fleet) nor resume nor read the pause.
	for _, role := range []string{"reader", "operator"} {
		mc := controllerv1.NewMaintenanceClient(env.Dial(t, env.ConfigFor(t, role, "mv-"+role)))
		_, err := mc.Pause(ctx, &controllerv1.PauseRequest{MovedTo: "evil:7443"})
		require.Equal(t, codes.PermissionDenied, code(err), "%s's Pause: %v", role, err)
		_, err = mc.Resume(ctx, &controllerv1.ResumeRequest{})
		require.Equal(t, codes.PermissionDenied, code(err), "%s's Resume: %v", role, err)
		_, err = mc.GetPause(ctx, &controllerv1.GetPauseRequest{})
		require.Equal(t, codes.PermissionDenied, code(err), "%s's GetPause: %v", role, err)
		t.Logf("%s: %v", role, err)
	}
	mc := controllerv1.NewMaintenanceClient(env.Dial(t, env.AdminConfigPath))
	st, err := mc.GetPause(ctx, &controllerv1.GetPauseRequest{})
	require.NoError(t, err)
	require.False(t, st.GetPaused(), "paused before any pause (or by the refused callers)")
	_, err = mc.Pause(ctx, &controllerv1.PauseRequest{})
	require.Equal(t, codes.InvalidArgument, code(err), "Pause without moved_to: %v", err)

	st, err = mc.Pause(ctx, &controllerv1.PauseRequest{MovedTo: "ctl-b.example:7443"})
	require.NoError(t, err)
	require.True(t, st.GetPaused())
	require.Equal(t, "admin", st.GetBy())
	_, err = mc.Pause(ctx, &controllerv1.PauseRequest{MovedTo: "elsewhere:7443"})
	require.Equal(t, codes.FailedPrecondition, code(err), "a second pause to another target: %v", err)

	refusedMoving := func(env *controllertest.Env, state string) {
		t.Helper()
		operator := resourcesClient(t, env, "operator")
		admin := resourcesClient(t, env, "admin")
		calls := map[string]error{}
		_, calls["admin Apply"] = admin.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("rack1-02", "other-pw")}})
		_, calls["operator Apply"] = operator.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("rack1-03", "other-pw")}})
		_, calls["operator Delete"] = operator.Delete(ctx, &controllerv1.DeleteRequest{Kind: "hosts", Name: "rack1-01"})
		_, calls["admin CreateToken"] = admin.CreateToken(ctx, &controllerv1.CreateTokenRequest{Host: "rack1-09", Ttl: "1h"})
		if state == "moved to" {
			// The move is done: an agent is told where its fleet went
			// (and follows it: cmd/kiln-agent TestFollowMove).
			resp, err := beat(env)
			require.NoError(t, err, "agent Heartbeat once moved")
			require.Equal(t, "ctl-b.example:7443", resp.GetMovedTo(), "agent Heartbeat once moved")
		} else {
			calls["agent Heartbeat"] = heartbeat(env)
		}
		for call, err := range calls {
			require.Equal(t, codes.FailedPrecondition, code(err), "%s while paused: %v", call, err)
			require.Contains(t, err.Error(), state+" ctl-b.example:7443", "%s while paused", call)
			require.NotContains(t, err.Error(), "other-pw", "%s: a secret in the error", call)
		}
		t.Logf("operator Apply while paused: %v", calls["operator Apply"])
		// Reads answer.
		got, err := operator.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "rack1-01"})
		require.NoError(t, err, "Get while paused")
		require.Equal(t, "rack1-01", got.GetHost().GetMetadata().GetName())
		list, err := operator.List(ctx, &controllerv1.ListRequest{Kind: "hosts"})
		require.NoError(t, err)
		require.Len(t, list.GetItems(), 2, "hosts while paused (rack1-01 and the enrolled agent-a)")
	}
	refusedMoving(env, "moving to")
	require.Eventually(t, func() bool {
		return strings.Contains(env.Logs(), "paused for a move: reconcilers wait until it is resumed")
	}, 30*time.Second, 50*time.Millisecond, "reconcilers stop on the pause")

	// A backup (the move's copy) works while paused.
	_, trailer, err := takeBackup(ctx, t, env, env.AdminConfigPath, "age1ql3z7hjy54pw3hyww5ayyfg7zqgvc7w3j2elw8zmrj2kg5sfn9aqmcac8p")
	require.NoError(t, err, "backup while paused")
	require.Positive(t, trailer.GetKeys())

	// The move is done: marked moved. A restart keeps the pause.
	st, err = mc.Pause(ctx, &controllerv1.PauseRequest{MovedTo: "ctl-b.example:7443", Moved: true})
	require.NoError(t, err)
	require.True(t, st.GetMoved())
	env.Stop()
	env = controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) { c.DataDir = dir }))
	mc = controllerv1.NewMaintenanceClient(env.Dial(t, env.AdminConfigPath))
	st, err = mc.GetPause(ctx, &controllerv1.GetPauseRequest{})
	require.NoError(t, err)
	require.True(t, st.GetPaused() && st.GetMoved(), "pause after a restart: %v", st)
	refusedMoving(env, "moved to")
	require.Eventually(t, func() bool {
		return strings.Contains(env.Logs(), "paused for a move: reconcilers wait until it is resumed")
	}, 30*time.Second, 50*time.Millisecond, "a restarted controller starts no reconciler while paused")

	// An abandoned move: resumed, everything works again.
	_, err = mc.Resume(ctx, &controllerv1.ResumeRequest{})
	require.NoError(t, err)
	_, err = resourcesClient(t, env, "operator").Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("rack1-02", "other-pw")}})
	require.NoError(t, err, "Apply after resume")
	require.NoError(t, heartbeat(env), "heartbeat after resume")

	// Pausing and resuming the whole controller is in the audit log (the
	// pauses were recorded while paused), with who did it.
	audit, err := resourcesClient(t, env, "admin").ListAudit(ctx, &controllerv1.ListAuditRequest{})
	require.NoError(t, err)
	verbs := map[string]int{}
	for _, e := range audit.GetEntries() {
		if e.GetKind() == "Controller" && e.GetUser() == "admin" && e.GetResult() == "ok" {
			verbs[e.GetVerb()]++
		}
	}
	require.Equal(t, map[string]int{"pause": 2, "resume": 1, "backup": 1}, verbs, "audit entries of the controller")
}
