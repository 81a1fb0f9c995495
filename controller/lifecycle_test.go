package controller_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/sweep"
	"github.com/kilnhq/kiln/internal/conditions"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// byohHost is examples/host-byoh.yaml: a host without a BMC.
func byohHost(name string) *controllerv1.Resource {
	return &controllerv1.Resource{Kind: &controllerv1.Resource_Host{Host: &typesv1.Host{
		ApiVersion: "kiln.dev/v1",
		Kind:       "Host",
		Metadata:   &typesv1.ObjectMeta{Name: name},
		Spec:       &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "none"}, Online: true},
	}}}
}

// waitHost polls host name until ok accepts it or 20s pass.
func waitHost(t *testing.T, rc controllerv1.ResourcesClient, name, what string, ok func(*typesv1.Host) bool) *typesv1.Host {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var h *typesv1.Host
	for {
		got, err := rc.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: name})
		if err == nil {
			h = got.GetHost()
			if ok(h) {
				return h
			}
		}
		if ctx.Err() != nil {
			t.Fatalf("host %s: %s: not within 20s (last error %v); status %v", name, what, err, h.GetStatus())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestAPIOnlyReplicaSaysNothingAdvancesHosts follows the README's BYOH
// steps against a controller run with --api-only, alone: the host stays
// Registering, and says why (LifecycleRunning=False naming the flag, and
// a Warning event). The same store under a controller that runs the
// lifecycle then advances the host to Available once its agent enrolls
// and sends a heartbeat, and the condition goes away.
func TestAPIOnlyReplicaSaysNothingAdvancesHosts(t *testing.T) {
	dir := t.TempDir()
	fast := func(c *controller.Config) {
		c.DataDir = dir
		c.ElectionTTL = time.Second
		c.ReconcileInterval = 100 * time.Millisecond
	}
	const name = "edge-01"
	require.True(t, t.Run("api-only", func(t *testing.T) {
		env := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) {
			fast(c)
			c.APIOnly = true
		}))
		rc := resourcesClient(t, env, "admin")
		_, err := rc.Apply(context.Background(), &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{byohHost(name)}})
		require.NoError(t, err)
		h := waitHost(t, rc, name, "LifecycleRunning=False", func(h *typesv1.Host) bool {
			return conditions.Get(h.GetStatus().GetConditions(), sweep.ConditionLifecycleRunning) != nil
		})
		c := conditions.Get(h.GetStatus().GetConditions(), sweep.ConditionLifecycleRunning)
		if c.GetStatus() != conditions.False || c.GetReason() != sweep.ReasonLifecycleDisabled || !strings.Contains(c.GetMessage(), "--api-only") {
			t.Errorf("condition %s = %s, %s, %q; want False, %s, a message naming --api-only",
				c.GetType(), c.GetStatus(), c.GetReason(), c.GetMessage(), sweep.ReasonLifecycleDisabled)
		}
		t.Logf("%s=%s %s: %s", c.GetType(), c.GetStatus(), c.GetReason(), c.GetMessage())
		if s := h.GetStatus().GetState(); s != typesv1.HostState_HOST_STATE_UNSPECIFIED && s != typesv1.HostState_HOST_STATE_REGISTERING {
			t.Errorf("host state under an API-only controller = %v, want it not advanced", s)
		}
		if env.Controller.IsLeader() {
			t.Errorf("API-only controller IsLeader() = true, want it out of the election")
		}
		evs, err := rc.ListEvents(context.Background(), &controllerv1.ListEventsRequest{ObjectKind: "hosts", ObjectName: name})
		require.NoError(t, err)
		var found bool
		for _, e := range evs.GetEvents() {
			found = found || (e.GetType() == "Warning" && e.GetReason() == sweep.ReasonLifecycleDisabled)
		}
		if !found {
			t.Errorf("events of host %s = %v, want a Warning %s", name, evs.GetEvents(), sweep.ReasonLifecycleDisabled)
		}
	}))
	require.True(t, t.Run("lifecycle", func(t *testing.T) {
		env := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) {
			fast(c)
			c.Lifecycle = true
		}))
		rc := resourcesClient(t, env, "admin")
		ag, err := enroll(context.Background(), t, env, env.Token(t, name, time.Hour), name)
		require.NoError(t, err)
		// kiln-agent run's first heartbeat.
		_, err = controllerv1.NewAgentsClient(env.DialCert(t, ag.certPEM, ag.keyPEM)).Heartbeat(context.Background(),
			&controllerv1.HeartbeatRequest{AgentAddress: "127.0.0.1:1", Facts: &typesv1.Facts{Hostname: name, AgentMode: "installed"}, Version: "test"})
		require.NoError(t, err)
		h := waitHost(t, rc, name, "Available without LifecycleRunning", func(h *typesv1.Host) bool {
			return h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_AVAILABLE &&
				conditions.Get(h.GetStatus().GetConditions(), sweep.ConditionLifecycleRunning) == nil
		})
		t.Logf("host %s: %v, conditions %v", name, h.GetStatus().GetState(), h.GetStatus().GetConditions())
	}))
}
