package clusterexec_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/clusterexec"
	"github.com/kilnhq/kiln/controller/clusterplan"
	"github.com/kilnhq/kiln/controller/election"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/store/storetest"
	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// applyImage stores the simulated image.
func (w *world) applyImage() {
	w.create("images", sim.ImageName, &typesv1.Image{Metadata: &typesv1.ObjectMeta{Name: sim.ImageName, Generation: 1, CreationTimestamp: timestamppb.Now()},
		Spec: &typesv1.ImageSpec{Url: "http://images.sim/" + sim.ImageName + ".raw.zst", Format: "raw.zst", Sha256: strings.Repeat("ab", 32), KubernetesVersion: "v1.34.4"}})
}

// applyCluster stores hosts labelled pool=name and a cluster name whose
// control plane (cp replicas) and deployment md-name (workers) take only
// those hosts.
func (w *world) applyCluster(name string, hosts []string, cp, workers int) {
	now := timestamppb.Now()
	meta := func(n string) *typesv1.ObjectMeta {
		return &typesv1.ObjectMeta{Name: n, Generation: 1, CreationTimestamp: now}
	}
	pool := map[string]string{"pool": name}
	for _, h := range hosts {
		m := meta(h)
		m.Labels = pool
		w.create("hosts", h, &typesv1.Host{Metadata: m,
			Spec: &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "redfish", Address: "sim://" + h}, RootDiskHint: "/dev/sda", Online: true}})
	}
	cm := meta(name)
	cm.Uid = "uid-" + name
	w.create("clusters", name, &typesv1.Cluster{Metadata: cm, Spec: &typesv1.ClusterSpec{
		KubernetesVersion: "v1.34.4", PodCidr: "10.244.0.0/16", ServiceCidr: "10.96.0.0/12", ControlPlaneEndpoint: "10.0.0.10:6443", DnsDomain: "cluster.local"}})
	w.create("controlplanes", "cp-"+name, &typesv1.ControlPlane{Metadata: meta("cp-" + name), Spec: &typesv1.ControlPlaneSpec{
		Cluster: name, Replicas: int32(cp), Version: "v1.34.4", Image: sim.ImageName, HostSelector: pool}})
	w.create("machinedeployments", "md-"+name, &typesv1.MachineDeployment{Metadata: meta("md-" + name), Spec: &typesv1.MachineDeploymentSpec{
		Cluster: name, Replicas: int32(workers), Version: "v1.34.4", Image: sim.ImageName, HostSelector: pool}})
}

// clusterMachines returns the machines of cluster.
func (w *world) clusterMachines(cluster string) []*typesv1.Machine {
	var out []*typesv1.Machine
	for _, m := range w.machines() {
		if m.GetSpec().GetCluster() == cluster {
			out = append(out, m)
		}
	}
	return out
}

// waitClusterRunning waits until cluster has exactly n machines, all
// Running and NodeReady (the bound only stops a hung test).
func (w *world) waitClusterRunning(cluster string, n int) []*typesv1.Machine {
	w.t.Helper()
	var ms []*typesv1.Machine
	require.Eventually(w.t, func() bool {
		ms = w.clusterMachines(cluster)
		running := 0
		for _, m := range ms {
			if m.GetStatus().GetPhase() == clusterexec.PhaseRunning && conditions.IsTrue(m.GetStatus().GetConditions(), clusterplan.MachineNodeReady) {
				running++
			}
		}
		return running == n && len(ms) == n
	}, 2*time.Minute, 20*time.Millisecond, "cluster %s: want %d machines Running", cluster, n)
	return ms
}

// scale sets the deployment's replicas, as a user's apply does: read,
// change, write, again when the executor wrote its status in between.
func (w *world) scale(md string, replicas int32) {
	w.t.Helper()
	storetest.Modify(w.t, w.st, "machinedeployments", md, func(x *typesv1.MachineDeployment) { x.Spec.Replicas = replicas })
}

// stuckDrainer drains every node at once, except the nodes of hosts
// named with prefix: their drains never end until their ctx does, as a
// drain behind a PodDisruptionBudget whose minAvailable equals its
// replicas.
type stuckDrainer struct {
	prefix string
	mu     sync.Mutex
	stuck  map[string]int // node -> drains started
	done   map[string]int // node -> drains that finished
}

