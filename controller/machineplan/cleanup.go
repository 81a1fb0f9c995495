package machineplan

import (
	"fmt"
	"sort"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// CleanupAction is one step of the fleet-wide clean-up. The set is
// closed: DeleteClusterMachine, DeleteCredentials, ReleaseHost.
type CleanupAction interface {
	fmt.Stringer
	isCleanup()
}

// DeleteClusterMachine deletes Machine of the deleted Cluster at once:
// its node is not reset (the whole cluster is gone) and its host is
// released (ReleaseHost), wiped by the host lifecycle and Available.
type DeleteClusterMachine struct {
	Machine, Cluster, Host string
}

// DeleteCredentials deletes the sealed bootstrap credentials of the
// deleted Cluster.
type DeleteCredentials struct {
	Cluster string
}

// ReleaseHost unbinds Host from Machine, which no longer exists (or is
// deleted with DeleteClusterMachine in the same plan): the host lifecycle
// then wipes it and it becomes Available.
type ReleaseHost struct {
	Host, Machine string
}

func (DeleteClusterMachine) isCleanup() {}
func (DeleteCredentials) isCleanup()    {}
func (ReleaseHost) isCleanup()          {}

func (a DeleteClusterMachine) String() string {
	return fmt.Sprintf("DeleteClusterMachine %s cluster=%s host=%s", a.Machine, a.Cluster, a.Host)
}
func (a DeleteCredentials) String() string { return "DeleteCredentials cluster=" + a.Cluster }
func (a ReleaseHost) String() string {
	return fmt.Sprintf("ReleaseHost %s machine=%s", a.Host, a.Machine)
}

// CleanupInput is what PlanCleanup reads. The executor lists Hosts, then
// Machines, then Clusters: a machine is created after its cluster, so a
// machine whose cluster is missing from the later list belongs to a
// cluster that was deleted; and a machine is created before its host is
// bound, so a host bound after the first list has its machine in the
// second.
type CleanupInput struct {
	Hosts    []*typesv1.Host
	Machines []*typesv1.Machine
	Clusters []*typesv1.Cluster
}

// PlanCleanup returns, in a stable order, the Machines of deleted
// Clusters to delete (those whose AnnotationClusterUID names no existing
// Cluster of their spec.cluster, including a Cluster deleted and created
// again under the same name; Machines without the annotation are left
// alone), the credentials of each such Cluster that is gone (not of one
// created again: its init keeps its own), and the hosts
// bound to Machines that no longer exist (deleted through the API, which
// skips kubeadm reset) or are deleted here.
func PlanCleanup(in CleanupInput) []CleanupAction {
	uids := make(map[string]string, len(in.Clusters))
	for _, c := range in.Clusters {
		uids[c.GetMetadata().GetName()] = c.GetMetadata().GetUid()
	}
	ms := append([]*typesv1.Machine(nil), in.Machines...)
	sort.Slice(ms, func(i, j int) bool { return ms[i].GetMetadata().GetName() < ms[j].GetMetadata().GetName() })
	var out []CleanupAction
	gone := map[string]bool{}
	exists := make(map[string]bool, len(ms))
	for _, m := range ms {
		name, cluster := m.GetMetadata().GetName(), m.GetSpec().GetCluster()
		uid := m.GetMetadata().GetAnnotations()[AnnotationClusterUID]
		if current, ok := uids[cluster]; uid == "" || (ok && current == uid) {
			exists[name] = true
			continue
		}
		out = append(out, DeleteClusterMachine{Machine: name, Cluster: cluster, Host: m.GetSpec().GetHost()})
		if _, ok := uids[cluster]; !ok {
			gone[cluster] = true
		}
	}
	clusters := make([]string, 0, len(gone))
	for c := range gone {
		clusters = append(clusters, c)
	}
	sort.Strings(clusters)
	for _, c := range clusters {
		out = append(out, DeleteCredentials{Cluster: c})
	}
	hosts := append([]*typesv1.Host(nil), in.Hosts...)
	sort.Slice(hosts, func(i, j int) bool { return hosts[i].GetMetadata().GetName() < hosts[j].GetMetadata().GetName() })
	for _, h := range hosts {
		if bound := h.GetStatus().GetMachine(); bound != "" && !exists[bound] {
			out = append(out, ReleaseHost{Host: h.GetMetadata().GetName(), Machine: bound})
		}
	}
	return out
}
