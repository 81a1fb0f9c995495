package cli

import (
	"context"
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

// clusterObjects is everything that belongs to one cluster, read with
// List calls.
type clusterObjects struct {
	cluster  *typesv1.Cluster
	cps      []*typesv1.ControlPlane
	mds      []*typesv1.MachineDeployment
	machines []*typesv1.Machine
	hcs      []*typesv1.HealthCheck
	hosts    map[string]*typesv1.Host
}

// listAll reads every object of kind, page by page.
func (a *app) listAll(ctx context.Context, c controllerv1.ResourcesClient, kind string) ([]*controllerv1.Resource, error) {
	var out []*controllerv1.Resource
	cont := ""
	for {
		cctx, cancel := a.call(ctx)
		resp, err := c.List(cctx, &controllerv1.ListRequest{Kind: kind, Limit: 500, Continue: cont})
		cancel()
		if err != nil {
			return nil, a.rpcError("list "+strings.ToLower(kind)+"s", err)
		}
		out = append(out, resp.GetItems()...)
		if cont = resp.GetContinue(); cont == "" {
			return out, nil
		}
	}
}

// loadCluster gets cluster name and lists its control planes,
// deployments, machines, health checks and the hosts of its machines.
func (a *app) loadCluster(ctx context.Context, c controllerv1.ResourcesClient, name string) (*clusterObjects, error) {
	cctx, cancel := a.call(ctx)
	r, err := c.Get(cctx, &controllerv1.GetRequest{Kind: "Cluster", Name: name})
	cancel()
	if err != nil {
		return nil, a.rpcError("describe cluster/"+name, err)
	}
	o := &clusterObjects{cluster: r.GetCluster(), hosts: map[string]*typesv1.Host{}}
	for _, kind := range []string{"ControlPlane", "MachineDeployment", "Machine", "HealthCheck", "Host"} {
		items, err := a.listAll(ctx, c, kind)
		if err != nil {
			return nil, err
		}
		for _, it := range items {
			switch x := it.GetKind().(type) {
			case *controllerv1.Resource_ControlPlane:
				if x.ControlPlane.GetSpec().GetCluster() == name {
					o.cps = append(o.cps, x.ControlPlane)
				}
			case *controllerv1.Resource_MachineDeployment:
				if x.MachineDeployment.GetSpec().GetCluster() == name {
					o.mds = append(o.mds, x.MachineDeployment)
				}
			case *controllerv1.Resource_Machine:
				if x.Machine.GetSpec().GetCluster() == name {
					o.machines = append(o.machines, x.Machine)
				}
			case *controllerv1.Resource_HealthCheck:
				if x.HealthCheck.GetSpec().GetCluster() == name {
					o.hcs = append(o.hcs, x.HealthCheck)
				}
			case *controllerv1.Resource_Host:
				o.hosts[x.Host.GetMetadata().GetName()] = x.Host
			}
		}
	}
	return o, nil
}

// treeNode is one row of the cluster tree and its children.
type treeNode struct {
	name                                    string
	ready, severity, reason, since, message string
	children                                []*treeNode
}

// conditionNodes makes one child row per condition, as
// `clusterctl describe --show-conditions all` does.
func conditionNodes(conds []*typesv1.Condition, now time.Time) []*treeNode {
	out := make([]*treeNode, 0, len(conds))
	for _, c := range conds {
		out = append(out, &treeNode{
			name: c.GetType(), ready: c.GetStatus(), severity: c.GetSeverity(), reason: c.GetReason(),
			since: age(c.GetLastTransitionTime(), now), message: c.GetMessage(),
		})
	}
	return out
}

// objectNode is the row of an object: its summary condition (the first of
// types present) on the row, every condition below it.
func objectNode(name string, conds []*typesv1.Condition, now time.Time, summary ...string) *treeNode {
	n := &treeNode{name: name, ready: "-"}
	for _, t := range summary {
		for _, c := range conds {
			if c.GetType() == t {
				n.ready, n.severity, n.reason = c.GetStatus(), c.GetSeverity(), c.GetReason()
				n.since, n.message = age(c.GetLastTransitionTime(), now), c.GetMessage()
				n.children = conditionNodes(conds, now)
				return n
			}
		}
	}
	n.children = conditionNodes(conds, now)
	return n
}

// clusterTree builds cluster → control planes and deployments → machines
// → hosts (BMC, power, last agent operation), with health checks and
// machines of no known owner under the cluster.
func clusterTree(o *clusterObjects, now time.Time) *treeNode {
	cl := o.cluster
	root := objectNode("Cluster/"+cl.GetMetadata().GetName(), cl.GetStatus().GetConditions(), now, "Ready", "Available")
	if root.message == "" {
		root.message = fmt.Sprintf("%s, pods %s", cl.GetSpec().GetKubernetesVersion(), cl.GetSpec().GetPodCidr())
	}
	byOwner := map[string][]*typesv1.Machine{}
	for _, m := range o.machines {
		byOwner[m.GetSpec().GetOwner()] = append(byOwner[m.GetSpec().GetOwner()], m)
	}
	owned := map[string]bool{}
	addMachines := func(parent *treeNode, owner string) {
		owned[owner] = true
		ms := byOwner[owner]
		sort.Slice(ms, func(i, j int) bool { return ms[i].GetMetadata().GetName() < ms[j].GetMetadata().GetName() })
		for _, m := range ms {
			parent.children = append(parent.children, machineNode(m, o.hosts[m.GetSpec().GetHost()], now))
		}
	}
	sort.Slice(o.cps, func(i, j int) bool { return o.cps[i].GetMetadata().GetName() < o.cps[j].GetMetadata().GetName() })
	for _, cp := range o.cps {
		s := cp.GetStatus()
		n := objectNode("ControlPlane/"+cp.GetMetadata().GetName(), s.GetConditions(), now, "Ready")
		n.name += fmt.Sprintf(" (%s, %d/%d ready, %d up to date, %d etcd members)", cp.GetSpec().GetVersion(), s.GetReadyReplicas(), cp.GetSpec().GetReplicas(), s.GetUpdatedReplicas(), s.GetEtcdMembers())
		addMachines(n, "ControlPlane/"+cp.GetMetadata().GetName())
		root.children = append(root.children, n)
	}
	sort.Slice(o.mds, func(i, j int) bool { return o.mds[i].GetMetadata().GetName() < o.mds[j].GetMetadata().GetName() })
	for _, md := range o.mds {
		s := md.GetStatus()
		n := objectNode("MachineDeployment/"+md.GetMetadata().GetName(), s.GetConditions(), now, "Available", "Ready")
		n.name += fmt.Sprintf(" (%s, %d/%d ready, %d up to date)", md.GetSpec().GetVersion(), s.GetReadyReplicas(), md.GetSpec().GetReplicas(), s.GetUpdatedReplicas())
		addMachines(n, "MachineDeployment/"+md.GetMetadata().GetName())
		root.children = append(root.children, n)
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
		n := &treeNode{name: label, ready: "-"}
		addMachines(n, owner)
		root.children = append(root.children, n)
	}
	sort.Slice(o.hcs, func(i, j int) bool { return o.hcs[i].GetMetadata().GetName() < o.hcs[j].GetMetadata().GetName() })
	for _, hc := range o.hcs {
		s := hc.GetStatus()
		n := objectNode("HealthCheck/"+hc.GetMetadata().GetName(), s.GetConditions(), now, "RemediationAllowed")
		n.name += fmt.Sprintf(" (%d/%d healthy)", s.GetCurrentHealthy(), s.GetExpectedMachines())
		root.children = append(root.children, n)
	}
	return root
}

func machineNode(m *typesv1.Machine, h *typesv1.Host, now time.Time) *treeNode {
	s := m.GetStatus()
	n := objectNode("Machine/"+m.GetMetadata().GetName(), s.GetConditions(), now, "NodeReady", "Ready")
	extra := []string{m.GetSpec().GetVersion()}
	if s.GetNodeName() != "" {
		extra = append(extra, "node "+s.GetNodeName())
	}
	if s.GetEtcdMember() != "" {
		extra = append(extra, "etcd "+s.GetEtcdMember())
	}
	n.name += " (" + strings.Join(extra, ", ") + ")"
	if m.GetMetadata().GetDeletionTimestamp() != nil {
		n.name += " deleting"
	}
	if h == nil {
		n.children = append(n.children, &treeNode{name: "Host/" + m.GetSpec().GetHost(), ready: "-", message: "host not found"})
		return n
	}
	n.children = append(n.children, hostNode(h, now))
	return n
}

// hostNode shows a host's state, BMC, power, agent and last operation.
func hostNode(h *typesv1.Host, now time.Time) *treeNode {
	s := h.GetStatus()
	n := &treeNode{name: "Host/" + h.GetMetadata().GetName(), ready: hostState(s.GetState()), reason: s.GetProvisioningStep()}
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
		msg = append(msg, "agent seen "+age(hb, now)+" ago")
	}
	if s.GetErrorReason() != "" {
		msg = append(msg, "error: "+s.GetErrorReason())
	}
	n.message = strings.Join(msg, ", ")
	if op := s.GetLastOperation(); op.GetKind() != "" {
		opn := &treeNode{name: "Operation/" + op.GetKind(), ready: op.GetState(), since: age(op.GetStarted(), now)}
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
		opn.message = strings.Join(m, ", ")
		n.children = append(n.children, opn)
	}
	n.children = append(n.children, conditionNodes(s.GetConditions(), now)...)
	return n
}

