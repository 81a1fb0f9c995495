package controller_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/topologyplan"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/manifest"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestTopology applies examples/clusterclass/edge-store.yaml (a class and two
// clusters) to a real controller and checks what a user would: the
// derived objects, the pin and TopologyReconciled; that an edit of a
// derived object is reverted with an event saying so; that a class change
// makes revision 2 and its Rollout but moves no cluster until its pin
// moves (here by hand, as the Rollout controller would), that a class
// change that would break a cluster is refused naming it, and that a
// deleted cluster's objects go with it.
func TestTopology(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t)
	rc := resourcesClient(t, env, "admin")
	docs, err := manifest.Load(nil, "../examples/clusterclass/edge-store.yaml")
	require.NoError(t, err)
	var objs []*controllerv1.Resource
	for _, d := range docs {
		objs = append(objs, d.Resource)
	}
	_, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: objs})
	require.NoError(t, err)

	get := func(kind, name string) *controllerv1.Resource {
		r, err := rc.Get(ctx, &controllerv1.GetRequest{Kind: kind, Name: name})
		if code(err) == codes.NotFound {
			return nil
		}
		require.NoError(t, err)
		return r
	}
	reconciled := func(cluster string, rev int64) func() bool {
		return func() bool {
			c := get("Cluster", cluster).GetCluster()
			cd := conditions.Get(c.GetStatus().GetConditions(), topologyplan.ConditionTopologyReconciled)
			return c.GetStatus().GetTopology().GetClassRevision() == rev && c.GetStatus().GetTopology().GetReconciledRevision() == rev &&
				cd.GetStatus() == "True" && cd.GetObservedGeneration() == c.GetMetadata().GetGeneration() &&
				topologyplan.Reconciled(c)
		}
	}
	require.Eventually(t, reconciled("store-0042", 1), 20*time.Second, 50*time.Millisecond)
	require.Eventually(t, reconciled("store-0043", 1), 20*time.Second, 50*time.Millisecond)

	// The class filled in the cluster's network from its variables.
	c43 := get("Cluster", "store-0043").GetCluster()
	require.Equal(t, "10.50.0.0/16", c43.GetSpec().GetPodCidr())
	require.Equal(t, "10.244.0.0/16", get("Cluster", "store-0042").GetCluster().GetSpec().GetPodCidr())

	cp := get("ControlPlane", "store-0043-control-plane").GetControlPlane()
	require.NotNil(t, cp)
	require.Equal(t, int32(3), cp.GetSpec().GetReplicas())
	require.Equal(t, "v1.34.4", cp.GetSpec().GetVersion())
	require.Equal(t, map[string]string{"site": "store-0043", "class": "control-plane"}, cp.GetSpec().GetHostSelector())
	require.Equal(t, map[string]string{"os": "ubuntu24"}, cp.GetSpec().GetImageSelector())
	require.Equal(t, "store-0043", cp.GetMetadata().GetLabels()[topologyplan.LabelOwned])
	md := get("MachineDeployment", "store-0043-vision").GetMachineDeployment()
	require.Equal(t, map[string]string{"os": "ubuntu24", "flavour": "gpu"}, md.GetSpec().GetImageSelector())
	require.Equal(t, int32(2), get("MachineDeployment", "store-0042-app").GetMachineDeployment().GetSpec().GetReplicas())
	require.Nil(t, get("MachineDeployment", "store-0042-vision"))
	hc := get("HealthCheck", "store-0042-control-plane").GetHealthCheck()
	require.Equal(t, "1", hc.GetSpec().GetMaxUnhealthy())
	require.Equal(t, map[string]string{"cluster": "store-0042", "role": "control-plane"}, hc.GetSpec().GetSelector())
	require.NotNil(t, get("HealthCheck", "store-0043-app"))
	class := get("ClusterClass", "edge-store").GetClusterClass()
	require.Equal(t, int64(1), class.GetStatus().GetRevision())

	// A user scales a derived pool by hand: it goes back, with an event.
	edited := get("MachineDeployment", "store-0042-app")
	edited.GetMachineDeployment().Spec.Replicas = 5
	edited.GetMachineDeployment().Metadata.ResourceVersion = ""
	_, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{edited}})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return get("MachineDeployment", "store-0042-app").GetMachineDeployment().GetSpec().GetReplicas() == 2
	}, 20*time.Second, 50*time.Millisecond, "the edit of the derived MachineDeployment was not reverted")
	// The event follows the revert's write.
	const reverted = "MachineDeployment store-0042-app is owned by the topology of cluster store-0042; the edit of spec.replicas was reverted; change cluster store-0042's spec.topology instead"
	require.Eventually(t, func() bool {
		evs, err := rc.ListEvents(ctx, &controllerv1.ListEventsRequest{ObjectKind: "MachineDeployment", ObjectName: "store-0042-app"})
		require.NoError(t, err)
		for _, ev := range evs.GetEvents() {
			if ev.GetMessage() == reverted && ev.GetType() == "Warning" {
				return true
			}
		}
		return false
	}, 10*time.Second, 50*time.Millisecond, "no event says the edit was reverted")

	// A class change that would break a cluster is refused, naming it.
	narrow := proto.Clone(objs[0]).(*controllerv1.Resource)
	for _, v := range narrow.GetClusterClass().GetSpec().GetVariables() {
		if v.GetName() == "maxUnhealthy" {
			m := int64(2)
			v.Maximum = &m // store-0043's 3 no longer fits
		}
	}
	narrow.GetClusterClass().Spec.Workers = narrow.GetClusterClass().GetSpec().GetWorkers()[:1] // gpu removed: store-0043 uses it
	_, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{narrow}})
	require.Equal(t, codes.InvalidArgument, code(err), "%v", err)
	require.Contains(t, err.Error(), "would break 1 cluster(s)")
	require.Contains(t, err.Error(), "store-0043 (variables.maxUnhealthy: 3 is above the maximum 2; workers[1].class: pool vision names worker class \"gpu\"")
	require.NotContains(t, err.Error(), "store-0042 (")

	// A compatible change: revision 2 and its Rollout; no cluster moves.
	v2 := proto.Clone(objs[0]).(*controllerv1.Resource)
	v2.GetClusterClass().Spec.ControlPlane.HealthCheck.NodeStartupTimeout = "20m"
	_, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{v2}})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return get("ClusterClass", "edge-store").GetClusterClass().GetStatus().GetRevision() == 2 && get("Rollout", "edge-store-r2") != nil
	}, 20*time.Second, 50*time.Millisecond)
	ro := get("Rollout", "edge-store-r2").GetRollout()
	require.Equal(t, "edge-store", ro.GetSpec().GetChange().GetClusterClass())
	require.Equal(t, int64(2), ro.GetSpec().GetChange().GetClassRevision())
	require.Equal(t, "10m", ro.GetSpec().GetBake())
	require.Equal(t, "upgrade-wave", ro.GetSpec().GetWaveLabel())
	require.Equal(t, []int64{1, 2}, revisions(get("ClusterClass", "edge-store").GetClusterClass()))
	require.Empty(t, get("HealthCheck", "store-0042-control-plane").GetHealthCheck().GetSpec().GetNodeStartupTimeout(), "a class change moved a cluster before its Rollout did")

	// The Rollout controller moves store-0042's pin (by hand here): its
	// objects follow revision 2; store-0043 stays on 1.
	movePin(t, env, "store-0042", 2)
	require.Eventually(t, func() bool {
		return get("HealthCheck", "store-0042-control-plane").GetHealthCheck().GetSpec().GetNodeStartupTimeout() == "20m"
	}, 20*time.Second, 50*time.Millisecond)
	require.Eventually(t, reconciled("store-0042", 2), 20*time.Second, 50*time.Millisecond)
	require.Empty(t, get("HealthCheck", "store-0043-control-plane").GetHealthCheck().GetSpec().GetNodeStartupTimeout())

	// Once store-0043 follows 2 too, nobody pins revision 1: pruned.
	movePin(t, env, "store-0043", 2)
	require.Eventually(t, reconciled("store-0043", 2), 20*time.Second, 50*time.Millisecond)
	require.Eventually(t, func() bool {
		return len(revisions(get("ClusterClass", "edge-store").GetClusterClass())) == 1
	}, 20*time.Second, 50*time.Millisecond)
	require.Equal(t, "20m", get("HealthCheck", "store-0043-control-plane").GetHealthCheck().GetSpec().GetNodeStartupTimeout())

	// Deleting a topology cluster deletes what it derived.
	_, err = rc.Delete(ctx, &controllerv1.DeleteRequest{Kind: "Cluster", Name: "store-0043"})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return get("ControlPlane", "store-0043-control-plane") == nil && get("MachineDeployment", "store-0043-app") == nil &&
			get("MachineDeployment", "store-0043-vision") == nil && get("HealthCheck", "store-0043-app") == nil
	}, 20*time.Second, 50*time.Millisecond, "the derived objects of a deleted cluster stayed")
	require.NotNil(t, get("ControlPlane", "store-0042-control-plane"))
}

func revisions(c *typesv1.ClusterClass) []int64 {
	var out []int64
	for _, r := range c.GetStatus().GetRevisions() {
		out = append(out, r.GetRevision())
	}
	return out
}

// movePin sets cluster's status.topology.classRevision by compare-and-swap,
// as the Rollout controller does.
func movePin(t *testing.T, env *controllertest.Env, cluster string, rev int64) {
	t.Helper()
	ctx := context.Background()
	require.Eventually(t, func() bool {
		c := &typesv1.Cluster{}
		r, err := env.Store().Get(ctx, "clusters", cluster, c)
		require.NoError(t, err)
		c.Status.Topology.ClassRevision = rev
		_, err = env.Store().Update(ctx, "clusters", cluster, c, r)
		if err != nil && !strings.Contains(err.Error(), "modified") {
			t.Logf("move pin: %v", err)
		}
		return err == nil
	}, 10*time.Second, 10*time.Millisecond)
}
