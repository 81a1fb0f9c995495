package clusterplan

import (
	"k8s.io/apimachinery/pkg/util/version"

	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// MachineBootstrapped is True once the machine's kubeadm init or join
// succeeded (set by the executor).
const MachineBootstrapped = "Bootstrapped"

// UpgradeAddons moves the cluster's kube-proxy DaemonSet and CoreDNS
// Deployment to the release of Version, whose recipe is in Image (the
// Image of the member that runs it), as `kubeadm upgrade apply`'s addon
// phase does. The executor records Version in
// Cluster.status.addons.version once done.
type UpgradeAddons struct {
	Version string
	Image   string
}

// machineVersion is the Kubernetes version m runs (its own, else its
// cluster's).
func machineVersion(c *typesv1.Cluster, m *typesv1.Machine) *version.Version {
	v := m.GetSpec().GetVersion()
	if v == "" {
		v = c.GetSpec().GetKubernetesVersion()
	}
	pv, err := version.ParseSemantic(v)
	if err != nil {
		return nil
	}
	return pv
}

// PlanAddons decides whether the addons of cluster c move now: to the
// version of its newest control-plane member that is bootstrapped, Ready
// and not deleting, while machines of an older version remain (a rollout
// by reimaging is under way), unless c.status.addons.version says they
// were moved to it already. It returns false when there is nothing to do.
// machines may hold other clusters' machines; they are skipped.
func PlanAddons(c *typesv1.Cluster, machines []*typesv1.Machine) (UpgradeAddons, bool) {
	name := c.GetMetadata().GetName()
	var (
		newest *version.Version
		image  string
	)
	for _, m := range machines {
		if m.GetSpec().GetCluster() != name || m.GetSpec().GetRole() != RoleControlPlane || m.GetMetadata().GetDeletionTimestamp() != nil ||
			!conditions.IsTrue(m.GetStatus().GetConditions(), MachineBootstrapped) ||
			!conditions.IsTrue(m.GetStatus().GetConditions(), MachineNodeReady) {
			continue
		}
		if v := machineVersion(c, m); v != nil && (newest == nil || newest.LessThan(v)) {
			newest, image = v, m.GetSpec().GetImage()
		}
	}
	if newest == nil {
		return UpgradeAddons{}, false
	}
	older := false
	for _, m := range machines {
		if v := machineVersion(c, m); m.GetSpec().GetCluster() == name && v != nil && v.LessThan(newest) {
			older = true
		}
	}
	want := "v" + newest.String()
	if !older || c.GetStatus().GetAddons().GetVersion() == want {
		return UpgradeAddons{}, false
	}
	return UpgradeAddons{Version: want, Image: image}, true
}

// PlanKubeadmConfig decides whether kube-system/kubeadm-config must move
// to the version of member, a control-plane machine about to join, first
// (`kubeadm upgrade apply`'s upload-config): when a bootstrapped machine
// of an older version runs (a cluster's first version is kubeadm init's
// own) and c.status.addons.kubeadmConfigVersion is not that version
// already. It returns the version, or false.
func PlanKubeadmConfig(c *typesv1.Cluster, machines []*typesv1.Machine, member *typesv1.Machine) (string, bool) {
	mv := machineVersion(c, member)
	if mv == nil {
		return "", false
	}
	want := "v" + mv.String()
	if c.GetStatus().GetAddons().GetKubeadmConfigVersion() == want {
		return "", false
	}
	for _, o := range machines {
		if o.GetSpec().GetCluster() != c.GetMetadata().GetName() || !conditions.IsTrue(o.GetStatus().GetConditions(), MachineBootstrapped) {
			continue
		}
		if ov := machineVersion(c, o); ov != nil && ov.LessThan(mv) {
			return want, true
		}
	}
	return "", false
}