func (d *stuckDrainer) Drain(ctx context.Context, _ []byte, node string, _ time.Duration) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !strings.HasPrefix(node, d.prefix) {
		d.done[node]++
		return nil
	}
	d.stuck[node]++
	d.mu.Unlock()
	<-ctx.Done()
	d.mu.Lock()
	return fmt.Errorf("drain node %q: pod default/db-0: cannot evict pod as it would violate the pod's disruption budget: %w", node, ctx.Err())
}

func (d *stuckDrainer) started(node string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.stuck[node]
}

// TestStuckDrainHoldsUpOnlyItsCluster: cluster a's worker drain never
// ends (a PodDisruptionBudget allows no eviction). While it hangs, cluster
// b is created, scaled up and has an unhealthy machine remediated, all to
// completion; cluster a's machine then says Drained=False, reason
// DrainTimeout, naming its node, its deadline and the budgets to check,
// and its removal halts: it is neither reset nor deleted.
func TestStuckDrainHoldsUpOnlyItsCluster(t *testing.T) {
	w := newWorld(t, 0)
	w.kubeadm.SetAdminKubeconfig("apiVersion: v1\nkind: Config\n") // drains go to the drainer
	drainer := &stuckDrainer{prefix: "a", stuck: map[string]int{}, done: map[string]int{}}
	w.drain = drainer.Drain
	w.drainTimeout = 2 * time.Second
	w.applyImage()
	w.applyCluster("a", []string{"a1", "a2", "a3"}, 1, 2)
	stop := w.start()
	defer stop()
	w.waitClusterRunning("a", 3)

	// Cluster a scales down: its drain hangs.
	w.scale("md-a", 1)
	var victim *typesv1.Machine
	require.Eventually(t, func() bool {
		for _, m := range w.clusterMachines("a") {
			if c := conditions.Get(m.GetStatus().GetConditions(), clusterplan.MachineDrained); c != nil && drainer.started(m.GetStatus().GetNodeName()) > 0 {
				victim = m
				return true
			}
		}
		return false
	}, 2*time.Minute, 20*time.Millisecond, "cluster a's drain never started")
	node := victim.GetStatus().GetNodeName()
	t.Logf("cluster a: drain of node %s started and hangs", node)

	// Meanwhile cluster b is created, scaled and remediated.
	w.applyCluster("b", []string{"b1", "b2", "b3", "b4"}, 1, 1)
	w.create("healthchecks", "hc-b", &typesv1.HealthCheck{Metadata: &typesv1.ObjectMeta{Name: "hc-b", Generation: 1, CreationTimestamp: timestamppb.Now()},
		Spec: &typesv1.HealthCheckSpec{Cluster: "b", Selector: map[string]string{"cluster": "b", "role": "worker"}, MaxUnhealthy: "1",
			UnhealthyConditions: []*typesv1.UnhealthyCondition{{Type: "NodeReady", Status: "False", Timeout: "1s"}}}})
	w.waitClusterRunning("b", 2)
	t.Logf("cluster b: created, 2 machines Running")
	w.scale("md-b", 2)
	bs := w.waitClusterRunning("b", 3)
	t.Logf("cluster b: scaled to 2 workers, 3 machines Running")
	var sick *typesv1.Machine
	for _, m := range bs {
		if m.GetSpec().GetRole() == clusterplan.RoleWorker {
			sick = m
			break
		}
	}
	w.kubeadm.NodeNotReady(sick.GetSpec().GetHost(), true)
	require.Eventually(t, func() bool {
		for _, m := range w.clusterMachines("b") {
			if m.GetMetadata().GetUid() == sick.GetMetadata().GetUid() {
				return false
			}
		}
		return true
	}, 2*time.Minute, 20*time.Millisecond, "cluster b: unhealthy machine %s not remediated", sick.GetMetadata().GetName())
	w.kubeadm.NodeNotReady(sick.GetSpec().GetHost(), false)
	w.waitClusterRunning("b", 3)
	t.Logf("cluster b: unhealthy machine %s remediated and replaced, 3 machines Running", sick.GetMetadata().GetName())

	// All along, cluster a's drain hung: never finished, its machine kept.
	var drained *typesv1.Condition
	deleted := false
	require.Eventually(t, func() bool {
		for _, m := range w.clusterMachines("a") {
			if m.GetMetadata().GetName() == victim.GetMetadata().GetName() {
				drained = conditions.Get(m.GetStatus().GetConditions(), clusterplan.MachineDrained)
				return drained.GetReason() == clusterexec.ReasonDrainTimeout
			}
		}
		deleted = true
		return true
	}, 2*time.Minute, 20*time.Millisecond, "cluster a: no DrainTimeout condition on %s", victim.GetMetadata().GetName())
	require.False(t, deleted, "cluster a: machine %s deleted although its drain never finished", victim.GetMetadata().GetName())
	require.Equal(t, conditions.False, drained.GetStatus(), "Drained status of %s", victim.GetMetadata().GetName())
	for _, want := range []string{"node " + node, "deadline", "drain timeout 2s", "PodDisruptionBudget", "kubectl get pdb -A", "halted"} {
		require.Contains(t, drained.GetMessage(), want, "Drained message of %s", victim.GetMetadata().GetName())
	}
	t.Logf("cluster a: machine %s: Drained=%s reason=%s: %s", victim.GetMetadata().GetName(), drained.GetStatus(), drained.GetReason(), drained.GetMessage())
	for _, c := range w.kubeadm.Calls() {
		require.False(t, c.Method == "KubeadmReset" && c.Host == victim.GetSpec().GetHost(), "node %s reset although its drain never finished", node)
	}
	require.Len(t, w.clusterMachines("a"), 3, "cluster a's machines: the removal must halt")
	drainer.mu.Lock()
	require.Zero(t, drainer.done[node], "drain of %s finished", node)
	drainer.mu.Unlock()
}

