package fleet_test

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/kilnhq/kiln/controller/clusterplan"
	"github.com/kilnhq/kiln/e2e/fleet"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/internal/conditions"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// The lab cluster of examples/lab-cluster.yaml: one control plane, two
// workers, on a rack of four hosts (three Redfish, one IPMI).
const (
	clusterName = "lab"
	cpName      = "lab-cp"
	mdName      = "lab-workers"
	hcName      = "lab-workers-health"
)

// provisioningSteps are the host steps and machine phases the controller
// is killed at during the provisioning wave, at most once each.
var provisioningSteps = []string{
	"PowerOff", "BootAgentMedia", "PowerOn", "WaitBootAgent", "LayImage",
	"WriteIdentity", "BootDisk", "WaitInstalledAgent", "machine/Bootstrapping",
}

// TestLabLifecycle is the fleet lifecycle on a lab rack, end to end, with
// the real controller, agents, BMC emulators and kubeadm, in one lab
// (each phase builds on the last):
//
//   - bad input (a pod CIDR over the lab network, an even control plane, a
//     skipped minor) is refused at apply time and changes nothing;
//   - provisioning: four powered-off hosts (Redfish virtual media, IPMI
//     PXE) become 1 control plane + 2 workers, Ready, answering cluster
//     DNS, checked with kubectl, while the controller is killed with
//     SIGKILL at five or more steps of the wave and restarted: every host
//     is laid exactly once; and one host's BMC fails (HTTP 503) for a
//     while: that host reports it and recovers, the others are not held up;
//   - rollout to a new image: control plane first (etcd 1→2→1, never
//     below 1), then workers, never fewer than replicas - maxUnavailable
//     Ready;
//   - remediation: a worker whose kubelet stops is reimaged and rejoins;
//   - storm guard: with most workers unhealthy at once nothing is
//     remediated and the HealthCheck says why.
func TestLabLifecycle(t *testing.T) {
	needLab(t)
	// End before go test's -timeout does, so that the lab is taken down.
	end := time.Now().Add(80 * time.Minute)
	if d, ok := t.Deadline(); ok && d.Add(-3*time.Minute).Before(end) {
		end = d.Add(-3 * time.Minute)
	}
	ctx, cancel := context.WithDeadline(context.Background(), end)
	defer cancel()
	lab, tag := startLab(t, ctx)
	st, err := lab.Snapshot(ctx, clusterName)
	require.NoError(t, err)
	require.Empty(t, st.Hosts, "no host registered yet")
	faulty := lab.HostResource(2)

	t.Run("bad input is refused at apply", func(t *testing.T) {
		badInput(t, ctx, lab, tag)
	})

	// h2's BMC fails every request before the hosts register.
	require.NoError(t, lab.SetBMCFaults(ctx, faulty, `{"failNext":1000000,"failStatus":503}`))
	require.NoError(t, lab.RegisterHosts(ctx))

	if !t.Run("provisioning survives crashes and a failing BMC", func(t *testing.T) {
		provision(t, ctx, lab, tag, faulty)
	}) {
		t.FailNow()
	}
	if !t.Run("rollout to a new image", func(t *testing.T) {
		rollout(t, ctx, lab, tag)
	}) {
		t.FailNow()
	}
	if !t.Run("remediation reimages a worker whose kubelet stopped", func(t *testing.T) {
		remediate(t, ctx, lab)
	}) {
		t.FailNow()
	}
	t.Run("storm guard: most workers unhealthy, none remediated", func(t *testing.T) {
		stormGuard(t, ctx, lab)
	})
}

func badInput(t *testing.T, ctx context.Context, lab *fleet.Lab, tag string) {
	docs := splitDocs(t, labCluster(t, lab, ""))
	pfx := lab.Subnet()
	overlapping := strings.Join(strings.Split(pfx, ".")[:2], ".") + ".0.0/16" // e.g. 10.251.0.0/16 over the lab's /24
	for _, tc := range []struct {
		name   string
		kind   string
		change func(spec map[string]any)
		want   string
	}{
		{"pod CIDR over the lab network", "Cluster", func(s map[string]any) { s["podCidr"] = overlapping }, "overlaps host network " + pfx},
		{"even control plane", "ControlPlane", func(s map[string]any) { s["replicas"] = 2 }, "2 is even"},
	} {
		var batch []map[string]any
		for _, d := range docs {
			d = clone(t, d)
			if d["kind"] == tc.kind {
				tc.change(d["spec"].(map[string]any))
			}
			batch = append(batch, d)
		}
		out, err := lab.Kilnctl(ctx, joinDocs(t, batch), "apply", "-f", "-")
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("kilnctl apply (%s) = %v, %q; want an error containing %q", tc.name, err, out, tc.want)
		}
	}
	s, err := lab.Snapshot(ctx, clusterName)
	require.NoError(t, err)
	require.Nil(t, s.Cluster, "a refused apply stored the cluster")
	require.Empty(t, s.ControlPlanes, "a refused apply stored a control plane")
	require.Empty(t, s.MachineDeployments, "a refused apply stored a deployment")
}

