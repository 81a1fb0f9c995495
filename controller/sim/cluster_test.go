package sim_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/clusterexec"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestControllerSimulateCluster runs the controller daemon with
// --simulate 4 (four hosts, each bound to a worker Machine of
// MachineDeployment "sim") and applies Cluster "sim" with a control plane
// of one and the deployment at two replicas: the deployment gives up two
// hosts (wiped, Available again), the control plane takes one and runs
// kubeadm init, and the workers join only after it. Three Machines end
// Running on Provisioned hosts and the cluster's CA hash is in its status.
func TestControllerSimulateCluster(t *testing.T) {
	env := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) {
		c.Simulate = 4
		c.HeartbeatInterval = time.Second
		c.ReconcileInterval = 500 * time.Millisecond
	}))
	st := env.Controller.Store()
	ctx := context.Background()
	now := timestamppb.Now()
	meta := func(name string) *typesv1.ObjectMeta {
		return &typesv1.ObjectMeta{Name: name, Generation: 1, CreationTimestamp: now}
	}
	for _, r := range []struct {
		kind, name string
		m          proto.Message
	}{
		{"clusters", "sim", &typesv1.Cluster{Metadata: meta("sim"), Spec: &typesv1.ClusterSpec{
			KubernetesVersion: "v1.34.4", PodCidr: "10.244.0.0/16", ServiceCidr: "10.96.0.0/12", ControlPlaneEndpoint: "10.0.0.10:6443"}}},
		{"controlplanes", "cp", &typesv1.ControlPlane{Metadata: meta("cp"), Spec: &typesv1.ControlPlaneSpec{
			Cluster: "sim", Replicas: 1, Version: "v1.34.4", Image: sim.ImageName}}},
		{"machinedeployments", "sim", &typesv1.MachineDeployment{Metadata: meta("sim"), Spec: &typesv1.MachineDeploymentSpec{
			Cluster: "sim", Replicas: 2, Version: "v1.34.4", Image: sim.ImageName}}},
	} {
		_, err := st.Create(ctx, r.kind, r.name, r.m)
		require.NoError(t, err, "create %s/%s", r.kind, r.name)
	}

	deadline := time.Now().Add(4 * time.Minute)
	var ms []*typesv1.Machine
	for {
		items, _, err := st.List(ctx, "machines", func() proto.Message { return &typesv1.Machine{} }, store.ListOptions{})
		require.NoError(t, err)
		ms = ms[:0]
		running := 0
		for _, it := range items {
			m := it.Msg.(*typesv1.Machine)
			ms = append(ms, m)
			require.NotEqual(t, clusterexec.PhaseFailed, m.GetStatus().GetPhase(), "machine %s: %v", it.Name, m.GetStatus().GetConditions())
			if m.GetStatus().GetPhase() == clusterexec.PhaseRunning && conditions.IsTrue(m.GetStatus().GetConditions(), "NodeReady") {
				running++
			}
		}
		if running == 3 && len(ms) == 3 {
			break
		}
		if time.Now().After(deadline) {
			for _, m := range ms {
				t.Logf("machine %s on %s: %s %v", m.GetMetadata().GetName(), m.GetSpec().GetHost(), m.GetStatus().GetPhase(), m.GetStatus().GetConditions())
			}
			t.Fatalf("%d of 3 machines Running", running)
		}
		time.Sleep(250 * time.Millisecond)
	}

	var cpBoot time.Time
	for _, m := range ms {
		if m.GetSpec().GetRole() == "control-plane" {
			cpBoot = m.GetStatus().GetBootstrapTime().AsTime()
		}
	}
	require.False(t, cpBoot.IsZero(), "no bootstrapped control-plane machine")
	for _, m := range ms {
		h := &typesv1.Host{}
		_, err := st.Get(ctx, "hosts", m.GetSpec().GetHost(), h)
		require.NoError(t, err)
		require.Equal(t, typesv1.HostState_HOST_STATE_PROVISIONED, h.GetStatus().GetState(), "host %s", h.GetMetadata().GetName())
		if m.GetSpec().GetRole() == "worker" {
			require.True(t, m.GetStatus().GetBootstrapTime().AsTime().After(cpBoot),
				"worker %s bootstrapped at %s, before the control plane (%s)", m.GetMetadata().GetName(), m.GetStatus().GetBootstrapTime().AsTime(), cpBoot)
		}
	}
	c := &typesv1.Cluster{}
	_, err := st.Get(ctx, "clusters", "sim", c)
	require.NoError(t, err)
	require.NotEmpty(t, c.GetStatus().GetCaHash(), "cluster caHash")
}
