package fleet_test

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/clusterexec"
	"github.com/kilnhq/kiln/controller/clusterplan"
	"github.com/kilnhq/kiln/e2e/fleet"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/internal/conditions"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// The two clusters of TestLabDrainDeadlock, each on hosts of its own
// (label pool): blocked is 1 control plane + 1 worker whose drain a
// PodDisruptionBudget blocks; busy is created, scaled and remediated
// meanwhile.
const (
	blocked = "pdb-a"
	busy    = "pdb-b"
	// haltDrainTimeout is the controller's --drain-timeout: the deadline
	// of a drain whose MachineDeployment names no nodeDrainTimeout (the
	// removal halts after it and the drain is tried again).
	haltDrainTimeout = 30 * time.Second
	// proceedDrainTimeout is the nodeDrainTimeout given to blocked's
	// MachineDeployment at the end (the removal proceeds after it).
	proceedDrainTimeout = "30s"
)

// TestLabDrainDeadlock is the classic drain deadlock on a lab rack of
// four hosts, with the real controller, agents, kubeadm and API servers:
// cluster pdb-a runs a Deployment of 2 pods on its worker under a
// PodDisruptionBudget with minAvailable 2 (no eviction is ever allowed),
// and its MachineDeployment scales from 1 to 0, so the worker must be
// drained. While that drain is blocked, cluster pdb-b is created, scaled
// from 0 to 1 worker, and its worker (kubelet stopped) is remediated, each
// to completion. Checked:
//
//   - pdb-a's machine says Drained=False, reason DrainTimeout, with the
//     node, the deadline and the budgets to check, in `kilnctl describe
//     cluster`; its removal halts (no nodeDrainTimeout: the controller's
//     --drain-timeout, after which the drain is tried again): the machine
//     stays, the pods stay, at every poll while pdb-b works;
//   - pdb-b's operations complete while pdb-a's drain is blocked (the
//     timeline, from the store's own timestamps);
//   - given nodeDrainTimeout, pdb-a's removal proceeds past the deadline
//     (Drained=True, reason DrainTimeout) and the machine goes.
//
// The timeline is logged as "timeline:" lines, ready to quote.
func TestLabDrainDeadlock(t *testing.T) {
	needLab(t)
	end := time.Now().Add(60 * time.Minute)
	if d, ok := t.Deadline(); ok && d.Add(-3*time.Minute).Before(end) {
		end = d.Add(-3 * time.Minute)
	}
	ctx, cancel := context.WithDeadline(context.Background(), end)
	defer cancel()
	lab, tag := startLab(t, ctx, func(c *fleet.Config) {
		c.Hosts, c.IPMI = 4, 0
		c.ControllerArgs = append(c.ControllerArgs, "--drain-timeout", haltDrainTimeout.String())
	})
	r := &drainRun{t: t, ctx: ctx, lab: lab, tag: tag, start: time.Now()}
	r.registerPools()

	// Cluster pdb-a: 1 control plane + 1 worker.
	r.apply(r.clusterYAML(blocked, 1, 1, ""))
	r.mark("applied %s: 1 control plane (%s) + 1 worker (%s)", blocked, lab.HostResource(1), lab.HostResource(2))
	r.wait("cluster "+blocked+" Ready", func(a, _ *fleet.Snapshot) bool { return a.Ready() && running(a, 2) })
	r.mark("%s Ready: 2 machines Running", blocked)

	// The deadlock: 2 pods on the worker, a budget that allows no eviction.
	worker := lab.HostResource(2)
	r.kubeconfigA()
	r.kubectl(workloadYAML(worker), "apply", "-f", "-")
	r.kubectl(nil, "rollout", "status", "deployment/db", "--timeout", "5m")
	r.requirePDBHolds(worker)
	r.mark("%s: Deployment db (2 replicas) Running on node %s; PodDisruptionBudget db minAvailable 2: ALLOWED DISRUPTIONS 0", blocked, worker)

	// Scale pdb-a's workers 1 -> 0: the worker must be drained, and cannot.
	r.apply(r.clusterYAML(blocked, 1, 0, ""))
	r.mark("%s: MachineDeployment scaled 1 -> 0: drain of node %s starts", blocked, worker)
	r.wait("drain of "+worker+" times out", func(a, _ *fleet.Snapshot) bool {
		m := machineOnHost(a, worker)
		if m == nil {
			r.t.Fatalf("%s: machine on %s deleted although its drain could not finish", blocked, worker)
		}
		if r.victim == "" && conditions.Get(m.GetStatus().GetConditions(), clusterplan.MachineDrained) != nil {
			r.victim, r.victimUID = m.GetMetadata().GetName(), m.GetMetadata().GetUid()
			r.mark("%s: machine %s Drained %s", blocked, r.victim, conditionText(m, clusterplan.MachineDrained))
		}
		c := conditions.Get(m.GetStatus().GetConditions(), clusterplan.MachineDrained)
		return c.GetReason() == clusterexec.ReasonDrainTimeout
	})
	a, err := lab.Snapshot(ctx, blocked)
	require.NoError(t, err)
	drained := conditions.Get(machineOnHost(a, worker).GetStatus().GetConditions(), clusterplan.MachineDrained)
	require.Equal(t, conditions.False, drained.GetStatus(), "Drained of %s after the deadline: the removal must halt (no nodeDrainTimeout)", r.victim)
	for _, want := range []string{"node " + worker, "deadline", "drain timeout " + haltDrainTimeout.String(), "PodDisruptionBudget", "kubectl get pdb -A", "halted"} {
		require.Contains(t, drained.GetMessage(), want, "Drained message of %s", r.victim)
	}
	r.mark("%s: machine %s Drained=False reason=%s (False since %s): %s", blocked, r.victim, drained.GetReason(),
		drained.GetLastTransitionTime().AsTime().UTC().Format(time.TimeOnly), drained.GetMessage())
	desc, err := lab.Kilnctl(ctx, nil, "describe", "cluster", blocked)
	require.NoError(t, err)
	require.Contains(t, desc, clusterexec.ReasonDrainTimeout, "kilnctl describe cluster %s", blocked)
	require.Contains(t, desc, "PodDisruptionBudget", "kilnctl describe cluster %s", blocked)
	t.Logf("kilnctl describe cluster %s (drain blocked):\n%s", blocked, desc)

	// While it stays blocked (checked at every poll), pdb-b is created,
	// scaled and remediated.
	r.holding = true
	r.apply(append(r.clusterYAML(busy, 1, 0, ""), []byte("---\n"+healthCheckYAML(busy))...))
	r.mark("applied %s: 1 control plane (%s), 0 workers, a HealthCheck of its workers", busy, lab.HostResource(3))
	r.wait("cluster "+busy+" control plane Running", func(_, b *fleet.Snapshot) bool { return running(b, 1) })
	r.mark("%s: control plane Running and NodeReady (%s)", busy, r.bootstrapTimes(busy))

	r.apply(r.clusterYAML(busy, 1, 1, ""))
	r.mark("%s: MachineDeployment scaled 0 -> 1", busy)
	r.wait("cluster "+busy+" worker Running", func(_, b *fleet.Snapshot) bool { return running(b, 2) && b.Ready() })
	r.mark("%s: worker Running and NodeReady; cluster Ready (%s)", busy, r.bootstrapTimes(busy))

	b, err := lab.Snapshot(ctx, busy)
	require.NoError(t, err)
	sick := machineOnHost(b, lab.HostResource(4))
	require.NotNil(t, sick, "%s: no worker on %s", busy, lab.HostResource(4))
	lays := b.Hosts[lab.HostResource(4)].GetStatus().GetImageLays()
	_, err = lab.NodeExec(ctx, lab.HostResource(4), "systemctl", "stop", "kubelet")
	require.NoError(t, err)
	r.mark("%s: kubelet stopped on %s (machine %s)", busy, lab.HostResource(4), sick.GetMetadata().GetName())
	r.wait("cluster "+busy+" worker remediated", func(_, b *fleet.Snapshot) bool {
		return !hasUID(b, sick.GetMetadata().GetUid()) && running(b, 2) && b.Ready()
	})
	b, err = lab.Snapshot(ctx, busy)
	require.NoError(t, err)
	require.Greater(t, b.Hosts[lab.HostResource(4)].GetStatus().GetImageLays(), lays, "%s: host %s not reimaged by the remediation", busy, lab.HostResource(4))
	r.mark("%s: machine %s remediated: host %s reimaged, new worker Running and NodeReady (%s)", busy, sick.GetMetadata().GetName(), lab.HostResource(4), r.bootstrapTimes(busy))

	// pdb-a all along: the drain still blocked, its pods still there.
	r.requireStillBlocked()
	r.requirePDBHolds(worker)
	r.holding = false
	r.mark("%s: drain of %s still blocked after %s's operations (checked at %d polls); pods db still Running on it",
		blocked, worker, busy, r.polls)

	// Given nodeDrainTimeout, the removal proceeds past the deadline.
	r.apply(r.clusterYAML(blocked, 1, 0, proceedDrainTimeout))
	r.mark("%s: MachineDeployment gets nodeDrainTimeout %s", blocked, proceedDrainTimeout)
	r.wait("machine "+r.victim+" removed after nodeDrainTimeout", func(a, _ *fleet.Snapshot) bool {
		return !hasUID(a, r.victimUID) && a.Ready() && running(a, 1)
	})
	res, err := lab.Client(ctx)
	require.NoError(t, err)
	evs, err := res.ListEvents(ctx, &controllerv1.ListEventsRequest{ObjectKind: "Machine", ObjectName: r.victim})
	require.NoError(t, err)
	var proceeded string
	for _, ev := range evs.GetEvents() {
		if ev.GetReason() == clusterexec.ReasonDrainTimeout && strings.Contains(ev.GetMessage(), "nodeDrainTimeout says to go on") {
			proceeded = ev.GetMessage()
		}
	}
	require.NotEmpty(t, proceeded, "machine %s: no DrainTimeout event saying the removal proceeds", r.victim)
	r.mark("%s: machine %s removed after its nodeDrainTimeout: %s", blocked, r.victim, proceeded)
	r.timeline()
}

