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