// crasher kills the controller with SIGKILL the first time it sees each
// provisioning step, and starts it again.
type crasher struct {
	t      *testing.T
	ctx    context.Context
	lab    *fleet.Lab
	max    int
	killed []string
}

func (c *crasher) observe(s *fleet.Snapshot) {
	if len(c.killed) >= c.max {
		return
	}
	// A point is a step of one host (or a phase of one machine); steps
	// not killed at yet come first.
	type point struct{ who, step string }
	var seen []point
	for _, n := range sortedNames(s.Hosts) {
		if h := s.Hosts[n]; h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_PROVISIONING {
			seen = append(seen, point{n, h.GetStatus().GetProvisioningStep()})
		}
	}
	for _, n := range sortedNames(s.Machines) {
		seen = append(seen, point{n, "machine/" + s.Machines[n].GetStatus().GetPhase()})
	}
	slices.SortStableFunc(seen, func(a, b point) int {
		return btoi(c.steps()[a.step]) - btoi(c.steps()[b.step])
	})
	for _, p := range seen {
		key := p.who + " " + p.step
		if !slices.Contains(provisioningSteps, p.step) || slices.Contains(c.killed, key) {
			continue
		}
		c.killed = append(c.killed, key)
		c.t.Logf("kill -9 of the controller at %s (%d)", key, len(c.killed))
		require.NoError(c.t, c.lab.KillController())
		require.NoError(c.t, c.lab.StartController(c.ctx))
		return
	}
}

