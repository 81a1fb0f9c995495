package cli

import (
	"context"
	"flag"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/controllertest"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

var updateGolden = flag.Bool("update", false, "rewrite testdata/*.golden with the actual output")

func cond(t, status, reason, severity, msg string, ago time.Duration) *typesv1.Condition {
	return &typesv1.Condition{Type: t, Status: status, Reason: reason, Severity: severity, Message: msg,
		LastTransitionTime: timestamppb.New(testNow.Add(-ago))}
}

// TestDescribeClusterTree stores a cluster mid-rollout directly in a real
// controller's store and checks the tree kilnctl builds from List calls:
// cluster → control plane and deployment → machines → hosts with their
// BMC and last agent operation, every condition with its reason; objects
// of other clusters left out.
func TestDescribeClusterTree(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	env := controllertest.Start(t)
	st := env.Store()
	ctx := context.Background()
	put := func(kind, name string, m proto.Message) {
		t.Helper()
		_, err := st.Create(ctx, kind, name, m)
		require.NoError(t, err)
	}
	meta := func(name string) *typesv1.ObjectMeta { return &typesv1.ObjectMeta{Name: name} }

	put("clusters", "prod", &typesv1.Cluster{Metadata: meta("prod"),
		Spec: &typesv1.ClusterSpec{KubernetesVersion: "v1.35.0", PodCidr: "10.244.0.0/16"}})
	put("clusters", "other", &typesv1.Cluster{Metadata: meta("other"), Spec: &typesv1.ClusterSpec{KubernetesVersion: "v1.34.4", PodCidr: "10.244.0.0/16"}})
	put("controlplanes", "prod-cp", &typesv1.ControlPlane{Metadata: meta("prod-cp"),
		Spec: &typesv1.ControlPlaneSpec{Cluster: "prod", Replicas: 3, Version: "v1.35.0", RolloutMaxSurge: 1},
		Status: &typesv1.ControlPlaneStatus{Replicas: 3, ReadyReplicas: 2, UpdatedReplicas: 1, EtcdMembers: 3, Conditions: []*typesv1.Condition{
			cond("Ready", "False", "QuorumAtRisk", "Warning", "rollout: version v1.34.4 -> v1.35.0: prod-cp-h1 cannot be removed without breaking etcd quorum", 3*time.Minute),
			cond("EtcdQuorum", "False", "QuorumAtRisk", "Warning", "removing etcd member h1 would leave 1 healthy of 2 members, below quorum 2; unhealthy: h2; healthy: h1, h3", 3*time.Minute),
		}}})
	put("machinedeployments", "prod-workers", &typesv1.MachineDeployment{Metadata: meta("prod-workers"),
		Spec: &typesv1.MachineDeploymentSpec{Cluster: "prod", Replicas: 1, Version: "v1.34.4"},
		Status: &typesv1.MachineDeploymentStatus{Replicas: 1, ReadyReplicas: 1, UpdatedReplicas: 1, Conditions: []*typesv1.Condition{
			cond("Available", "True", "AsExpected", "", "1 of 1 available (minimum 1)", time.Hour),
			cond("ControlPlaneReady", "False", "WaitingForControlPlane", "Warning", "control plane prod-cp is not Ready", 3*time.Minute),
		}}})
	put("healthchecks", "prod-nodes", &typesv1.HealthCheck{Metadata: meta("prod-nodes"),
		Spec: &typesv1.HealthCheckSpec{Cluster: "prod"},
		Status: &typesv1.HealthCheckStatus{ExpectedMachines: 4, CurrentHealthy: 3, Conditions: []*typesv1.Condition{
			cond("RemediationAllowed", "True", "AsExpected", "", "1 of 4 unhealthy (maxUnhealthy 40%)", 10*time.Minute),
		}}})
	machine := func(name, owner, host, version, member string, ready bool, conds ...*typesv1.Condition) {
		s := &typesv1.MachineStatus{NodeName: host, EtcdMember: member}
		r := cond("NodeReady", "True", "KubeletReady", "", "", 50*time.Minute)
		if !ready {
			r = cond("NodeReady", "False", "KubeletNotReady", "Warning", "container runtime network not ready", 4*time.Minute)
		}
		s.Conditions = append([]*typesv1.Condition{r}, conds...)
		put("machines", name, &typesv1.Machine{Metadata: meta(name),
			Spec: &typesv1.MachineSpec{Cluster: "prod", Host: host, Version: version, Owner: owner}, Status: s})
	}
	machine("prod-cp-h1", "ControlPlane/prod-cp", "h1", "v1.34.4", "h1", true, cond("EtcdMemberHealthy", "True", "MemberHealthy", "", "", time.Hour))
	machine("prod-cp-h2", "ControlPlane/prod-cp", "h2", "v1.34.4", "h2", false, cond("EtcdMemberHealthy", "False", "MemberUnreachable", "Error", "no answer from https://10.0.0.2:2379 for 4m", 4*time.Minute))
	machine("prod-cp-h4", "ControlPlane/prod-cp", "h4", "v1.35.0", "h4", true, cond("EtcdMemberHealthy", "True", "MemberHealthy", "", "", 20*time.Minute))
	machine("prod-workers-w1", "MachineDeployment/prod-workers", "w1", "v1.34.4", "", true)
	put("machines", "other-cp-x1", &typesv1.Machine{Metadata: meta("other-cp-x1"), Spec: &typesv1.MachineSpec{Cluster: "other", Host: "x1", Owner: "ControlPlane/other-cp"}})

	host := func(name, proto, addr string, st typesv1.HostState, op *typesv1.OperationStatus, conds ...*typesv1.Condition) {
		put("hosts", name, &typesv1.Host{Metadata: meta(name),
			Spec: &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: proto, Address: addr, Password: "s3cret"}},
			Status: &typesv1.HostStatus{State: st, Power: "on", LastOperation: op, Conditions: conds,
				Agent: &typesv1.AgentStatus{LastHeartbeat: timestamppb.New(testNow.Add(-20 * time.Second))}}})
	}
	done := func(kind string, ago time.Duration) *typesv1.OperationStatus {
		return &typesv1.OperationStatus{Id: "op-" + kind, Kind: kind, State: "Succeeded", Percent: 100, Started: timestamppb.New(testNow.Add(-ago))}
	}
	host("h1", "redfish", "https://10.0.0.11", typesv1.HostState_HOST_STATE_PROVISIONED, done("KubeadmJoin", 2*time.Hour))
	host("h2", "ipmi", "10.0.0.12:623", typesv1.HostState_HOST_STATE_PROVISIONED, done("KubeadmJoin", 2*time.Hour),
		cond("AgentReachable", "False", "HeartbeatMissed", "Warning", "no heartbeat for 4m", 4*time.Minute))
	host("h4", "redfish", "https://10.0.0.14", typesv1.HostState_HOST_STATE_PROVISIONED,
		&typesv1.OperationStatus{Id: "op-lay", Kind: "LayImage", State: "Succeeded", Percent: 100, Message: "2.1 GiB at 412 MiB/s", Started: timestamppb.New(testNow.Add(-25 * time.Minute))})
	host("w1", "none", "", typesv1.HostState_HOST_STATE_PROVISIONED, nil)

	out := mustKilnctl(t, env.ConfigFor(t, "reader", "alice"), "describe", "cluster", "prod")
	golden := filepath.Join("testdata", "describe-cluster.golden")
	if *updateGolden {
		require.NoError(t, os.MkdirAll("testdata", 0o755))
		require.NoError(t, os.WriteFile(golden, []byte(out), 0o644))
	}
	want, err := os.ReadFile(golden)
	require.NoError(t, err)
	if out != string(want) {
		t.Errorf("kilnctl describe cluster prod =\n%s\nwant (%s)\n%s", out, golden, want)
	}
	for _, leak := range []string{"s3cret", "other-cp-x1"} {
		require.NotContains(t, out, leak)
	}

	_, err = kilnctl(t, env.AdminConfigPath, "describe", "cluster", "nope")
	require.Error(t, err)
	require.Contains(t, err.Error(), "nope")
}