// drainRun is the state of TestLabDrainDeadlock.
type drainRun struct {
	t     *testing.T
	ctx   context.Context
	lab   *fleet.Lab
	tag   string
	start time.Time
	lines []string
	kc    string

	victim, victimUID string
	holding           bool // pdb-a's drain must stay blocked at every poll
	polls             int
}

// mark logs one timeline line (seconds since the lab was up) and keeps it
// for the summary.
func (r *drainRun) mark(format string, args ...any) {
	now := time.Now()
	line := fmt.Sprintf("[%5ds %s] %s", int(now.Sub(r.start).Seconds()), now.UTC().Format(time.TimeOnly), fmt.Sprintf(format, args...))
	r.lines = append(r.lines, line)
	r.t.Log("timeline: " + line)
}

func (r *drainRun) timeline() {
	r.t.Logf("timeline (UTC; seconds since the lab was up):\n%s", strings.Join(r.lines, "\n"))
}

// registerPools registers the rack's hosts, each labelled with the pool
// its cluster's selectors take: h1 pdb-a's control plane, h2 its worker,
// h3 pdb-b's control plane, h4 its worker.
func (r *drainRun) registerPools() {
	pools := map[string]string{
		r.lab.HostResource(1): blocked + "-cp", r.lab.HostResource(2): blocked + "-workers",
		r.lab.HostResource(3): busy + "-cp", r.lab.HostResource(4): busy + "-workers",
	}
	out, err := r.lab.HostsYAML(r.ctx)
	require.NoError(r.t, err)
	docs := splitDocs(r.t, []byte(out))
	for _, d := range docs {
		if d["kind"] != "Host" {
			continue
		}
		meta := d["metadata"].(map[string]any)
		labels, _ := meta["labels"].(map[string]any)
		if labels == nil {
			labels = map[string]any{}
		}
		pool, ok := pools[meta["name"].(string)]
		require.True(r.t, ok, "unexpected lab host %v", meta["name"])
		labels["pool"] = pool
		meta["labels"] = labels
	}
	r.apply(joinDocs(r.t, docs))
}