// writeTree prints the tree as a table with box-drawing prefixes.
func writeTree(out io.Writer, root *treeNode) error {
	var buf strings.Builder
	w := tabwriter.NewWriter(&buf, 0, 8, 2, ' ', 0)
	fmt.Fprintln(w, "NAME\tREADY\tSEVERITY\tREASON\tSINCE\tMESSAGE")
	var walk func(n *treeNode, prefix, branch string)
	walk = func(n *treeNode, prefix, branch string) {
		fmt.Fprintf(w, "%s%s%s\t%s\t%s\t%s\t%s\t%s\n", prefix, branch, n.name, dash(n.ready), dash(n.severity), dash(n.reason), dash(n.since), clean(n.message))
		child := prefix
		switch branch {
		case "├─":
			child += "│ "
		case "└─":
			child += "  "
		}
		for i, c := range n.children {
			b := "├─"
			if i == len(n.children)-1 {
				b = "└─"
			}
			walk(c, child, b)
		}
	}
	walk(root, "", "")
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

// describeCluster writes `kilnctl describe cluster NAME`: the tree of
// the cluster's objects with every condition, then the cluster's recent
// events.
func (a *app) describeCluster(ctx context.Context, out io.Writer, c controllerv1.ResourcesClient, name string, events int64) error {
	o, err := a.loadCluster(ctx, c, name)
	if err != nil {
		return err
	}
	now := a.opts.Now()
	if err := writeTree(out, clusterTree(o, now)); err != nil {
		return err
	}
	cctx, cancel := a.call(ctx)
	defer cancel()
	evs, err := c.ListEvents(cctx, &controllerv1.ListEventsRequest{ObjectKind: "Cluster", ObjectName: name, Limit: events})
	if err != nil {
		return a.rpcError("describe cluster/"+name+": events", err)
	}
	fmt.Fprintln(out, "Events:")
	if len(evs.GetEvents()) == 0 {
		fmt.Fprintln(out, "  <none>")
		return nil
	}
	w := tabwriter.NewWriter(out, 0, 8, 2, ' ', 0)
	fmt.Fprintln(w, "  AGE\tTYPE\tREASON\tMESSAGE")
	for _, e := range evs.GetEvents() {
		fmt.Fprintf(w, "  %s\t%s\t%s\t%s\n", age(e.GetTime(), now), dash(e.GetType()), dash(e.GetReason()), clean(e.GetMessage()))
	}
	return w.Flush()
}