// steps are the distinct steps killed at so far.
func (c *crasher) steps() map[string]bool {
	m := map[string]bool{}
	for _, k := range c.killed {
		m[k[strings.LastIndex(k, " ")+1:]] = true
	}
	return m
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

func provision(t *testing.T, ctx context.Context, lab *fleet.Lab, tag, faulty string) {
	// The shipped example, unmodified but for the lab's API endpoint: its
	// imageSelector finds the lab image whatever the date in its tag.
	_, err := lab.Kilnctl(ctx, labCluster(t, lab, ""), "apply", "-f", "-")
	require.NoError(t, err)
	crash := &crasher{t: t, ctx: ctx, lab: lab, max: 7}
	var bmcDown, cpReadyWhileDown, cleared bool
	s, err := lab.Watch(ctx, clusterName, 2*time.Second, func(s *fleet.Snapshot) bool {
		h := s.Hosts[faulty]
		if !cleared {
			if c := conditions.Get(h.GetStatus().GetConditions(), "BMCReachable"); c.GetStatus() == conditions.False {
				bmcDown = true
			}
			if cp := s.ControlPlanes[cpName]; bmcDown && cp.GetStatus().GetReadyReplicas() == 1 {
				// The others went on while h2's BMC failed: heal it.
				cpReadyWhileDown = true
				require.NoError(t, lab.SetBMCFaults(ctx, faulty, ""))
				cleared = true
			}
		}
		crash.observe(s)
		return s.Ready() && cleared && conditions.IsTrue(h.GetStatus().GetConditions(), "BMCReachable") &&
			h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_AVAILABLE
	})
	require.NoError(t, err)
	require.True(t, bmcDown, "host %s never reported BMCReachable=False while its BMC failed", faulty)
	require.True(t, cpReadyWhileDown, "the control plane was not Ready while %s's BMC failed: the others were held up", faulty)
	require.GreaterOrEqual(t, len(crash.killed), 5, "the controller was killed at %v: want at least 5 points", crash.killed)
	require.GreaterOrEqual(t, len(crash.steps()), 3, "the controller was killed at %v: want at least 3 different steps", crash.killed)

	res, err := lab.Client(ctx)
	require.NoError(t, err)
	roles := map[string]int{}
	for name, m := range s.Machines {
		roles[m.GetSpec().GetRole()]++
		requireWorking(t, m)
		h := s.Hosts[m.GetSpec().GetHost()]
		require.NotNil(t, h, "machine %s: host %s", name, m.GetSpec().GetHost())
		hn := h.GetMetadata().GetName()
		require.Equal(t, typesv1.HostState_HOST_STATE_PROVISIONED, h.GetStatus().GetState(), "host %s", hn)
		require.Equal(t, tag, h.GetStatus().GetImage(), "host %s: image", hn)
		// Laid exactly once: the host's count and its events agree.
		require.EqualValues(t, 1, h.GetStatus().GetImageLays(), "host %s: image lays", hn)
		evs, err := res.ListEvents(ctx, &controllerv1.ListEventsRequest{ObjectKind: "Host", ObjectName: hn})
		require.NoError(t, err)
		laid := 0
		for _, ev := range evs.GetEvents() {
			if ev.GetReason() == "ImageLaid" {
				laid++
			}
		}
		require.Equal(t, 1, laid, "host %s: ImageLaid events", hn)
	}
	require.Equal(t, map[string]int{"control-plane": 1, "worker": 2}, roles)
	require.NotContains(t, hostsOf(s), faulty, "the host whose BMC failed got a machine")
	requireKubectlNodes(t, ctx, lab, 3)

	// Bad input judged against what is stored: a control plane at v1.34
	// cannot go to v1.36 in one step. Nothing changes.
	var docs []map[string]any
	for _, d := range splitDocs(t, labCluster(t, lab, "")) {
		if d["kind"] == "ControlPlane" {
			d["spec"].(map[string]any)["version"] = "v1.36.0"
			docs = append(docs, d)
		}
	}
	out, err := lab.Kilnctl(ctx, joinDocs(t, docs), "apply", "-f", "-")
	if err == nil || !strings.Contains(err.Error(), "skips v1.35") {
		t.Errorf("kilnctl apply (control plane v1.34.4 -> v1.36.0) = %v, %q; want an error containing %q", err, out, "skips v1.35")
	}
	after, err := lab.Snapshot(ctx, clusterName)
	require.NoError(t, err)
	require.Equal(t, s.ControlPlanes[cpName].GetSpec().GetVersion(), after.ControlPlanes[cpName].GetSpec().GetVersion(), "a refused apply changed the control plane")
	require.Equal(t, s.ControlPlanes[cpName].GetMetadata().GetGeneration(), after.ControlPlanes[cpName].GetMetadata().GetGeneration(), "a refused apply changed the control plane")
}

// requireWorking checks what a user checks of a machine: its node is
// Ready and answers a real cluster DNS query.
func requireWorking(t *testing.T, m *typesv1.Machine) {
	t.Helper()
	for _, c := range []string{clusterplan.MachineNodeReady, clusterplan.MachineClusterDNSResolves} {
		require.True(t, conditions.IsTrue(m.GetStatus().GetConditions(), c), "machine %s: %s not True: %v", m.GetMetadata().GetName(), c, conditions.Get(m.GetStatus().GetConditions(), c))
	}
}

// requireKubectlNodes checks with kubectl and the kubeconfig kilnctl
// hands out that want nodes are Ready.
func requireKubectlNodes(t *testing.T, ctx context.Context, lab *fleet.Lab, want int) {
	t.Helper()
	kc := filepath.Join(t.TempDir(), "kubeconfig")
	_, err := lab.Kilnctl(ctx, nil, "kubeconfig", clusterName, "-o", kc)
	require.NoError(t, err)
	kubectl := filepath.Join(rootfs.CacheRoot(), "kube-tools", kubetools.Pinned().Kubernetes, "bin", "kubectl")
	// The kubelets report to the API server on their own schedule: a node
	// the controller has just seen Ready may lag in kubectl's view (or the
	// API server may just have moved), so ask again for up to 90 s.
	var out []byte
	ready := 0
	deadline := time.Now().Add(90 * time.Second)
	for {
		out, err = exec.CommandContext(ctx, kubectl, "--kubeconfig", kc, "get", "nodes", "--no-headers").CombinedOutput()
		ready = 0
		if err == nil {
			for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
				if f := strings.Fields(line); len(f) > 1 && f[1] == "Ready" {
					ready++
				}
			}
		}
		if (err == nil && ready == want) || time.Now().After(deadline) || ctx.Err() != nil {
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(3 * time.Second):
		}
	}
	require.NoError(t, err, "kubectl get nodes: %s", out)
	require.Equal(t, want, ready, "kubectl get nodes:\n%s", out)
}

