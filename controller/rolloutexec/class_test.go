package rolloutexec_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/rolloutexec"
	"github.com/kilnhq/kiln/controller/rolloutplan"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/topologyplan"
	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/conditions"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestClassRolloutWaves carries a ClusterClass change to its clusters
// with the real controller's topology executor (h-class) and this
// package's executor: the class change makes revision 2 and its Rollout
// (edge-store-r2); the rollout moves store-0042 (wave 1) to revision 2,
// the topology executor derives its objects from it, and only after
// store-0042 is done and baked does store-0043 (wave 2) move. The
// controller runs without the host lifecycle, so the test stands in for
// the cluster executor: every derived ControlPlane and MachineDeployment
// is "rolled" at its generation, and the Clusters are Ready.
func TestClassRolloutWaves(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	env := controllertest.Start(t)
	st := env.Controller.Store()
	rc := controllerv1.NewResourcesClient(env.Dial(t, env.ConfigFor(t, "admin", "alice")))
	docs, err := validation.LoadManifests(nil, "../../examples/clusterclass/edge-store.yaml")
	require.NoError(t, err)
	var objs []*controllerv1.Resource
	for _, d := range docs {
		objs = append(objs, d.Resource)
	}
	_, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: objs})
	require.NoError(t, err)

	cluster := func(name string) *typesv1.Cluster {
		c := &typesv1.Cluster{}
		_, err := st.Get(ctx, "clusters", name, c)
		require.NoError(t, err)
		return c
	}
	for _, name := range []string{"store-0042", "store-0043"} {
		require.Eventually(t, func() bool { return topologyplan.Reconciled(cluster(name)) }, 20*time.Second, 50*time.Millisecond, "cluster %s at revision 1", name)
	}

	// The cluster executor's part, faked: everything rolled and Ready.
	fakeDone := make(chan struct{})
	go func() {
		defer close(fakeDone)
		for ctx.Err() == nil {
			settle(ctx, st)
			select {
			case <-ctx.Done():
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
	defer func() { cancel(); <-fakeDone }()

	rx := rolloutexec.New(rolloutexec.Deps{Store: st}, rolloutexec.Config{Interval: 100 * time.Millisecond}, slog.New(slog.NewTextHandler(testWriter{t}, nil)))
	rxDone := make(chan struct{})
	go func() { _ = rx.Run(ctx); close(rxDone) }()
	defer func() { cancel(); <-rxDone }()

	// The class change: another default, and a short bake for the test.
	class := proto.Clone(objs[0]).(*controllerv1.Resource)
	for _, v := range class.GetClusterClass().GetSpec().GetVariables() {
		if v.GetName() == "maxUnhealthy" {
			v.Default = "2"
		}
	}
	class.GetClusterClass().Spec.Rollout.Bake = "3s"
	_, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{class}})
	require.NoError(t, err)

	rollout := func() *typesv1.Rollout {
		r := &typesv1.Rollout{}
		if _, err := st.Get(ctx, "rollouts", "edge-store-r2", r); err != nil {
			return &typesv1.Rollout{}
		}
		return r
	}
	require.Eventually(t, func() bool { return rollout().GetStatus().GetPhase() == rolloutplan.PhaseBaking }, 30*time.Second, 50*time.Millisecond,
		"wave 1 never baked: %v", rollout().GetStatus())
	c42, c43 := cluster("store-0042"), cluster("store-0043")
	require.EqualValues(t, 2, c42.GetStatus().GetTopology().GetReconciledRevision(), "store-0042 (wave 1) derived from revision 2")
	require.EqualValues(t, 1, c43.GetStatus().GetTopology().GetClassRevision(), "store-0043 (wave 2) still pinned at 1 while wave 1 bakes")
	hc := &typesv1.HealthCheck{}
	_, err = st.Get(ctx, "healthchecks", "store-0042-control-plane", hc)
	require.NoError(t, err)
	require.Equal(t, "2", hc.GetSpec().GetMaxUnhealthy(), "store-0042's HealthCheck derived from revision 2")

	require.Eventually(t, func() bool { return rollout().GetStatus().GetPhase() == rolloutplan.PhaseComplete }, 30*time.Second, 50*time.Millisecond,
		"never complete: %v", rollout().GetStatus())
	for _, name := range []string{"store-0042", "store-0043"} {
		c := cluster(name)
		require.True(t, topologyplan.Reconciled(c), "cluster %s reconciled", name)
		require.EqualValues(t, 2, c.GetStatus().GetTopology().GetClassRevision(), "cluster %s pinned at revision 2", name)
	}
	r := rollout()
	require.Len(t, r.GetStatus().GetClusters(), 2)
	first, second := r.GetStatus().GetClusters()[0], r.GetStatus().GetClusters()[1]
	require.Equal(t, "store-0042", first.GetName())
	require.False(t, second.GetStartTime().AsTime().Before(first.GetDoneTime().AsTime().Add(3*time.Second)), "wave 2 started before wave 1 baked 3s")
	t.Logf("store-0042 wave 1: started %s, done %s; store-0043 wave 2: started %s, done %s",
		first.GetStartTime().AsTime().Format(time.StampMilli), first.GetDoneTime().AsTime().Format(time.StampMilli),
		second.GetStartTime().AsTime().Format(time.StampMilli), second.GetDoneTime().AsTime().Format(time.StampMilli))
}