// TestDeposedLeaderIsFenced: two electors campaign on one etcd. Leader 1
// bootstraps the cluster; then its lease is revoked (as when it is cut
// off for longer than the TTL) and elector 2 leads. Leader 1's executor,
// not yet aware, reconciles once more after the deployment was scaled
// up: its CreateMachine is refused by the fence and writes nothing; the
// new leader creates and joins the worker, and nothing runs twice.
func TestDeposedLeaderIsFenced(t *testing.T) {
	w := newWorld(t, 0)
	w.applyImage()
	w.applyCluster("c1", []string{"h1", "h2", "h3"}, 1, 0)
	stopLife := w.startLifecycle()
	defer stopLife()

	client := w.st.Client()
	terms := make(chan election.Term, 2)
	elect := func(id string) {
		first := true
		go func() {
			_ = election.New(client, election.DefaultPrefix, id, 5, nil).Run(w.ctx, func(lctx context.Context, term election.Term) {
				if !first {
					return // a later term (after being deposed) is not part of this story
				}
				first = false
				terms <- term
				<-lctx.Done()
			})
		}()
	}
	elect("leader-1")
	term1 := <-terms
	elect("leader-2")

	st1 := w.st.Fenced(store.Fence{Key: term1.Key, Rev: term1.Rev})
	ex1 := w.executorOn(st1, "leader-1")
	ctx1, stop1 := context.WithCancel(w.ctx)
	done1 := make(chan struct{})
	go func() { _ = ex1.Run(ctx1); close(done1) }()
	w.waitClusterRunning("c1", 1)
	stop1()
	<-done1

	// Depose leader 1: its lease is revoked; leader 2 wins.
	got, err := client.Get(w.ctx, term1.Key)
	require.NoError(t, err)
	require.Len(t, got.Kvs, 1, "leader 1's election key")
	_, err = client.Revoke(w.ctx, clientv3.LeaseID(got.Kvs[0].Lease))
	require.NoError(t, err)
	var term2 election.Term
	select {
	case term2 = <-terms:
	case <-time.After(time.Minute):
		t.Fatal("leader 2 not elected after leader 1's lease was revoked")
	}
	t.Logf("leader 1 deposed (term %s rev %d); leader 2 leads (term %s rev %d)", term1.Key, term1.Rev, term2.Key, term2.Rev)

	// Leader 1, not yet aware, acts on a scale-up: refused.
	w.scale("md-c1", 1)
	err = ex1.Reconcile(w.ctx, "c1")
	require.Error(t, err, "deposed leader's reconcile")
	require.True(t, errors.Is(err, store.ErrFenced), "deposed leader's reconcile = %v, want store.ErrFenced", err)
	t.Logf("deposed leader's step-starting write refused: %v", err)
	ex1.Wait()
	require.Len(t, w.clusterMachines("c1"), 1, "machines after the deposed leader's refused CreateMachine")

	// Leader 2 does the work, once.
	ex2 := w.executorOn(w.st.Fenced(store.Fence{Key: term2.Key, Rev: term2.Rev}), "leader-2")
	ctx2, stop2 := context.WithCancel(w.ctx)
	defer stop2()
	go func() { _ = ex2.Run(ctx2) }()
	w.waitClusterRunning("c1", 2)

	// Leader 1 tries again while leader 2 leads: still refused.
	err = ex1.Reconcile(w.ctx, "c1")
	ex1.Wait()
	if err != nil {
		require.True(t, errors.Is(err, store.ErrFenced), "deposed leader's second reconcile = %v, want store.ErrFenced or nothing to do", err)
	}
	calls := w.kubeadm.Calls()
	require.Equal(t, 1, count(calls, "KubeadmInit", false), "KubeadmInit runs")
	require.Equal(t, 1, count(calls, "KubeadmJoin", false), "KubeadmJoin runs")
	require.Equal(t, 2, count(calls, "Prepare", false), "Prepare runs")
	for _, h := range []string{"h1", "h2", "h3"} {
		require.LessOrEqual(t, w.fleet.Host(h).Lays(), 1, "host %s laid twice", h)
	}
}