func hostsOf(s *fleet.Snapshot) []string {
	var hs []string
	for _, m := range s.Machines {
		hs = append(hs, m.GetSpec().GetHost())
	}
	return hs
}

// availableWorkers counts the workers that are Ready, and those whose
// NodeReady is Unknown after having been seen Ready: while the control
// plane moves from one host to another the controller cannot read the
// Nodes for a while and says Unknown, which is not a worker going away
// (a drained or reimaged worker is False or deleted).
func availableWorkers(s *fleet.Snapshot, seenReady map[string]bool) int {
	n := 0
	for _, m := range s.Machines {
		if m.GetSpec().GetRole() != clusterplan.RoleWorker || m.GetMetadata().GetDeletionTimestamp() != nil {
			continue
		}
		uid := m.GetMetadata().GetUid()
		c := conditions.Get(m.GetStatus().GetConditions(), clusterplan.MachineNodeReady)
		switch {
		case c == nil:
		case c.GetStatus() == conditions.True:
			seenReady[uid] = true
			n++
		case c.GetStatus() == conditions.Unknown && seenReady[uid]:
			n++
		}
	}
	return n
}

func rollout(t *testing.T, ctx context.Context, lab *fleet.Lab, tag string) {
	// The same bits under a new tag: a new image as far as the fleet is
	// concerned (CI has no time for a second build).
	tag2 := tag + "-r2"
	img := map[string]any{}
	b, err := lab.Kilnctl(ctx, nil, "get", "image", tag, "-o", "yaml")
	require.NoError(t, err)
	require.NoError(t, yaml.Unmarshal([]byte(b), &img))
	// Its labels too (os, kubernetes), and a later patch level: the
	// newest image the shipped imageSelector matches.
	meta, _ := img["metadata"].(map[string]any)
	img["metadata"] = map[string]any{"name": tag2, "labels": meta["labels"]}
	if spec, ok := img["spec"].(map[string]any); ok {
		spec["patchLevel"] = "99991231"
	}
	delete(img, "status")
	out, err := yaml.Marshal(img)
	require.NoError(t, err)
	before, err := lab.Snapshot(ctx, clusterName)
	require.NoError(t, err)
	_, err = lab.Kilnctl(ctx, out, "apply", "-f", "-")
	require.NoError(t, err)

	// A newer image rolls nothing while the spec names images by labels:
	// once both planners have planned with it in view (the image their
	// status resolved is the new one), they still count every machine up
	// to date (a replacement is planned only for an outdated machine, in
	// the pass that stores that status), and every machine is the one it
	// was.
	unchanged, err := lab.Watch(ctx, clusterName, time.Second, func(s *fleet.Snapshot) bool {
		c := conditions.Get(s.ControlPlanes[cpName].GetStatus().GetConditions(), clusterplan.ConditionImageResolved)
		return c != nil && strings.Contains(c.GetMessage(), tag2) &&
			s.ControlPlanes[cpName].GetStatus().GetImage() == tag2 && s.MachineDeployments[mdName].GetStatus().GetImage() == tag2
	})
	require.NoError(t, err)
	cp, md := unchanged.ControlPlanes[cpName], unchanged.MachineDeployments[mdName]
	require.Equal(t, cp.GetSpec().GetReplicas(), cp.GetStatus().GetUpdatedReplicas(), "control plane: machines up to date once it resolved %s", tag2)
	require.Equal(t, md.GetSpec().GetReplicas(), md.GetStatus().GetUpdatedReplicas(), "workers: machines up to date once they resolved %s", tag2)
	for name, m := range before.Machines {
		now := unchanged.Machines[name]
		require.NotNil(t, now, "machine %s went away after a newer image appeared", name)
		require.Equal(t, m.GetMetadata().GetUid(), now.GetMetadata().GetUid(), "machine %s was replaced after a newer image appeared", name)
		require.Equal(t, tag, now.GetSpec().GetImage(), "machine %s records the image it was laid with", name)
	}
	require.Len(t, unchanged.Machines, len(before.Machines))
	var docs []map[string]any
	for _, d := range splitDocs(t, labCluster(t, lab, tag2)) {
		if d["kind"] == "ControlPlane" {
			d["spec"].(map[string]any)["rolloutMaxSurge"] = 1 // 1→2→1 onto the spare host
		}
		docs = append(docs, d)
	}
	_, err = lab.Kilnctl(ctx, joinDocs(t, docs), "apply", "-f", "-")
	require.NoError(t, err)

	maxEtcd, minEtcd := int32(0), int32(99)
	minReady := 99
	seenReady := map[string]bool{} // worker machine uid → seen NodeReady=True
	var cpNewReady, firstNewWorker time.Time
	s, err := lab.Watch(ctx, clusterName, 2*time.Second, func(s *fleet.Snapshot) bool {
		if cp := s.ControlPlanes[cpName]; cp != nil {
			n := cp.GetStatus().GetEtcdMembers()
			maxEtcd, minEtcd = max(maxEtcd, n), min(minEtcd, n)
		}
		minReady = min(minReady, availableWorkers(s, seenReady))
		now := time.Now()
		for _, m := range s.Machines {
			if m.GetSpec().GetImage() != tag2 {
				continue
			}
			switch m.GetSpec().GetRole() {
			case clusterplan.RoleControlPlane:
				if cpNewReady.IsZero() && conditions.IsTrue(m.GetStatus().GetConditions(), clusterplan.MachineNodeReady) {
					cpNewReady = now
				}
			case clusterplan.RoleWorker:
				if firstNewWorker.IsZero() {
					firstNewWorker = now
				}
			}
		}
		if !s.Ready() || len(s.Machines) != 3 {
			return false
		}
		for _, m := range s.Machines {
			if m.GetSpec().GetImage() != tag2 {
				return false
			}
		}
		return true
	})
	require.NoError(t, err)
	for name, m := range s.Machines {
		requireWorking(t, m)
		// A reimaged host's new machine may have the old one's name (the
		// deployment's name and the host's): a new uid says it is new.
		if old := before.Machines[name]; old != nil {
			require.NotEqual(t, old.GetMetadata().GetUid(), m.GetMetadata().GetUid(), "machine %s was not replaced", name)
		}
		require.Equal(t, tag2, s.Hosts[m.GetSpec().GetHost()].GetStatus().GetImage(), "host of %s", name)
	}
	require.EqualValues(t, 2, maxEtcd, "etcd members went up to %d during the control-plane rollout, want 2 (1→2→1)", maxEtcd)
	require.GreaterOrEqual(t, minEtcd, int32(1), "etcd lost its only member during the rollout")
	require.EqualValues(t, 1, s.ControlPlanes[cpName].GetStatus().GetEtcdMembers(), "etcd members after the rollout")
	require.GreaterOrEqual(t, minReady, 1, "Ready workers dropped to %d, below replicas 2 - maxUnavailable 1", minReady)
	require.False(t, cpNewReady.IsZero() || firstNewWorker.IsZero(), "no new control plane (%v) or worker (%v) seen", cpNewReady, firstNewWorker)
	require.False(t, firstNewWorker.Before(cpNewReady), "a worker moved to the new image (%s) before the new control plane was Ready (%s)", firstNewWorker.Format(time.TimeOnly), cpNewReady.Format(time.TimeOnly))
	requireKubectlNodes(t, ctx, lab, 3)
}