func (r *drainRun) apply(b []byte) {
	r.t.Helper()
	_, err := r.lab.Kilnctl(r.ctx, b, "apply", "-f", "-")
	require.NoError(r.t, err, "kilnctl apply:\n%s", b)
}

// clusterYAML is cluster name with one control plane and workers, each
// on its own pool of hosts, its API server reached on its control-plane
// host directly: the lab's API load balancer fronts every host, so two
// clusters cannot share it.
func (r *drainRun) clusterYAML(name string, controlPlanes, workers int, nodeDrainTimeout string) []byte {
	cpHost := 1
	if name == busy {
		cpHost = 3
	}
	strategy := "    maxSurge: 0\n    maxUnavailable: 1\n"
	if nodeDrainTimeout != "" {
		strategy += "    nodeDrainTimeout: " + nodeDrainTimeout + "\n"
	}
	v := kubetools.Pinned().Kubernetes
	return []byte(fmt.Sprintf(`apiVersion: kiln.dev/v1
kind: Cluster
metadata:
  name: %[1]s
spec:
  kubernetesVersion: %[2]s
  podCidr: 10.244.0.0/16
  serviceCidr: 10.96.0.0/12
  dnsDomain: cluster.local
  controlPlaneEndpoint: %[3]s:6443
---
apiVersion: kiln.dev/v1
kind: ControlPlane
metadata:
  name: %[1]s-cp
spec:
  cluster: %[1]s
  replicas: %[4]d
  version: %[2]s
  image: %[5]s
  hostSelector:
    pool: %[1]s-cp
  rolloutMaxSurge: 0
---
apiVersion: kiln.dev/v1
kind: MachineDeployment
metadata:
  name: %[1]s-workers
spec:
  cluster: %[1]s
  replicas: %[6]d
  version: %[2]s
  image: %[5]s
  hostSelector:
    pool: %[1]s-workers
  strategy:
%[7]s`, name, v, r.lab.HostAddress(cpHost), controlPlanes, r.tag, workers, strategy))
}

