package clusterplan

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestRollingUpdateKeepsMinimumAvailable rolls random MachineDeployments
// (replicas, maxSurge, maxUnavailable as counts or percentages, 0-3 spare
// hosts) from one version to the next through an executor that applies
// only some of each plan's actions and nodes that become Ready at random
// steps. After every step the available workers (Ready, not draining)
// must be at least replicas-maxUnavailable, and every rollout that can
// progress (a spare host or maxUnavailable > 0) must finish with exactly
// replicas machines, all up to date.
func TestRollingUpdateKeepsMinimumAvailable(t *testing.T) {
	bounds := []string{"", "0", "1", "2", "25%", "50%", "100%"}
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 400 {
		replicas := 1 + rng.IntN(6)
		surge, unav := bounds[rng.IntN(len(bounds))], bounds[rng.IntN(len(bounds))]
		spares := rng.IntN(4)
		name := fmt.Sprintf("%d/replicas=%d,maxSurge=%q,maxUnavailable=%q,spares=%d", i, replicas, surge, unav, spares)
		t.Run(name, func(t *testing.T) {
			w := newWorld(t0)
			w.cluster.Spec.KubernetesVersion = "v1.35.0"
			w.cp = &typesv1.ControlPlane{
				Metadata: &typesv1.ObjectMeta{Name: "cp"},
				Spec:     &typesv1.ControlPlaneSpec{Replicas: 1, Version: "v1.35.0"},
				Status:   &typesv1.ControlPlaneStatus{Conditions: []*typesv1.Condition{conditions.New(ConditionReady, conditions.True, "", "")}},
			}
			st := &typesv1.RolloutStrategy{MaxSurge: surge, MaxUnavailable: unav, NodeDrainTimeout: "5m"}
			w.mds["md"] = &typesv1.MachineDeployment{
				Metadata: &typesv1.ObjectMeta{Name: "md", Generation: 2},
				Spec:     &typesv1.MachineDeploymentSpec{Replicas: int32(replicas), Version: "v1.35.0", Image: "new", HostSelector: map[string]string{"pool": "a"}, Strategy: st},
			}
			for j := range replicas + spares {
				h := fmt.Sprintf("h%d", j)
				w.addHost(h, map[string]string{"pool": "a"})
				if j < replicas {
					w.makeReady(w.addMachine("old-"+h, "MachineDeployment/md", RoleWorker, h, "v1.34.4", "old"))
				}
			}
			b := ResolveBounds(st, replicas)
			minAvail := replicas - b.MaxUnavailable
			progress := spares > 0 || b.MaxUnavailable > 0
			for step := 0; step < 400; step++ {
				p := w.planMD("md")
				var some []Action
				for _, a := range p.Actions {
					if rng.IntN(10) < 7 {
						some = append(some, a)
					}
				}
				w.apply(some)
				for _, m := range w.machineList() {
					if m.Status.NodeName == "" && rng.IntN(2) == 0 {
						w.makeReady(m)
					}
				}
				if got := w.availableWorkers("MachineDeployment/md"); got < minAvail {
					t.Fatalf("step %d: %d available workers after %v, want at least replicas-maxUnavailable = %d", step, got, some, minAvail)
				}
				if len(p.Actions) == 0 && done(w, replicas) {
					return
				}
			}
			if progress {
				t.Fatalf("rollout did not finish in 400 steps: %v", w.machineList())
			}
			// No spare host and maxUnavailable 0: stuck, and saying so.
			if c := conditions.Get(w.mds["md"].Status.Conditions, ConditionUpToDate); c.GetReason() != ReasonRolloutBlocked {
				t.Errorf("stuck rollout: UpToDate = %v, want reason %s", c, ReasonRolloutBlocked)
			}
		})
	}
}

func done(w *world, replicas int) bool {
	n := 0
	for _, m := range w.machines {
		if m.Spec.Owner != "MachineDeployment/md" {
			continue
		}
		if m.Spec.Version != "v1.35.0" || m.Spec.Image != "new" || !(machine{m}).available() {
			return false
		}
		n++
	}
	return n == replicas
}

