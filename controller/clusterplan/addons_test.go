package clusterplan

import (
	"testing"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func addonMachine(name, role, version string, ready bool) *typesv1.Machine {
	m := &typesv1.Machine{Metadata: &typesv1.ObjectMeta{Name: name},
		Spec:   &typesv1.MachineSpec{Cluster: "c1", Role: role, Version: version, Image: "img-" + version},
		Status: &typesv1.MachineStatus{Conditions: []*typesv1.Condition{conditions.New(MachineBootstrapped, conditions.True, "Kubeadm", "")}}}
	if ready {
		m.Status.Conditions = append(m.Status.Conditions, conditions.New(MachineNodeReady, conditions.True, "KubeletReady", ""))
	}
	return m
}

// TestPlanAddons: the addon step is due once the newest control-plane
// version is Ready while older machines remain, and not once the Cluster's
// status records it.
func TestPlanAddons(t *testing.T) {
	oldCP := addonMachine("cp-old", RoleControlPlane, "v1.33.13", true)
	newCP := addonMachine("cp-new", RoleControlPlane, "v1.34.4", true)
	newNotReady := addonMachine("cp-new", RoleControlPlane, "v1.34.4", false)
	deleting := addonMachine("cp-new", RoleControlPlane, "v1.34.4", true)
	deleting.Metadata.DeletionTimestamp = timestamppb.Now()
	cluster := func(addons *typesv1.ClusterAddons) *typesv1.Cluster {
		return &typesv1.Cluster{Metadata: &typesv1.ObjectMeta{Name: "c1"}, Status: &typesv1.ClusterStatus{Addons: addons}}
	}
	for _, tc := range []struct {
		name     string
		c        *typesv1.Cluster
		ms       []*typesv1.Machine
		want     UpgradeAddons
		wantStep bool
	}{
		{name: "new member Ready, old remains", c: cluster(nil), ms: []*typesv1.Machine{oldCP, newCP},
			want: UpgradeAddons{Version: "v1.34.4", Image: "img-v1.34.4"}, wantStep: true},
		{name: "recorded done", c: cluster(&typesv1.ClusterAddons{Version: "v1.34.4"}), ms: []*typesv1.Machine{oldCP, newCP}},
		{name: "recorded for an older upgrade", c: cluster(&typesv1.ClusterAddons{Version: "v1.33.13"}), ms: []*typesv1.Machine{oldCP, newCP},
			want: UpgradeAddons{Version: "v1.34.4", Image: "img-v1.34.4"}, wantStep: true},
		{name: "new member not Ready", c: cluster(nil), ms: []*typesv1.Machine{oldCP, newNotReady}},
		{name: "new member deleting", c: cluster(nil), ms: []*typesv1.Machine{oldCP, deleting}},
		{name: "no older machine", c: cluster(nil), ms: []*typesv1.Machine{newCP}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := PlanAddons(tc.c, tc.ms)
			if ok != tc.wantStep || got != tc.want {
				t.Errorf("PlanAddons(%s) = %+v, %v, want %+v, %v", tc.name, got, ok, tc.want, tc.wantStep)
			}
		})
	}
}

// TestPlanKubeadmConfig: kubeadm-config moves before the first newer
// member joins, and not again once recorded.
func TestPlanKubeadmConfig(t *testing.T) {
	oldCP := addonMachine("cp-old", RoleControlPlane, "v1.33.13", true)
	joining := addonMachine("cp-new", RoleControlPlane, "v1.34.4", false)
	joining.Status.Conditions = nil
	for _, tc := range []struct {
		name   string
		addons *typesv1.ClusterAddons
		ms     []*typesv1.Machine
		want   string
		wantOK bool
	}{
		{name: "older member runs", ms: []*typesv1.Machine{oldCP, joining}, want: "v1.34.4", wantOK: true},
		{name: "recorded done", addons: &typesv1.ClusterAddons{KubeadmConfigVersion: "v1.34.4"}, ms: []*typesv1.Machine{oldCP, joining}},
		{name: "first version (init's own)", ms: []*typesv1.Machine{joining}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &typesv1.Cluster{Metadata: &typesv1.ObjectMeta{Name: "c1"}, Status: &typesv1.ClusterStatus{Addons: tc.addons}}
			got, ok := PlanKubeadmConfig(c, tc.ms, joining)
			if ok != tc.wantOK || got != tc.want {
				t.Errorf("PlanKubeadmConfig(%s) = %q, %v, want %q, %v", tc.name, got, ok, tc.want, tc.wantOK)
			}
		})
	}
}
