package clusterplan

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Cluster phases (Cluster.status.phase).
const (
	// ClusterProvisioning: no control plane has finished kubeadm init yet.
	ClusterProvisioning = "Provisioning"
	// ClusterReady: the Ready condition is True.
	ClusterReady = "Ready"
	// ClusterNotReady: initialised, but something is not (yet) Ready; the
	// Ready condition says what.
	ClusterNotReady = "NotReady"
)

// Machine condition the cluster summary reads besides NodeReady: the
// agent's real DNS query for kubernetes.default.svc.<domain>.
const MachineClusterDNSResolves = "ClusterDNSResolves"

// Reasons of the Cluster's Ready condition.
const (
	ReasonNoControlPlane    = "NoControlPlane"
	ReasonControlPlaneDown  = "ControlPlaneNotReady"
	ReasonWorkersNotReady   = "WorkersNotReady"
	ReasonMachinesNotReady  = "MachinesNotReady"
	ReasonClusterDNSFailing = "ClusterDNSFailing"
)

// ClusterInput is what the cluster summary reads: the Cluster, its
// ControlPlanes and MachineDeployments (with the statuses their planners
// just computed) and every Machine of the cluster.
type ClusterInput struct {
	Cluster            *typesv1.Cluster
	ControlPlanes      []*typesv1.ControlPlane
	MachineDeployments []*typesv1.MachineDeployment
	Machines           []*typesv1.Machine
}

// PlanClusterStatus summarises a cluster for its user: phase and a Ready
// condition that is True only when every ControlPlane is Ready, every
// MachineDeployment has its replicas Ready at the desired version, and
// every machine's node is Ready and answers a real cluster DNS query
// (ClusterDNSResolves): a node that is Ready but cannot resolve
// kubernetes.default is not a working cluster. It keeps the status fields
// the executor owns (caHash, apiServerVersion, addons), status.topology
// and the other conditions. Pure.
func PlanClusterStatus(in ClusterInput, now time.Time) *typesv1.ClusterStatus {
	c := in.Cluster
	st := &typesv1.ClusterStatus{}
	if old := c.GetStatus(); old != nil {
		st.CaHash, st.ApiServerVersion, st.Addons = old.GetCaHash(), old.GetApiServerVersion(), old.GetAddons()
		// status.topology is the topology executor's and the Rollout's
		// (the class revision pin): dropping it here would re-pin a
		// cluster to its class's latest revision behind its Rollout.
		st.Topology = old.GetTopology()
		st.Conditions = slices.Clone(old.GetConditions())
	}
	gen := c.GetMetadata().GetGeneration()
	status, reason, msg := clusterReady(in)
	st.Conditions = setCond(st.Conditions, gen, now, ConditionReady, status, reason, msg)
	switch {
	case status == conditions.True:
		st.Phase = ClusterReady
	case st.CaHash == "":
		st.Phase = ClusterProvisioning
	default:
		st.Phase = ClusterNotReady
	}
	return st
}

func clusterReady(in ClusterInput) (status, reason, msg string) {
	name := in.Cluster.GetMetadata().GetName()
	if len(in.ControlPlanes) == 0 {
		return conditions.False, ReasonNoControlPlane, fmt.Sprintf("cluster %s has no ControlPlane: apply one naming spec.cluster: %s", name, name)
	}
	for _, cp := range in.ControlPlanes {
		if c := conditions.Get(cp.GetStatus().GetConditions(), ConditionReady); c == nil || c.GetStatus() != conditions.True {
			why := "not planned yet"
			if c != nil {
				why = c.GetMessage()
			}
			return conditions.False, ReasonControlPlaneDown, fmt.Sprintf("control plane %s: %s", cp.GetMetadata().GetName(), why)
		}
	}
	for _, md := range in.MachineDeployments {
		want := md.GetSpec().GetReplicas()
		s := md.GetStatus()
		if s.GetReadyReplicas() < want || s.GetUpdatedReplicas() < want {
			return conditions.False, ReasonWorkersNotReady, fmt.Sprintf("machine deployment %s: %d of %d Ready, %d up to date",
				md.GetMetadata().GetName(), s.GetReadyReplicas(), want, s.GetUpdatedReplicas())
		}
	}
	var notReady, noDNS []string
	n := 0
	for _, m := range in.Machines {
		if m.GetSpec().GetCluster() != name || m.GetMetadata().GetDeletionTimestamp() != nil {
			continue
		}
		n++
		conds := m.GetStatus().GetConditions()
		switch {
		case !conditions.IsTrue(conds, MachineNodeReady):
			notReady = append(notReady, m.GetMetadata().GetName())
		case !conditions.IsTrue(conds, MachineClusterDNSResolves):
			noDNS = append(noDNS, m.GetMetadata().GetName()+dnsWhy(conds))
		}
	}
	slices.Sort(notReady)
	slices.Sort(noDNS)
	switch {
	case len(notReady) > 0:
		return conditions.False, ReasonMachinesNotReady, "node not Ready: " + strings.Join(notReady, ", ")
	case len(noDNS) > 0:
		return conditions.False, ReasonClusterDNSFailing, "cluster DNS does not resolve on: " + strings.Join(noDNS, "; ")
	}
	return conditions.True, ReasonAsExpected, fmt.Sprintf("%d machines Ready, cluster DNS resolves on each", n)
}

func dnsWhy(conds []*typesv1.Condition) string {
	if c := conditions.Get(conds, MachineClusterDNSResolves); c != nil && c.GetMessage() != "" {
		return " (" + c.GetMessage() + ")"
	}
	return ""
}
