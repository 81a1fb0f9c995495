package validation

import (
	"fmt"
	"net/netip"
	"strings"

	"google.golang.org/protobuf/proto"

	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Observed is what the store holds that a resource is checked against.
// The controller fills in what it knows; zero fields skip their rules.
type Observed struct {
	// Current is the stored object of the same kind and name; nil when
	// the resource is new.
	Current *controllerv1.Resource
	// ControlPlaneVersion is the version of the control plane of the
	// cluster a MachineDeployment or Machine belongs to (the ControlPlane's
	// spec.version, else the Cluster's spec.kubernetesVersion); "" when
	// not known.
	ControlPlaneVersion string
	// Networks are the networks a new Cluster's pod and service CIDRs
	// must not overlap: the controller's own (its API and boot server
	// subnets, the lab bridge) and those an operator declared
	// (kiln-controller run --reserved-network). An overlap refuses.
	Networks []netip.Prefix
	// AgentNetworks are the networks agents report in their facts (NIC
	// addresses and routes). An agent may report anything, so an overlap
	// with one is a warning (WarnAgainst), never a refusal: facts from
	// agents must not deny service to operators (issue 12, hole 6).
	AgentNetworks []HostNetwork
	// Class is the ClusterClass a topology Cluster names (nil when it
	// does not exist), and ClassSpec the spec of the revision the cluster
	// follows (its pinned revision when the class keeps it, else the
	// class's current spec).
	Class     *typesv1.ClusterClass
	ClassSpec *typesv1.ClusterClassSpec
	// ClassClusters are the Clusters whose spec.topology names the
	// ClusterClass being applied.
	ClassClusters []*typesv1.Cluster
	// ImageVersions maps Image names to their Kubernetes versions, for
	// the topology checks.
	ImageVersions map[string]string
}

// HostNetwork is a network one host's agent reports.
type HostNetwork struct {
	Host   string
	Prefix netip.Prefix
}

// maxKubeletSkew is how many minors a kubelet may trail the API server
// (Kubernetes version skew policy since v1.28).
const maxKubeletSkew = 3

// ValidateAgainst checks the rules of r that depend on stored objects:
// no minor version skipped or rolled back on a Cluster or ControlPlane,
// workers never newer than (nor too far behind) their control plane, a
// new Cluster's CIDRs clear of o.Networks (the controller's own and the
// reserved ones; agents' networks only warn: WarnAgainst) and unchanged
// once created,
// and Machines immutable. It returns nil or an *Error (class
// errdefs.InvalidArgument) listing every problem. It assumes Validate(r) passed and does no
// I/O.
func ValidateAgainst(r *controllerv1.Resource, o Observed) error {
	kind, name := KindName(r)
	var p problems
	switch x := r.GetKind().(type) {
	case *controllerv1.Resource_Cluster:
		s := x.Cluster.GetSpec()
		cur := o.Current.GetCluster().GetSpec()
		if o.Current.GetCluster() != nil {
			checkVersionChange(&p, "spec.kubernetesVersion", cur.GetKubernetesVersion(), s.GetKubernetesVersion())
			if cur.GetPodCidr() != "" && cur.GetPodCidr() != s.GetPodCidr() {
				p.add("spec.podCidr", "cannot change from %s to %s on an existing cluster: every node and the CNI use it; create a new Cluster instead", cur.GetPodCidr(), s.GetPodCidr())
			}
			if cur.GetServiceCidr() != "" && cur.GetServiceCidr() != s.GetServiceCidr() {
				p.add("spec.serviceCidr", "cannot change from %s to %s on an existing cluster: the API server's certificate and every Service use it; create a new Cluster instead", cur.GetServiceCidr(), s.GetServiceCidr())
			}
		}
		// Only a new cluster is checked: once it runs, its nodes report
		// its own pod network (cni0 in the pod CIDR) among their addresses,
		// and its CIDRs cannot change anyway.
		if o.Current.GetCluster() == nil {
			checkNetworks(&p, "spec.podCidr", s.GetPodCidr(), o.Networks)
			checkNetworks(&p, "spec.serviceCidr", s.GetServiceCidr(), o.Networks)
		}
		if s.GetTopology() != nil {
			checkTopologyAgainst(&p, x.Cluster, o)
		}
	case *controllerv1.Resource_ClusterClass:
		checkClassAgainst(&p, x.ClusterClass, o)
	case *controllerv1.Resource_ControlPlane:
		if cur := o.Current.GetControlPlane(); cur != nil {
			checkVersionChange(&p, "spec.version", cur.GetSpec().GetVersion(), x.ControlPlane.GetSpec().GetVersion())
		}
	case *controllerv1.Resource_MachineDeployment:
		checkWorkerSkew(&p, x.MachineDeployment.GetSpec().GetVersion(), o.ControlPlaneVersion)
	case *controllerv1.Resource_Rollout:
		if cur := o.Current.GetRollout(); cur != nil && !proto.Equal(cur.GetSpec().GetChange(), x.Rollout.GetSpec().GetChange()) {
			p.add("spec.change", "a Rollout's change is fixed once it exists (its status records which clusters it moved): make a new Rollout for another change")
		}
	case *controllerv1.Resource_Machine:
		if cur := o.Current.GetMachine(); cur != nil && !proto.Equal(cur.GetSpec(), x.Machine.GetSpec()) {
			p.add("spec", "a Machine is immutable: a new image or version makes a new Machine on a reimaged host; change the owning ControlPlane or MachineDeployment instead")
		}
		if x.Machine.GetSpec().GetRole() == "worker" {
			checkWorkerSkew(&p, x.Machine.GetSpec().GetVersion(), o.ControlPlaneVersion)
		}
	}
	return p.err(kind, name)
}

// checkVersionChange refuses a change of version that skips a minor,
// goes back a minor or changes the major. Patch changes are free.
func checkVersionChange(p *problems, field, from, to string) {
	if from == "" || to == "" || from == to {
		return
	}
	f, err1 := ParseVersion(from)
	t, err2 := ParseVersion(to)
	if err1 != nil || err2 != nil {
		return
	}
	switch {
	case f.Major != t.Major:
		p.add(field, "%s -> %s changes the major version: not supported", f, t)
	case t.Minor > f.Minor+1:
		skipped := make([]string, 0, t.Minor-f.Minor-1)
		for m := f.Minor + 1; m < t.Minor; m++ {
			skipped = append(skipped, Version{Major: f.Major, Minor: m}.MinorString())
		}
		p.add(field, "%s -> %s skips %s; upgrade one minor at a time (apply %s.x first)",
			f.MinorString(), t.MinorString(), strings.Join(skipped, ", "), skipped[0])
	case t.Minor < f.Minor:
		p.add(field, "%s -> %s is a downgrade: kubeadm cannot downgrade a control plane; keep %s or build a new cluster", f, t, f)
	}
}

// checkWorkerSkew refuses a worker version newer than the control plane
// or more than maxKubeletSkew minors behind it.
func checkWorkerSkew(p *problems, version, cpVersion string) {
	if version == "" || cpVersion == "" {
		return
	}
	w, err1 := ParseVersion(version)
	c, err2 := ParseVersion(cpVersion)
	if err1 != nil || err2 != nil {
		return
	}
	switch {
	case w.Major != c.Major || w.Minor > c.Minor || (w.Minor == c.Minor && w.Patch > c.Patch):
		p.add("spec.version", "%s is newer than the control plane's %s: a kubelet is never newer than its API server; upgrade the ControlPlane first", w, c)
	case c.Minor-w.Minor > maxKubeletSkew:
		p.add("spec.version", "%s is %d minors behind the control plane's %s: a kubelet may trail its API server by at most %d; use %s or newer",
			w, c.Minor-w.Minor, c, maxKubeletSkew, Version{Major: c.Major, Minor: c.Minor - maxKubeletSkew}.MinorString())
	}
}

// WarnAgainst returns what is worth telling the operator about r but not
// refusing: each of a new Cluster's CIDRs that overlaps a network an agent
// reports, naming the field, the host and the network. It assumes
// Validate(r) passed and does no I/O.
func WarnAgainst(r *controllerv1.Resource, o Observed) []string {
	c := r.GetCluster()
	if c == nil || o.Current.GetCluster() != nil {
		return nil
	}
	var out []string
	for _, f := range []struct{ field, cidr string }{
		{"spec.podCidr", c.GetSpec().GetPodCidr()},
		{"spec.serviceCidr", c.GetSpec().GetServiceCidr()},
	} {
		pfx, err := netip.ParsePrefix(f.cidr)
		if err != nil {
			continue
		}
		var hits []string
		for _, n := range o.AgentNetworks {
			if pfx.Overlaps(n.Prefix) {
				hits = append(hits, fmt.Sprintf("%s (host %q)", n.Prefix, n.Host))
			}
		}
		if len(hits) == 0 {
			continue
		}
		more := ""
		if len(hits) > maxWarnedNetworks {
			more = fmt.Sprintf(" and %d more", len(hits)-maxWarnedNetworks)
			hits = hits[:maxWarnedNetworks]
		}
		out = append(out, fmt.Sprintf("%s %s overlaps network %s%s that agents report: accepted, because what an agent reports about itself may not refuse an apply; if that network is real, pods and services would shadow its addresses on those hosts",
			f.field, pfx, strings.Join(hits, ", "), more))
	}
	return out
}

// maxWarnedNetworks bounds the networks one warning names.
const maxWarnedNetworks = 5

// checkNetworks refuses a CIDR that overlaps any of the host networks.
func checkNetworks(p *problems, field, cidr string, networks []netip.Prefix) {
	if cidr == "" || len(networks) == 0 {
		return
	}
	pfx, err := netip.ParsePrefix(cidr)
	if err != nil {
		return
	}
	for _, n := range networks {
		if pfx.Overlaps(n) {
			p.add(field, "%s overlaps host network %s: pods and services would shadow real addresses; pick a range no host uses, e.g. %s", pfx, n, suggestion(field, networks))
			return
		}
	}
}

// suggestion picks a conventional range that overlaps none of networks.
func suggestion(field string, networks []netip.Prefix) string {
	candidates := []string{"10.244.0.0/16", "172.20.0.0/16", "192.168.128.0/17", "10.96.0.0/12", "100.64.0.0/16"}
	if field == "spec.serviceCidr" {
		candidates = []string{"10.96.0.0/12", "172.21.0.0/16", "192.168.64.0/18", "100.65.0.0/16"}
	}
next:
	for _, c := range candidates {
		pfx := netip.MustParsePrefix(c)
		for _, n := range networks {
			if pfx.Overlaps(n) {
				continue next
			}
		}
		return c
	}
	return fmt.Sprintf("a private range outside %v", networks)
}