func applyHealthCheck(t *testing.T, ctx context.Context, lab *fleet.Lab, maxUnhealthy string) {
	t.Helper()
	hc := fmt.Sprintf(`apiVersion: kiln.dev/v1
kind: HealthCheck
metadata:
  name: %s
spec:
  cluster: %s
  selector:
    role: worker
  unhealthyConditions:
    - {type: NodeReady, status: "False", timeout: 30s}
    - {type: NodeReady, status: Unknown, timeout: 30s}
  nodeStartupTimeout: 10m
  maxUnhealthy: "%s"
`, hcName, clusterName, maxUnhealthy)
	_, err := lab.Kilnctl(ctx, []byte(hc), "apply", "-f", "-")
	require.NoError(t, err)
}

func workers(s *fleet.Snapshot) []*typesv1.Machine {
	var ws []*typesv1.Machine
	for _, n := range sortedNames(s.Machines) {
		if m := s.Machines[n]; m.GetSpec().GetRole() == clusterplan.RoleWorker {
			ws = append(ws, m)
		}
	}
	return ws
}

// hasUID reports whether a machine with uid exists.
func hasUID(s *fleet.Snapshot, uid string) bool {
	for _, m := range s.Machines {
		if m.GetMetadata().GetUid() == uid {
			return true
		}
	}
	return false
}

func sortedNames[V any](m map[string]V) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