// TestControlPlaneRolloutKeepsQuorum rolls random control planes (1, 3
// or 5 members, rolloutMaxSurge 0 or 1, 0-2 spare hosts, some etcd
// members unhealthy) to a new version through an executor that applies
// only some actions. It checks every action against the state it is
// applied to: a member is removed only when the healthy members left
// keep quorum of the smaller cluster, a machine is deleted only after its
// member left etcd, a drain or removal never runs on more than one member
// at a time, and a machine is created only when every other is Ready.
func TestControlPlaneRolloutKeepsQuorum(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 300 {
		replicas := []int{1, 3, 5}[rng.IntN(3)]
		surge := rng.IntN(2)
		spares := rng.IntN(3)
		sick := rng.IntN(replicas/2 + 2)
		name := fmt.Sprintf("%d/replicas=%d,surge=%d,spares=%d,unhealthy=%d", i, replicas, surge, spares, sick)
		t.Run(name, func(t *testing.T) {
			w := newWorld(t0)
			w.cluster.Spec.KubernetesVersion = "v1.35.0"
			w.cp = &typesv1.ControlPlane{
				Metadata: &typesv1.ObjectMeta{Name: "cp"},
				Spec:     &typesv1.ControlPlaneSpec{Replicas: int32(replicas), Version: "v1.35.0", Image: "new", RolloutMaxSurge: int32(surge)},
			}
			for j := range replicas + spares {
				h := fmt.Sprintf("h%d", j)
				w.addHost(h, nil)
				if j < replicas {
					m := w.addMachine("cp-"+h, "ControlPlane/cp", RoleControlPlane, h, "v1.34.4", "old")
					w.makeReady(m)
					if j < sick {
						w.setCond(m, MachineEtcdHealthy, conditions.False)
					}
				}
			}
			for step := 0; step < 300; step++ {
				p := w.planCP()
				if len(p.Actions) > 1 {
					t.Fatalf("step %d: %d actions %v, want one at a time", step, len(p.Actions), p.Actions)
				}
				for _, a := range p.Actions {
					if rng.IntN(10) < 3 {
						continue // the executor did not get to it
					}
					checkCPAction(t, w, a)
					w.apply([]Action{a})
				}
				for _, m := range w.machineList() {
					if m.Status.NodeName == "" && rng.IntN(2) == 0 {
						w.makeReady(m)
					}
				}
				if len(p.Actions) == 0 && cpDone(w, replicas) {
					return
				}
			}
			// Healthy members and a way to add one first (or three or
			// more to scale in from) always finish.
			if sick == 0 && (replicas > 1 || surge == 1 && spares > 0) {
				t.Fatalf("a healthy control plane did not finish its rollout: %v\n%v", w.machineList(), w.cp.Status.Conditions)
			}
			// Stuck: it must say why.
			if c := conditions.Get(w.cp.Status.Conditions, ConditionReady); c.GetStatus() == conditions.True {
				t.Fatalf("stuck rollout reports Ready: %v", c)
			}
		})
	}
}

func checkCPAction(t *testing.T, w *world, a Action) {
	t.Helper()
	var ms []machine
	for _, m := range w.machineList() {
		ms = append(ms, machine{m})
	}
	switch a := a.(type) {
	case RemoveEtcdMember:
		n, healthy, victimOK := 0, 0, false
		for _, m := range ms {
			if m.member() == "" {
				continue
			}
			n++
			if m.etcdOK() {
				healthy++
				if m.name() == a.Machine {
					victimOK = true
				}
			}
		}
		left := healthy
		if victimOK {
			left--
		}
		if healthy < n/2+1 || left < (n-1)/2+1 || n == 1 {
			t.Fatalf("%v with %d of %d members healthy breaks quorum", a, healthy, n)
		}
	case DeleteMachine:
		if m := w.machines[a.Machine]; m != nil && m.Status.EtcdMember != "" {
			t.Fatalf("%v while %s is still etcd member %s", a, a.Machine, m.Status.EtcdMember)
		}
	case CreateMachine:
		for _, m := range ms {
			if !m.ready() {
				t.Fatalf("%v while %s is not Ready", a, m.name())
			}
		}
	}
}

func cpDone(w *world, replicas int) bool {
	n := 0
	for _, m := range w.machines {
		if m.Spec.Version != "v1.35.0" || m.Spec.Image != "new" || !(machine{m}).ready() {
			return false
		}
		n++
	}
	return n == replicas
}