func healthCheckYAML(cluster string) string {
	return fmt.Sprintf(`apiVersion: kiln.dev/v1
kind: HealthCheck
metadata:
  name: %[1]s-workers-health
spec:
  cluster: %[1]s
  selector:
    role: worker
  unhealthyConditions:
    - {type: NodeReady, status: "False", timeout: 30s}
    - {type: NodeReady, status: Unknown, timeout: 30s}
  nodeStartupTimeout: 10m
  maxUnhealthy: "1"
`, cluster)
}

// workloadYAML is a Deployment of 2 pods pinned to node (the image every
// lab node has: pause) and a PodDisruptionBudget that keeps both: with
// minAvailable equal to replicas no eviction is ever allowed.
func workloadYAML(node string) []byte {
	rel := kubetools.Pinned()
	return []byte(fmt.Sprintf(`apiVersion: apps/v1
kind: Deployment
metadata:
  name: db
  namespace: default
spec:
  replicas: 2
  selector:
    matchLabels: {app: db}
  template:
    metadata:
      labels: {app: db}
    spec:
      nodeSelector: {kubernetes.io/hostname: %s}
      terminationGracePeriodSeconds: 1
      containers:
        - name: db
          image: %s/pause:%s
          imagePullPolicy: Never
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: db
  namespace: default
spec:
  minAvailable: 2
  selector:
    matchLabels: {app: db}
`, node, rel.Registry, rel.Pause))
}

func (r *drainRun) kubeconfigA() {
	r.kc = filepath.Join(r.t.TempDir(), "kubeconfig-"+blocked)
	_, err := r.lab.Kilnctl(r.ctx, nil, "kubeconfig", blocked, "-o", r.kc)
	require.NoError(r.t, err)
}

