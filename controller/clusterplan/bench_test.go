package clusterplan

import (
	"fmt"
	"testing"

	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// fleet is a cluster mid-rollout: a Ready control plane of 3 and a
// deployment of n workers at the old version, with spares spare hosts.
func fleet(n, spares int) *world {
	w := newWorld(t0)
	w.cluster.Spec.KubernetesVersion = "v1.35.0"
	w.cluster.Spec.CertificateRenewalDays = 30
	w.cp = &typesv1.ControlPlane{
		Metadata: &typesv1.ObjectMeta{Name: "cp"},
		Spec:     &typesv1.ControlPlaneSpec{Replicas: 3, Version: "v1.35.0", Image: "new", RolloutMaxSurge: 1},
		Status:   &typesv1.ControlPlaneStatus{Conditions: []*typesv1.Condition{conditions.New(ConditionReady, conditions.True, "", "")}},
	}
	for j := range 3 {
		h := fmt.Sprintf("c%d", j)
		w.addHost(h, map[string]string{"role": "cp"})
		w.makeReady(w.addMachine("cp-"+h, "ControlPlane/cp", RoleControlPlane, h, "v1.35.0", "new"))
	}
	w.mds["md"] = &typesv1.MachineDeployment{
		Metadata: &typesv1.ObjectMeta{Name: "md"},
		Spec: &typesv1.MachineDeploymentSpec{Replicas: int32(n), Version: "v1.35.0", Image: "new", HostSelector: map[string]string{"role": "worker"},
			Strategy: &typesv1.RolloutStrategy{MaxSurge: "10%", MaxUnavailable: "5%"}},
	}
	for j := range n + spares {
		h := fmt.Sprintf("w%d", j)
		w.addHost(h, map[string]string{"role": "worker"})
		if j < n {
			w.makeReady(w.addMachine("md-"+h, "MachineDeployment/md", RoleWorker, h, "v1.34.4", "old"))
		}
	}
	w.hcs["hc"] = &typesv1.HealthCheck{
		Metadata: &typesv1.ObjectMeta{Name: "hc"},
		Spec: &typesv1.HealthCheckSpec{Cluster: "c1", MaxUnhealthy: "40%", UnhealthyConditions: []*typesv1.UnhealthyCondition{
			{Type: MachineNodeReady, Status: "False", Timeout: "5m"}, {Type: MachineNodeReady, Status: "Unknown", Timeout: "5m"}}},
	}
	return w
}

func BenchmarkPlanMachineDeployment(b *testing.B) {
	for _, n := range []int{50, 500} {
		b.Run(fmt.Sprintf("workers=%d", n), func(b *testing.B) {
			w := fleet(n, n/10)
			in := DeploymentInput{Cluster: w.cluster, ControlPlane: w.cp, MachineDeployment: w.mds["md"], Machines: w.machineList(), Hosts: w.hostList(), Images: w.imageList()}
			b.ReportAllocs()
			for b.Loop() {
				PlanMachineDeployment(in, t0)
			}
		})
	}
}

func BenchmarkPlanControlPlane(b *testing.B) {
	w := fleet(500, 50)
	w.cp.Spec.Version = "v1.35.1"
	in := ControlPlaneInput{Cluster: w.cluster, ControlPlane: w.cp, Machines: w.machineList(), Hosts: w.hostList(), Images: w.imageList()}
	b.ReportAllocs()
	for b.Loop() {
		PlanControlPlane(in, t0)
	}
}

func BenchmarkPlanHealthCheck(b *testing.B) {
	w := fleet(500, 0)
	in := HealthCheckInput{HealthCheck: w.hcs["hc"], Machines: w.machineList()}
	b.ReportAllocs()
	for b.Loop() {
		PlanHealthCheck(in, t0)
	}
}

// BenchmarkRollout500 plans and applies a whole 500-worker rollout
// (10% surge, 5% unavailable, 50 spare hosts) to the end.
func BenchmarkRollout500(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		w := fleet(500, 50)
		steps := 0
		for ; steps < 10000; steps++ {
			w.settle()
			p := w.planMD("md")
			if len(p.Actions) == 0 {
				break
			}
			w.apply(p.Actions)
		}
		b.ReportMetric(float64(steps), "plans/rollout")
	}
}
