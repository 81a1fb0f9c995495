package describe

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	opprogress "github.com/kilnhq/kiln/internal/progress"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// ClusterObjects is everything that belongs to one cluster.
type ClusterObjects struct {
	Cluster            *typesv1.Cluster
	ControlPlanes      []*typesv1.ControlPlane
	MachineDeployments []*typesv1.MachineDeployment
	Machines           []*typesv1.Machine
	HealthChecks       []*typesv1.HealthCheck
	// Hosts are all hosts by name; the tree shows those its machines use.
	Hosts map[string]*typesv1.Host
}

// Collect picks from items (resources of any kinds) the control planes,
// deployments, machines and health checks of cluster, and every host.
func Collect(cluster *typesv1.Cluster, items []*controllerv1.Resource) *ClusterObjects {
	name := cluster.GetMetadata().GetName()
	o := &ClusterObjects{Cluster: cluster, Hosts: map[string]*typesv1.Host{}}
	for _, it := range items {
		switch x := it.GetKind().(type) {
		case *controllerv1.Resource_ControlPlane:
			if x.ControlPlane.GetSpec().GetCluster() == name {
				o.ControlPlanes = append(o.ControlPlanes, x.ControlPlane)
			}
		case *controllerv1.Resource_MachineDeployment:
			if x.MachineDeployment.GetSpec().GetCluster() == name {
				o.MachineDeployments = append(o.MachineDeployments, x.MachineDeployment)
			}
		case *controllerv1.Resource_Machine:
			if x.Machine.GetSpec().GetCluster() == name {
				o.Machines = append(o.Machines, x.Machine)
			}
		case *controllerv1.Resource_HealthCheck:
			if x.HealthCheck.GetSpec().GetCluster() == name {
				o.HealthChecks = append(o.HealthChecks, x.HealthCheck)
			}
		case *controllerv1.Resource_Host:
			o.Hosts[x.Host.GetMetadata().GetName()] = x.Host
		}
	}
	return o
}

// Node is one row of the cluster tree and its children.
type Node struct {
	Name                                    string
	Ready, Severity, Reason, Since, Message string
	// Kind and Object name the resource the row shows ("Host",
	// "rack1-01"); both are empty on condition and operation rows.
	Kind, Object string
	Children     []*Node
}

// conditionNodes makes one child row per condition, as
// `clusterctl describe --show-conditions all` does.
func conditionNodes(conds []*typesv1.Condition, now time.Time) []*Node {
	out := make([]*Node, 0, len(conds))
	for _, c := range conds {
		out = append(out, &Node{
			Name: c.GetType(), Ready: c.GetStatus(), Severity: c.GetSeverity(), Reason: c.GetReason(),
			Since: Age(c.GetLastTransitionTime(), now), Message: c.GetMessage(),
		})
	}
	return out
}

// objectNode is the row of an object: its summary condition (the first of
// types present) on the row, every condition below it.
func objectNode(kind, name string, conds []*typesv1.Condition, now time.Time, summary ...string) *Node {
	n := &Node{Name: kind + "/" + name, Kind: kind, Object: name, Ready: "-"}
	for _, t := range summary {
		for _, c := range conds {
			if c.GetType() == t {
				n.Ready, n.Severity, n.Reason = c.GetStatus(), c.GetSeverity(), c.GetReason()
				n.Since, n.Message = Age(c.GetLastTransitionTime(), now), c.GetMessage()
				n.Children = conditionNodes(conds, now)
				return n
			}
		}
	}
	n.Children = conditionNodes(conds, now)
	return n
}