// kubectl runs kubectl against pdb-a and returns its output.
func (r *drainRun) kubectl(stdin []byte, args ...string) string {
	r.t.Helper()
	kubectl := filepath.Join(rootfs.CacheRoot(), "kube-tools", kubetools.Pinned().Kubernetes, "bin", "kubectl")
	cmd := exec.CommandContext(r.ctx, kubectl, append([]string{"--kubeconfig", r.kc}, args...)...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	out, err := cmd.CombinedOutput()
	require.NoError(r.t, err, "kubectl %s: %s", strings.Join(args, " "), out)
	return string(out)
}

// requirePDBHolds checks, as a user would with kubectl, that both db pods
// run on node and the budget allows no disruption.
func (r *drainRun) requirePDBHolds(node string) {
	r.t.Helper()
	pods := r.kubectl(nil, "get", "pods", "-l", "app=db", "-o", "jsonpath={range .items[*]}{.spec.nodeName} {.status.phase}{\"\\n\"}{end}")
	require.Equal(r.t, strings.Repeat(node+" Running\n", 2), pods, "db pods (node phase)")
	allowed := r.kubectl(nil, "get", "pdb", "db", "-o", "jsonpath={.status.disruptionsAllowed}")
	require.Equal(r.t, "0", allowed, "PodDisruptionBudget db: disruptionsAllowed")
}

// requireStillBlocked checks the blocked machine: there, not deleting,
// Drained=False, host still Provisioned and bound to it.
func (r *drainRun) requireStillBlocked() {
	r.t.Helper()
	a, err := r.lab.Snapshot(r.ctx, blocked)
	require.NoError(r.t, err)
	if err := stillBlocked(a, r.lab.HostResource(2), r.victimUID); err != nil {
		r.t.Fatalf("%s: %v", blocked, err)
	}
}

func stillBlocked(a *fleet.Snapshot, host, uid string) error {
	m := machineOnHost(a, host)
	switch {
	case m == nil || m.GetMetadata().GetUid() != uid:
		return fmt.Errorf("machine on %s (uid %s) is gone although its drain could not finish", host, uid)
	case m.GetMetadata().GetDeletionTimestamp() != nil:
		return fmt.Errorf("machine %s is being deleted although its drain could not finish", m.GetMetadata().GetName())
	case conditions.Get(m.GetStatus().GetConditions(), clusterplan.MachineDrained).GetStatus() != conditions.False:
		return fmt.Errorf("machine %s: Drained %s, want False", m.GetMetadata().GetName(), conditionText(m, clusterplan.MachineDrained))
	case a.Hosts[host].GetStatus().GetState() != typesv1.HostState_HOST_STATE_PROVISIONED || a.Hosts[host].GetStatus().GetMachine() != m.GetMetadata().GetName():
		return fmt.Errorf("host %s is %s, bound to %q: reset or released although the drain could not finish", host, a.Hosts[host].GetStatus().GetState(), a.Hosts[host].GetStatus().GetMachine())
	}
	return nil
}

// wait polls both clusters every 2 s until done; while holding, every
// poll also checks pdb-a's drain is still blocked.
func (r *drainRun) wait(what string, done func(a, b *fleet.Snapshot) bool) {
	r.t.Helper()
	var last string
	for {
		a, err := r.lab.Snapshot(r.ctx, blocked)
		if err == nil {
			var b *fleet.Snapshot
			b, err = r.lab.Snapshot(r.ctx, busy)
			if err == nil {
				if r.holding {
					r.polls++
					if err := stillBlocked(a, r.lab.HostResource(2), r.victimUID); err != nil {
						r.t.Fatalf("%s while waiting for %s: %v", blocked, what, err)
					}
				}
				if done(a, b) {
					return
				}
				lines := append(a.Lines(), b.Lines()...)
				if s := strings.Join(lines, "\n"); s != last {
					last = s
				}
			}
		}
		select {
		case <-r.ctx.Done():
			r.t.Fatalf("waiting for %s: %v; last state:\n%s\ncontroller log (last lines):\n%s", what, r.ctx.Err(), last, tail(r.lab.ControllerLog(), 40))
		case <-time.After(2 * time.Second):
		}
	}
}

// bootstrapTimes lists when each machine of cluster bootstrapped and
// became NodeReady, by the controller's clock.
func (r *drainRun) bootstrapTimes(cluster string) string {
	s, err := r.lab.Snapshot(r.ctx, cluster)
	require.NoError(r.t, err)
	var parts []string
	for _, n := range sortedNames(s.Machines) {
		st := s.Machines[n].GetStatus()
		if st.GetBootstrapTime() == nil {
			continue
		}
		parts = append(parts, fmt.Sprintf("%s bootstrapped %s, NodeReady %s", n,
			st.GetBootstrapTime().AsTime().UTC().Format(time.TimeOnly), st.GetNodeReadyTime().AsTime().UTC().Format(time.TimeOnly)))
	}
	return strings.Join(parts, "; ")
}

// running reports whether s has exactly n machines, all Running and
// NodeReady.
func running(s *fleet.Snapshot, n int) bool {
	if len(s.Machines) != n {
		return false
	}
	for _, m := range s.Machines {
		if m.GetStatus().GetPhase() != clusterexec.PhaseRunning || !conditions.IsTrue(m.GetStatus().GetConditions(), clusterplan.MachineNodeReady) {
			return false
		}
	}
	return true
}

func machineOnHost(s *fleet.Snapshot, host string) *typesv1.Machine {
	for _, n := range sortedNames(s.Machines) {
		if m := s.Machines[n]; m.GetSpec().GetHost() == host {
			return m
		}
	}
	return nil
}

func conditionText(m *typesv1.Machine, typ string) string {
	c := conditions.Get(m.GetStatus().GetConditions(), typ)
	if c == nil {
		return "(none)"
	}
	return fmt.Sprintf("%s %s: %s", c.GetStatus(), c.GetReason(), c.GetMessage())
}