func remediate(t *testing.T, ctx context.Context, lab *fleet.Lab) {
	applyHealthCheck(t, ctx, lab, "1")
	before, err := lab.Snapshot(ctx, clusterName)
	require.NoError(t, err)
	victim := workers(before)[0]
	host := victim.GetSpec().GetHost()
	lays := before.Hosts[host].GetStatus().GetImageLays()
	_, err = lab.NodeExec(ctx, host, "systemctl", "stop", "kubelet")
	require.NoError(t, err)
	t.Logf("kubelet stopped on %s (machine %s)", host, victim.GetMetadata().GetName())
	s, err := lab.Watch(ctx, clusterName, 2*time.Second, func(s *fleet.Snapshot) bool {
		return s.Ready() && !hasUID(s, victim.GetMetadata().GetUid()) && len(workers(s)) == 2
	})
	require.NoError(t, err)
	for _, m := range workers(s) {
		requireWorking(t, m)
	}
	// The victim's host was wiped: laid again for the replacement, or
	// Available with no image when the replacement took the spare host.
	st := s.Hosts[host].GetStatus()
	reimaged := st.GetImageLays() > lays
	spare := st.GetState() == typesv1.HostState_HOST_STATE_AVAILABLE && st.GetImage() == "" && st.GetMachine() == ""
	require.True(t, reimaged || spare, "host %s was neither reimaged (lays %d, before %d) nor wiped to Available: %s image=%q machine=%q",
		host, st.GetImageLays(), lays, st.GetState(), st.GetImage(), st.GetMachine())
	requireKubectlNodes(t, ctx, lab, 3)
}

func stormGuard(t *testing.T, ctx context.Context, lab *fleet.Lab) {
	applyHealthCheck(t, ctx, lab, "40%")
	before, err := lab.Snapshot(ctx, clusterName)
	require.NoError(t, err)
	ws := workers(before)
	require.Len(t, ws, 2)
	for _, m := range ws {
		_, err := lab.NodeExec(ctx, m.GetSpec().GetHost(), "systemctl", "stop", "kubelet")
		require.NoError(t, err)
	}
	var blockedAt time.Time
	s, err := lab.Watch(ctx, clusterName, 2*time.Second, func(s *fleet.Snapshot) bool {
		for _, m := range ws {
			if x := s.Machines[m.GetMetadata().GetName()]; x == nil || x.GetMetadata().GetUid() != m.GetMetadata().GetUid() || x.GetMetadata().GetDeletionTimestamp() != nil {
				t.Fatalf("machine %s was remediated although 2 of 2 workers were unhealthy (maxUnhealthy 40%%)", m.GetMetadata().GetName())
			}
		}
		c := conditions.Get(s.HealthChecks[hcName].GetStatus().GetConditions(), clusterplan.ConditionRemediationAllowed)
		if c.GetStatus() == conditions.False && blockedAt.IsZero() {
			blockedAt = time.Now()
		}
		// Keep watching a while after the guard closed: nothing moves.
		return !blockedAt.IsZero() && time.Since(blockedAt) > 45*time.Second
	})
	require.NoError(t, err)
	c := conditions.Get(s.HealthChecks[hcName].GetStatus().GetConditions(), clusterplan.ConditionRemediationAllowed)
	require.Equal(t, "TooManyUnhealthy", c.GetReason(), "RemediationAllowed: %v", c)
	require.Contains(t, c.GetMessage(), "exceeds maxUnhealthy 40%")
	for _, m := range ws {
		_, err := lab.NodeExec(ctx, m.GetSpec().GetHost(), "systemctl", "start", "kubelet")
		require.NoError(t, err)
	}
	_, err = lab.Watch(ctx, clusterName, 2*time.Second, (*fleet.Snapshot).Ready)
	require.NoError(t, err)
}

func splitDocs(t *testing.T, b []byte) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, d := range strings.Split(string(b), "---\n") {
		if strings.TrimSpace(d) == "" {
			continue
		}
		var r map[string]any
		require.NoError(t, yaml.Unmarshal([]byte(d), &r))
		out = append(out, r)
	}
	return out
}

func joinDocs(t *testing.T, docs []map[string]any) []byte {
	t.Helper()
	var parts []string
	for _, d := range docs {
		b, err := yaml.Marshal(d)
		require.NoError(t, err)
		parts = append(parts, string(b))
	}
	return []byte(strings.Join(parts, "---\n"))
}

func clone(t *testing.T, d map[string]any) map[string]any {
	t.Helper()
	b, err := yaml.Marshal(d)
	require.NoError(t, err)
	var out map[string]any
	require.NoError(t, yaml.Unmarshal(b, &out))
	return out
}
