package dashboard

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/kilnhq/kiln/cmd/kilnctl/internal/describe"
	opprogress "github.com/kilnhq/kiln/internal/progress"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// The views are pure: a fleet (and the clock) in, what a page shows out.

// count is one bar of a distribution.
type count struct {
	Key string
	N   int
	// Percent is N's share of the distribution's total.
	Percent float64
}

// distribution counts keys, largest first (ties by key), or in order
// when order is given (keys not in order after, by key).
func distribution(keys []string, order []string) []count {
	n := map[string]int{}
	for _, k := range keys {
		n[k]++
	}
	out := make([]count, 0, len(n))
	for k, v := range n {
		out = append(out, count{Key: k, N: v, Percent: 100 * float64(v) / float64(len(keys))})
	}
	rank := func(k string) int {
		if i := slices.Index(order, k); i >= 0 {
			return i
		}
		return len(order)
	}
	slices.SortFunc(out, func(a, b count) int {
		if order != nil {
			if c := cmp.Compare(rank(a.Key), rank(b.Key)); c != 0 {
				return c
			}
			return cmp.Compare(a.Key, b.Key)
		}
		if a.N != b.N {
			return cmp.Compare(b.N, a.N)
		}
		return cmp.Compare(a.Key, b.Key)
	})
	return out
}

// hostStates is the lifecycle's order, for the hosts-by-state bars.
var hostStates = []string{"Registering", "Inspecting", "Available", "Provisioning", "Provisioned", "Deprovisioning", "Wiping", "Error", "-"}

// clusterRow is one cluster on the overview.
type clusterRow struct {
	Name, Version, Phase, Wave string
	Ready                      *typesv1.Condition
	// ControlPlane and Workers are "ready/desired" over the cluster's
	// control planes and deployments.
	ControlPlane, Workers string
	Rolling               bool
}

// rollout is a control plane or deployment not yet up to date.
type rollout struct {
	Cluster, Wave, Kind, Name, Version string
	Updated, Replicas                  int32
	Reason, Message                    string
	Percent                            float64
}

// bmcRow is a host whose BMC does not answer.
type bmcRow struct {
	Host, Protocol, Address, Reason, Message, Since string
}

// overview is the fleet overview page.
type overview struct {
	Clusters        []clusterRow
	ClustersByPhase []count
	ClusterVersions []count
	// Nodes are the machines: by Kubernetes version and by image.
	Nodes        int
	NodeVersions []count
	NodeImages   []count
	Hosts        int
	HostsByState []count
	// HostImages are the images laid on hosts' disks (status.image).
	HostImages     []count
	BMCUnreachable []bmcRow
	Rollouts       []rollout
}

// bmcReachable is the condition bmc/ sets on hosts (bmc.ConditionBMCReachable).
const bmcReachable = "BMCReachable"

func findCondition(conds []*typesv1.Condition, t string) *typesv1.Condition {
	for _, c := range conds {
		if c.GetType() == t {
			return c
		}
	}
	return nil
}