// ClusterTree builds cluster → control planes and deployments → machines
// → hosts (BMC, power, last agent operation), with health checks and
// machines of no known owner under the cluster.
func ClusterTree(o *ClusterObjects, now time.Time) *Node {
	cl := o.Cluster
	root := objectNode("Cluster", cl.GetMetadata().GetName(), cl.GetStatus().GetConditions(), now, "Ready", "Available")
	if root.Message == "" {
		root.Message = fmt.Sprintf("%s, pods %s", cl.GetSpec().GetKubernetesVersion(), cl.GetSpec().GetPodCidr())
	}
	byOwner := map[string][]*typesv1.Machine{}
	for _, m := range o.Machines {
		byOwner[m.GetSpec().GetOwner()] = append(byOwner[m.GetSpec().GetOwner()], m)
	}
	owned := map[string]bool{}
	addMachines := func(parent *Node, owner string) {
		owned[owner] = true
		ms := byOwner[owner]
		sort.Slice(ms, func(i, j int) bool { return ms[i].GetMetadata().GetName() < ms[j].GetMetadata().GetName() })
		for _, m := range ms {
			parent.Children = append(parent.Children, machineNode(m, o.Hosts[m.GetSpec().GetHost()], now))
		}
	}
	cps := o.ControlPlanes
	sort.Slice(cps, func(i, j int) bool { return cps[i].GetMetadata().GetName() < cps[j].GetMetadata().GetName() })
	for _, cp := range cps {
		s := cp.GetStatus()
		n := objectNode("ControlPlane", cp.GetMetadata().GetName(), s.GetConditions(), now, "Ready")
		n.Name += fmt.Sprintf(" (%s, %d/%d ready, %d up to date, %d etcd members)", cp.GetSpec().GetVersion(), s.GetReadyReplicas(), cp.GetSpec().GetReplicas(), s.GetUpdatedReplicas(), s.GetEtcdMembers())
		addMachines(n, "ControlPlane/"+cp.GetMetadata().GetName())
		root.Children = append(root.Children, n)
	}
	mds := o.MachineDeployments
	sort.Slice(mds, func(i, j int) bool { return mds[i].GetMetadata().GetName() < mds[j].GetMetadata().GetName() })
	for _, md := range mds {
		s := md.GetStatus()
		n := objectNode("MachineDeployment", md.GetMetadata().GetName(), s.GetConditions(), now, "Available", "Ready")
		n.Name += fmt.Sprintf(" (%s, %d/%d ready, %d up to date)", md.GetSpec().GetVersion(), s.GetReadyReplicas(), md.GetSpec().GetReplicas(), s.GetUpdatedReplicas())
		addMachines(n, "MachineDeployment/"+md.GetMetadata().GetName())
		root.Children = append(root.Children, n)
	}
	var orphans []string
	for owner := range byOwner {
		if !owned[owner] {
			orphans = append(orphans, owner)
		}
	}
	sort.Strings(orphans)
	for _, owner := range orphans {
		label := "Machines of " + owner
		if owner == "" {
			label = "Machines without owner"
		}
		n := &Node{Name: label, Ready: "-"}
		addMachines(n, owner)
		root.Children = append(root.Children, n)
	}
	hcs := o.HealthChecks
	sort.Slice(hcs, func(i, j int) bool { return hcs[i].GetMetadata().GetName() < hcs[j].GetMetadata().GetName() })
	for _, hc := range hcs {
		s := hc.GetStatus()
		n := objectNode("HealthCheck", hc.GetMetadata().GetName(), s.GetConditions(), now, "RemediationAllowed")
		n.Name += fmt.Sprintf(" (%d/%d healthy)", s.GetCurrentHealthy(), s.GetExpectedMachines())
		root.Children = append(root.Children, n)
	}
	return root
}

func machineNode(m *typesv1.Machine, h *typesv1.Host, now time.Time) *Node {
	s := m.GetStatus()
	n := objectNode("Machine", m.GetMetadata().GetName(), s.GetConditions(), now, "NodeReady", "Ready")
	extra := []string{m.GetSpec().GetVersion()}
	if s.GetNodeName() != "" {
		extra = append(extra, "node "+s.GetNodeName())
	}
	if s.GetEtcdMember() != "" {
		extra = append(extra, "etcd "+s.GetEtcdMember())
	}
	n.Name += " (" + strings.Join(extra, ", ") + ")"
	if m.GetMetadata().GetDeletionTimestamp() != nil {
		n.Name += " deleting"
	}
	if h == nil {
		n.Children = append(n.Children, &Node{Name: "Host/" + m.GetSpec().GetHost(), Ready: "-", Message: "host not found"})
		return n
	}
	n.Children = append(n.Children, HostNode(h, now))
	return n
}