// TestNodeDrainTimeoutProceeds: a MachineDeployment with nodeDrainTimeout
// goes on when the drain misses it (as Cluster API's does): the machine's
// hung drain ends at the deadline with a DrainTimeout warning, and the
// machine is reset and deleted anyway.
func TestNodeDrainTimeoutProceeds(t *testing.T) {
	w := newWorld(t, 0)
	w.kubeadm.SetAdminKubeconfig("apiVersion: v1\nkind: Config\n")
	drainer := &stuckDrainer{prefix: "a", stuck: map[string]int{}, done: map[string]int{}}
	w.drain = drainer.Drain
	w.drainTimeout = time.Hour // not this one: the deployment names its own
	w.applyImage()
	w.applyCluster("a", []string{"a1", "a2", "a3"}, 1, 2)
	md := &typesv1.MachineDeployment{}
	rev, err := w.st.Get(w.ctx, "machinedeployments", "md-a", md)
	require.NoError(t, err)
	md.Spec.Strategy = &typesv1.RolloutStrategy{NodeDrainTimeout: "1s"}
	_, err = w.st.Update(w.ctx, "machinedeployments", "md-a", md, rev)
	require.NoError(t, err)
	stop := w.start()
	defer stop()
	before := w.waitClusterRunning("a", 3)

	w.scale("md-a", 1)
	after := w.waitClusterRunning("a", 2)
	kept := map[string]bool{}
	for _, m := range after {
		kept[m.GetMetadata().GetName()] = true
	}
	var gone *typesv1.Machine
	for _, m := range before {
		if !kept[m.GetMetadata().GetName()] {
			gone = m
		}
	}
	require.NotNil(t, gone, "no machine removed")
	require.Equal(t, 1, drainer.started(gone.GetStatus().GetNodeName()), "drains of %s", gone.GetStatus().GetNodeName())
	evs, err := w.rec.List(w.ctx, "machines", gone.GetMetadata().GetName(), 0)
	require.NoError(t, err)
	var timeout string
	for _, ev := range evs {
		if ev.GetReason() == clusterexec.ReasonDrainTimeout {
			timeout = ev.GetMessage()
		}
	}
	require.Contains(t, timeout, "nodeDrainTimeout says to go on", "DrainTimeout event of %s", gone.GetMetadata().GetName())
	t.Logf("machine %s: %s", gone.GetMetadata().GetName(), timeout)
	reset := false
	for _, c := range w.kubeadm.Calls() {
		reset = reset || (c.Method == "KubeadmReset" && c.Host == gone.GetSpec().GetHost())
	}
	require.True(t, reset, "node on %s not reset after its drain timed out", gone.GetSpec().GetHost())
}