func viewOverview(f *fleet, now time.Time) overview {
	var o overview
	waves := map[string]string{}
	var phases, versions []string
	for _, c := range f.Clusters {
		name := c.GetMetadata().GetName()
		waves[name] = c.GetMetadata().GetLabels()["upgrade-wave"]
		phases = append(phases, describe.Dash(c.GetStatus().GetPhase()))
		versions = append(versions, describe.Dash(c.GetSpec().GetKubernetesVersion()))
	}
	o.ClustersByPhase = distribution(phases, nil)
	o.ClusterVersions = distribution(versions, nil)

	type tally struct{ ready, want int32 }
	cpT, mdT := map[string]*tally{}, map[string]*tally{}
	rolling := map[string]bool{}
	add := func(m map[string]*tally, cluster string, ready, want int32) {
		if m[cluster] == nil {
			m[cluster] = &tally{}
		}
		m[cluster].ready += ready
		m[cluster].want += want
	}
	rollingOut := func(conds []*typesv1.Condition, updated, replicas int32) (*typesv1.Condition, bool) {
		c := findCondition(conds, "UpToDate")
		if c != nil {
			return c, c.GetStatus() == "False"
		}
		return nil, updated < replicas
	}
	for _, cp := range f.ControlPlanes {
		s, sp := cp.GetStatus(), cp.GetSpec()
		add(cpT, sp.GetCluster(), s.GetReadyReplicas(), sp.GetReplicas())
		if c, ok := rollingOut(s.GetConditions(), s.GetUpdatedReplicas(), sp.GetReplicas()); ok {
			rolling[sp.GetCluster()] = true
			o.Rollouts = append(o.Rollouts, newRollout(sp.GetCluster(), waves, "ControlPlane", cp.GetMetadata().GetName(), sp.GetVersion(), s.GetUpdatedReplicas(), sp.GetReplicas(), c))
		}
	}
	for _, md := range f.MachineDeployments {
		s, sp := md.GetStatus(), md.GetSpec()
		add(mdT, sp.GetCluster(), s.GetReadyReplicas(), sp.GetReplicas())
		if c, ok := rollingOut(s.GetConditions(), s.GetUpdatedReplicas(), sp.GetReplicas()); ok {
			rolling[sp.GetCluster()] = true
			o.Rollouts = append(o.Rollouts, newRollout(sp.GetCluster(), waves, "MachineDeployment", md.GetMetadata().GetName(), sp.GetVersion(), s.GetUpdatedReplicas(), sp.GetReplicas(), c))
		}
	}
	// Waves in order ("" last), then cluster, control planes first.
	slices.SortStableFunc(o.Rollouts, func(a, b rollout) int {
		if (a.Wave == "") != (b.Wave == "") {
			if a.Wave == "" {
				return 1
			}
			return -1
		}
		if c := cmp.Compare(a.Wave, b.Wave); c != 0 {
			return c
		}
		return cmp.Compare(a.Cluster, b.Cluster)
	})
	frac := func(t *tally) string {
		if t == nil {
			return "-"
		}
		return fmt.Sprintf("%d/%d", t.ready, t.want)
	}
	for _, c := range f.Clusters {
		name := c.GetMetadata().GetName()
		ready := findCondition(c.GetStatus().GetConditions(), "Ready")
		if ready == nil {
			ready = findCondition(c.GetStatus().GetConditions(), "Available")
		}
		o.Clusters = append(o.Clusters, clusterRow{
			Name: name, Version: describe.Dash(c.GetSpec().GetKubernetesVersion()), Phase: describe.Dash(c.GetStatus().GetPhase()),
			Wave: waves[name], Ready: ready, ControlPlane: frac(cpT[name]), Workers: frac(mdT[name]), Rolling: rolling[name],
		})
	}

	o.Nodes = len(f.Machines)
	var nv, ni []string
	for _, m := range f.Machines {
		nv = append(nv, describe.Dash(m.GetSpec().GetVersion()))
		ni = append(ni, describe.Dash(m.GetSpec().GetImage()))
	}
	o.NodeVersions = distribution(nv, nil)
	o.NodeImages = distribution(ni, nil)

	o.Hosts = len(f.Hosts)
	var hs, hi []string
	for _, h := range f.Hosts {
		s := h.GetStatus()
		hs = append(hs, describe.HostState(s.GetState()))
		if s.GetImage() != "" {
			hi = append(hi, s.GetImage())
		}
		if c := findCondition(s.GetConditions(), bmcReachable); c != nil && c.GetStatus() == "False" {
			b := h.GetSpec().GetBmc()
			o.BMCUnreachable = append(o.BMCUnreachable, bmcRow{
				Host: h.GetMetadata().GetName(), Protocol: b.GetProtocol(), Address: b.GetAddress(),
				Reason: c.GetReason(), Message: c.GetMessage(), Since: describe.Age(c.GetLastTransitionTime(), now),
			})
		}
	}
	o.HostsByState = distribution(hs, hostStates)
	o.HostImages = distribution(hi, nil)
	return o
}

func newRollout(cluster string, waves map[string]string, kind, name, version string, updated, replicas int32, c *typesv1.Condition) rollout {
	r := rollout{Cluster: cluster, Wave: waves[cluster], Kind: kind, Name: name, Version: version,
		Updated: updated, Replicas: replicas, Reason: c.GetReason(), Message: c.GetMessage()}
	if replicas > 0 {
		r.Percent = 100 * float64(min(updated, replicas)) / float64(replicas)
	}
	return r
}