// HostNode shows a host's state, BMC, power, agent and last operation,
// with every condition of the host below it.
func HostNode(h *typesv1.Host, now time.Time) *Node {
	s := h.GetStatus()
	n := &Node{Name: "Host/" + h.GetMetadata().GetName(), Kind: "Host", Object: h.GetMetadata().GetName(),
		Ready: HostState(s.GetState()), Reason: s.GetProvisioningStep()}
	var msg []string
	switch bmc := h.GetSpec().GetBmc(); bmc.GetProtocol() {
	case "", "none":
		msg = append(msg, "no bmc")
	default:
		msg = append(msg, fmt.Sprintf("bmc %s %s", bmc.GetProtocol(), bmc.GetAddress()))
	}
	if p := s.GetPower(); p != "" {
		msg = append(msg, "power "+p)
	}
	if hb := s.GetAgent().GetLastHeartbeat(); hb != nil {
		msg = append(msg, "agent seen "+Age(hb, now)+" ago")
	}
	if s.GetErrorReason() != "" {
		msg = append(msg, "error: "+s.GetErrorReason())
	}
	n.Message = strings.Join(msg, ", ")
	if op := s.GetLastOperation(); op.GetKind() != "" {
		opn := &Node{Name: "Operation/" + op.GetKind(), Ready: op.GetState(), Since: Age(op.GetStarted(), now)}
		var m []string
		if p := opprogress.Short(op.GetProgress()); p != "" && op.GetState() == "Running" {
			m = append(m, p)
		} else if op.GetPercent() > 0 {
			m = append(m, fmt.Sprintf("%.0f%%", op.GetPercent()))
		}
		if op.GetMessage() != "" {
			m = append(m, op.GetMessage())
		}
		if op.GetError() != "" {
			m = append(m, "error: "+op.GetError())
		}
		opn.Message = strings.Join(m, ", ")
		n.Children = append(n.Children, opn)
	}
	n.Children = append(n.Children, conditionNodes(s.GetConditions(), now)...)
	return n
}

// Row is one line of a tree: its node and the box-drawing prefix
// ("│ ├─") that places it under its parent.
type Row struct {
	Prefix string
	Depth  int
	*Node
}

// Rows walks the tree depth first, parents before children.
func Rows(root *Node) []Row {
	var out []Row
	var walk func(n *Node, prefix, branch string, depth int)
	walk = func(n *Node, prefix, branch string, depth int) {
		out = append(out, Row{Prefix: prefix + branch, Depth: depth, Node: n})
		child := prefix
		switch branch {
		case "├─":
			child += "│ "
		case "└─":
			child += "  "
		}
		for i, c := range n.Children {
			b := "├─"
			if i == len(n.Children)-1 {
				b = "└─"
			}
			walk(c, child, b, depth+1)
		}
	}
	walk(root, "", "", 0)
	return out
}

// WriteTree prints the tree as a table with box-drawing prefixes.
func WriteTree(out io.Writer, root *Node) error {
	var buf strings.Builder
	w := tabwriter.NewWriter(&buf, 0, 8, 2, ' ', 0)
	fmt.Fprintln(w, "NAME\tREADY\tSEVERITY\tREASON\tSINCE\tMESSAGE")
	for _, r := range Rows(root) {
		fmt.Fprintf(w, "%s%s\t%s\t%s\t%s\t%s\t%s\n", r.Prefix, r.Name, Dash(r.Ready), Dash(r.Severity), Dash(r.Reason), Dash(r.Since), Clean(r.Message))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	for _, line := range strings.SplitAfter(buf.String(), "\n") {
		if line == "" {
			continue
		}
		if _, err := io.WriteString(out, strings.TrimRight(line, " \n")+"\n"); err != nil {
			return err
		}
	}
	return nil
}
