package clusterplan

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestPlanClusterStatus(t *testing.T) {
	now := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	meta := func(n string) *typesv1.ObjectMeta { return &typesv1.ObjectMeta{Name: n, Generation: 1} }
	cond := func(t, s, msg string) *typesv1.Condition { return conditions.New(t, s, "R", msg) }
	cpReady := &typesv1.ControlPlane{Metadata: meta("cp"), Status: &typesv1.ControlPlaneStatus{Conditions: []*typesv1.Condition{cond(ConditionReady, "True", "1 of 1 members Ready")}}}
	cpDown := &typesv1.ControlPlane{Metadata: meta("cp"), Status: &typesv1.ControlPlaneStatus{Conditions: []*typesv1.Condition{cond(ConditionReady, "False", "0 of 1 members Ready")}}}
	md := func(ready, updated int32) *typesv1.MachineDeployment {
		return &typesv1.MachineDeployment{Metadata: meta("workers"), Spec: &typesv1.MachineDeploymentSpec{Cluster: "lab", Replicas: 2},
			Status: &typesv1.MachineDeploymentStatus{ReadyReplicas: ready, UpdatedReplicas: updated}}
	}
	machine := func(name string, conds ...*typesv1.Condition) *typesv1.Machine {
		return &typesv1.Machine{Metadata: meta(name), Spec: &typesv1.MachineSpec{Cluster: "lab"}, Status: &typesv1.MachineStatus{Conditions: conds}}
	}
	ok := func(name string) *typesv1.Machine {
		return machine(name, cond(MachineNodeReady, "True", ""), cond(MachineClusterDNSResolves, "True", ""))
	}
	deleting := ok("gone")
	deleting.Metadata.DeletionTimestamp = timestamppb.New(now)
	deleting.Status.Conditions = nil
	other := machine("other-cluster")
	other.Spec.Cluster = "prod"
	initialised := &typesv1.ClusterStatus{CaHash: "sha256:abc", Topology: &typesv1.ClusterTopologyStatus{ClassRevision: 1, ReconciledRevision: 1, Version: "v1.34.4"}}

	for _, tc := range []struct {
		name       string
		status     *typesv1.ClusterStatus
		in         ClusterInput
		wantPhase  string
		wantStatus string
		wantReason string
		wantMsg    string
	}{
		{"no control plane", nil, ClusterInput{}, ClusterProvisioning, "False", ReasonNoControlPlane, "has no ControlPlane"},
		{"control plane not ready before init", nil, ClusterInput{ControlPlanes: []*typesv1.ControlPlane{cpDown}}, ClusterProvisioning, "False", ReasonControlPlaneDown, "control plane cp: 0 of 1 members Ready"},
		{"workers not ready", initialised, ClusterInput{ControlPlanes: []*typesv1.ControlPlane{cpReady}, MachineDeployments: []*typesv1.MachineDeployment{md(1, 2)}},
			ClusterNotReady, "False", ReasonWorkersNotReady, "workers: 1 of 2 Ready, 2 up to date"},
		{"workers outdated", initialised, ClusterInput{ControlPlanes: []*typesv1.ControlPlane{cpReady}, MachineDeployments: []*typesv1.MachineDeployment{md(2, 1)}},
			ClusterNotReady, "False", ReasonWorkersNotReady, "2 of 2 Ready, 1 up to date"},
		{"node not ready", initialised, ClusterInput{ControlPlanes: []*typesv1.ControlPlane{cpReady}, MachineDeployments: []*typesv1.MachineDeployment{md(2, 2)},
			Machines: []*typesv1.Machine{ok("a"), machine("b", cond(MachineNodeReady, "False", ""))}}, ClusterNotReady, "False", ReasonMachinesNotReady, "node not Ready: b"},
		{"ready nodes but DNS fails", initialised, ClusterInput{ControlPlanes: []*typesv1.ControlPlane{cpReady}, MachineDeployments: []*typesv1.MachineDeployment{md(2, 2)},
			Machines: []*typesv1.Machine{ok("a"), machine("b", cond(MachineNodeReady, "True", ""), cond(MachineClusterDNSResolves, "False", "no answer from 10.96.0.10:53"))}},
			ClusterNotReady, "False", ReasonClusterDNSFailing, "cluster DNS does not resolve on: b (no answer from 10.96.0.10:53)"},
		{"ready", initialised, ClusterInput{ControlPlanes: []*typesv1.ControlPlane{cpReady}, MachineDeployments: []*typesv1.MachineDeployment{md(2, 2)},
			Machines: []*typesv1.Machine{ok("a"), ok("b"), ok("c"), deleting, other}}, ClusterReady, "True", ReasonAsExpected, "3 machines Ready"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.in.Cluster = &typesv1.Cluster{Metadata: meta("lab"), Status: tc.status}
			got := PlanClusterStatus(tc.in, now)
			if got.GetPhase() != tc.wantPhase {
				t.Errorf("PlanClusterStatus(%s).Phase = %q, want %q", tc.name, got.GetPhase(), tc.wantPhase)
			}
			c := conditions.Get(got.GetConditions(), ConditionReady)
			if c == nil {
				t.Fatalf("PlanClusterStatus(%s): no Ready condition", tc.name)
			}
			if c.GetStatus() != tc.wantStatus || c.GetReason() != tc.wantReason || !strings.Contains(c.GetMessage(), tc.wantMsg) {
				t.Errorf("PlanClusterStatus(%s) Ready = %s/%s %q, want %s/%s containing %q", tc.name, c.GetStatus(), c.GetReason(), c.GetMessage(), tc.wantStatus, tc.wantReason, tc.wantMsg)
			}
			if got.GetCaHash() != tc.status.GetCaHash() {
				t.Errorf("PlanClusterStatus(%s).CaHash = %q, want it kept (%q)", tc.name, got.GetCaHash(), tc.status.GetCaHash())
			}
			if !proto.Equal(got.GetTopology(), tc.status.GetTopology()) {
				t.Errorf("PlanClusterStatus(%s).Topology = %v, want it kept (%v)", tc.name, got.GetTopology(), tc.status.GetTopology())
			}
		})
	}
}