// hostsView is the list of hosts, all or those in one state.
type hostsView struct {
	State string
	Hosts []*typesv1.Host
	// Total is the number of hosts in the fleet.
	Total int
	// States are the hosts by state, for the filter.
	States []count
}

func viewHostList(f *fleet, state string) hostsView {
	v := hostsView{State: state, Total: len(f.Hosts)}
	states := make([]string, 0, len(f.Hosts))
	for _, h := range f.Hosts {
		st := describe.HostState(h.GetStatus().GetState())
		states = append(states, st)
		if state == "" || st == state {
			v.Hosts = append(v.Hosts, h)
		}
	}
	v.States = distribution(states, hostStates)
	return v
}

// progress is an operation's progress as the controller stores it.
type progress struct {
	Percent float64
	Message string
}

// progressOf is op's progress, or nil when the controller reports none:
// a running lay's or wipe's byte progress as the controller stores it
// from the agent's reports (bytes, rate, ETA: status.lastOperation.progress),
// otherwise the percent alone.
func progressOf(op *typesv1.OperationStatus, now time.Time) *progress {
	if p := op.GetProgress(); opprogress.Known(p) && op.GetState() == "Running" {
		pct := p.GetPercent()
		if pct == 0 && p.GetTotalBytes() > 0 {
			pct = 100 * float64(p.GetDoneBytes()) / float64(p.GetTotalBytes())
		}
		return &progress{Percent: min(max(pct, 0), 100), Message: opprogress.Line(p, now)}
	}
	if op.GetPercent() <= 0 {
		return nil
	}
	return &progress{Percent: min(max(op.GetPercent(), 0), 100), Message: op.GetMessage()}
}

// hostView is the host page.
type hostView struct {
	Host *typesv1.Host
	// Tree is the host's row of `kilnctl describe cluster`: state, BMC,
	// power, last operation and every condition.
	Tree     []describe.Row
	BMC      *typesv1.Condition
	Cluster  string
	Progress *progress
	// Journal is the host's operations the dashboard saw, newest first.
	Journal []*typesv1.OperationStatus
	Events  []*typesv1.Event
	Disks   []*typesv1.Disk
	NICs    []*typesv1.NIC
}

func viewHostPage(h *typesv1.Host, journal []*typesv1.OperationStatus, cluster string, events []*typesv1.Event, now time.Time) hostView {
	s := h.GetStatus()
	v := hostView{
		Host: h, Tree: describe.Rows(describe.HostNode(h, now)), BMC: findCondition(s.GetConditions(), bmcReachable),
		Cluster: cluster, Events: events, Disks: s.GetFacts().GetDisks(), NICs: s.GetFacts().GetNics(),
	}
	if op := s.GetLastOperation(); op.GetKind() != "" {
		v.Progress = progressOf(op, now)
	}
	v.Journal = make([]*typesv1.OperationStatus, len(journal))
	for i, op := range journal {
		v.Journal[len(journal)-1-i] = op
	}
	return v
}

// clusterView is the cluster page.
type clusterView struct {
	Cluster *typesv1.Cluster
	Tree    []describe.Row
	Events  []*typesv1.Event
}

// clusterOf names the cluster of the host's machine, or "".
func clusterOf(f *fleet, h *typesv1.Host) string {
	m := h.GetStatus().GetMachine()
	if m == "" {
		return ""
	}
	for _, x := range f.Machines {
		if x.GetMetadata().GetName() == m {
			return x.GetSpec().GetCluster()
		}
	}
	return ""
}

// conditionClass is the CSS class of a condition's status: a False
// condition of severity Info (an operation that ended well, a check that
// does not apply) is not a failure.
func conditionClass(status, severity string) string {
	if strings.EqualFold(status, "false") && severity == "Info" {
		return "none"
	}
	return statusClass(status)
}

// statusClass is the CSS class of a condition status or host state.
func statusClass(s string) string {
	switch strings.ToLower(s) {
	case "true", "provisioned", "available", "succeeded", "ready":
		return "ok"
	case "false", "error", "failed", "interrupted", "notready":
		return "bad"
	case "unknown", "running", "pending", "bootstrapping", "provisioning", "inspecting", "registering", "wiping", "deprovisioning":
		return "busy"
	}
	return "none"
}