// settle marks every ControlPlane and MachineDeployment rolled at its
// generation and every Cluster Ready, as the cluster executor would once
// the machines are: compare-and-swap, a conflict is tried next round.
func settle(ctx context.Context, st *store.Store) {
	cps, _, _ := st.List(ctx, "controlplanes", func() proto.Message { return &typesv1.ControlPlane{} }, store.ListOptions{})
	for _, it := range cps {
		cp := it.Msg.(*typesv1.ControlPlane)
		n, gen := cp.GetSpec().GetReplicas(), cp.GetMetadata().GetGeneration()
		if r := conditions.Get(cp.GetStatus().GetConditions(), "Ready"); r.GetStatus() == "True" && r.GetObservedGeneration() == gen {
			continue
		}
		if cp.Status == nil {
			cp.Status = &typesv1.ControlPlaneStatus{}
		}
		cp.Status.Replicas, cp.Status.ReadyReplicas, cp.Status.UpdatedReplicas = n, n, n
		cp.Status.Conditions, _ = conditions.Set(cp.Status.Conditions, &typesv1.Condition{Type: "Ready", Status: "True", Reason: "AsExpected", ObservedGeneration: gen}, time.Now())
		_, _ = st.Update(ctx, "controlplanes", it.Name, cp, it.Rev)
	}
	mds, _, _ := st.List(ctx, "machinedeployments", func() proto.Message { return &typesv1.MachineDeployment{} }, store.ListOptions{})
	for _, it := range mds {
		md := it.Msg.(*typesv1.MachineDeployment)
		n, gen := md.GetSpec().GetReplicas(), md.GetMetadata().GetGeneration()
		if r := conditions.Get(md.GetStatus().GetConditions(), "UpToDate"); r.GetStatus() == "True" && r.GetObservedGeneration() == gen {
			continue
		}
		if md.Status == nil {
			md.Status = &typesv1.MachineDeploymentStatus{}
		}
		md.Status.Replicas, md.Status.ReadyReplicas, md.Status.UpdatedReplicas = n, n, n
		md.Status.Conditions, _ = conditions.Set(md.Status.Conditions, &typesv1.Condition{Type: "UpToDate", Status: "True", Reason: "AsExpected", ObservedGeneration: gen}, time.Now())
		_, _ = st.Update(ctx, "machinedeployments", it.Name, md, it.Rev)
	}
	cs, _, _ := st.List(ctx, "clusters", func() proto.Message { return &typesv1.Cluster{} }, store.ListOptions{})
	for _, it := range cs {
		c := it.Msg.(*typesv1.Cluster)
		if conditions.IsTrue(c.GetStatus().GetConditions(), "Ready") {
			continue
		}
		if c.Status == nil {
			c.Status = &typesv1.ClusterStatus{}
		}
		c.Status.Conditions, _ = conditions.Set(c.Status.Conditions, &typesv1.Condition{Type: "Ready", Status: "True", Reason: "AsExpected"}, time.Now())
		_, _ = st.Update(ctx, "clusters", it.Name, c, it.Rev)
	}
}
