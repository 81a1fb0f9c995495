// Package clusterplan decides how a cluster's machines change: which hosts
// become control-plane and worker Machines, in which order, and when a
// Machine is drained, leaves etcd and is deleted so its host is wiped and
// reimaged. It holds three pure planners (ControlPlane, MachineDeployment,
// HealthCheck): each takes the desired resource, the observed Machines and
// Hosts and the time, and returns the actions to run, the resource's next
// status (with conditions) and when to look again. They do no I/O and read
// no clock; the executor runs the actions and controller/hostlife images
// the hosts.
//
// The rules are Cluster API's: the control plane upgrades before the
// workers, no minor version is skipped, a kubelet is never newer than the
// API server, a control-plane rollout goes 3→4→3 and removes the old
// member from etcd before its host is wiped, a quorum pre-flight refuses a
// step that would break etcd quorum, a rollout drains before it deletes,
// and a node whose certificates expire within the cluster's renewal window
// is rolled out (a reimage renews everything).
package clusterplan

import (
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Machine roles.
const (
	RoleControlPlane = "control-plane"
	RoleWorker       = "worker"
)

// Bootstrap modes of a new Machine: how its host joins the cluster once
// its image is laid.
const (
	// BootstrapInit runs `kubeadm init`: the first control-plane member.
	BootstrapInit = "init"
	// BootstrapJoinControlPlane runs `kubeadm join --control-plane`.
	BootstrapJoinControlPlane = "join-control-plane"
	// BootstrapJoin runs `kubeadm join` as a worker.
	BootstrapJoin = "join"
)

// Machine condition types the planners read. The executor sets them from
// the agent's probes (NodeReady, EtcdMemberHealthy) and from its own work
// (Drained).
const (
	// MachineNodeReady is the node's Ready condition.
	MachineNodeReady = "NodeReady"
	// MachineEtcdHealthy is True while the machine's etcd member is healthy.
	MachineEtcdHealthy = "EtcdMemberHealthy"
	// MachineDrained is False (reason Draining) once a drain has started
	// and True when it finished. A machine with this condition is on its
	// way out: the planners count it as unavailable and finish its removal.
	MachineDrained = "Drained"
	// MachineBootstrapFailed is True while the machine's kubeadm init or
	// join is refused or failed (set by the executor).
	MachineBootstrapFailed = "BootstrapFailed"
)

// Condition types and reasons the planners set on ControlPlane,
// MachineDeployment and HealthCheck status.
const (
	ConditionReady              = "Ready"
	ConditionUpToDate           = "UpToDate"
	ConditionEtcdQuorum         = "EtcdQuorum"
	ConditionHostsAvailable     = "HostsAvailable"
	ConditionUpgradeAllowed     = "UpgradeAllowed"
	ConditionControlPlaneReady  = "ControlPlaneReady"
	ConditionRemediationAllowed = "RemediationAllowed"
	ConditionAvailable          = "Available"

	ReasonQuorumAtRisk        = "QuorumAtRisk"
	ReasonQuorumHealthy       = "QuorumHealthy"
	ReasonNoSpareHost         = "NoSpareHost"
	ReasonMinorVersionSkipped = "MinorVersionSkipped"
	ReasonDowngrade           = "Downgrade"
	ReasonRollingOut          = "RollingOut"
	ReasonScalingUp           = "ScalingUp"
	ReasonScalingDown         = "ScalingDown"
	ReasonProvisioning        = "Provisioning"
	ReasonWaitingForCP        = "WaitingForControlPlane"
	ReasonKubeletNewer        = "KubeletNewerThanAPIServer"
	ReasonTooManyUnhealthy    = "TooManyUnhealthy"
	ReasonAsExpected          = "AsExpected"
	ReasonBelowMinimum        = "BelowMinimumAvailable"
	ReasonRolloutBlocked      = "RolloutBlocked"
)

// Action is one step for the executor. The set is closed: CreateMachine,
// Drain, RemoveEtcdMember and DeleteMachine. Actions are idempotent; the
// planners repeat an action until its effect is observed.
type Action interface {
	fmt.Stringer
	isAction()
}

// CreateMachine binds Host to a new Machine named Machine. The host
// lifecycle then lays Image and runs kubeadm as Bootstrap says.
type CreateMachine struct {
	Machine   string
	Host      string
	Role      string
	Version   string
	Image     string
	Owner     string
	Bootstrap string
}

// Drain cordons Node and evicts its pods, honouring PodDisruptionBudgets,
// by a deadline: Timeout, or the executor's default drain timeout when 0
// (a drain never waits forever). The executor sets the machine's Drained
// condition: False (Draining) when it starts, True when done. When the
// deadline passes, Proceed says what happens: true (a MachineDeployment
// with nodeDrainTimeout, as in Cluster API) sets Drained True, reason
// DrainTimeout, and the removal goes on; false (control planes, and
// deployments without nodeDrainTimeout) sets Drained False, reason
// DrainTimeout, and the removal halts while the drain is tried again.
type Drain struct {
	Machine string
	Node    string
	Timeout time.Duration
	Proceed bool
}

// RemoveEtcdMember removes Member (the member of Machine) from etcd.
// Equivalent to: `etcdctl member remove ID`.
type RemoveEtcdMember struct {
	Machine string
	Member  string
}

// DeleteMachine deletes Machine; its Host is deprovisioned and wiped by
// the host lifecycle and becomes Available again (for a replacement, when
// the rollout reimages in place). Reason says why, for events.
type DeleteMachine struct {
	Machine string
	Host    string
	Reason  string
	// Remediation is true when a HealthCheck found the machine unhealthy.
	Remediation bool
}

func (CreateMachine) isAction()    {}
func (Drain) isAction()            {}
func (RemoveEtcdMember) isAction() {}
func (DeleteMachine) isAction()    {}

func (a CreateMachine) String() string {
	return fmt.Sprintf("CreateMachine %s host=%s role=%s version=%s image=%s bootstrap=%s", a.Machine, a.Host, a.Role, a.Version, a.Image, a.Bootstrap)
}

func (a Drain) String() string {
	s := fmt.Sprintf("Drain %s node=%s timeout=%s", a.Machine, a.Node, a.Timeout)
	if a.Proceed {
		s += " then=proceed"
	}
	return s
}

func (a RemoveEtcdMember) String() string {
	return fmt.Sprintf("RemoveEtcdMember %s member=%s", a.Machine, a.Member)
}

func (a DeleteMachine) String() string {
	return fmt.Sprintf("DeleteMachine %s host=%s reason=%q", a.Machine, a.Host, a.Reason)
}

// machine is the planners' view of one Machine.
type machine struct {
	m *typesv1.Machine
}

func (x machine) name() string   { return x.m.GetMetadata().GetName() }
func (x machine) host() string   { return x.m.GetSpec().GetHost() }
func (x machine) node() string   { return x.m.GetStatus().GetNodeName() }
func (x machine) member() string { return x.m.GetStatus().GetEtcdMember() }
func (x machine) deleting() bool { return x.m.GetMetadata().GetDeletionTimestamp() != nil }
func (x machine) ready() bool {
	return x.node() != "" && conditions.IsTrue(x.m.GetStatus().GetConditions(), MachineNodeReady)
}
func (x machine) etcdOK() bool {
	return x.member() != "" && conditions.IsTrue(x.m.GetStatus().GetConditions(), MachineEtcdHealthy)
}
func (x machine) removing() bool {
	return conditions.Get(x.m.GetStatus().GetConditions(), MachineDrained) != nil
}
func (x machine) drained() bool {
	return conditions.IsTrue(x.m.GetStatus().GetConditions(), MachineDrained)
}
func (x machine) available() bool { return x.ready() && !x.removing() && !x.deleting() }
func (x machine) created() time.Time {
	return x.m.GetMetadata().GetCreationTimestamp().AsTime()
}

// outdated says why x must be replaced to match version and image, or ""
// when it matches. renewal is the certificate renewal window (0: off).
func (x machine) outdated(version string, img resolution, renewal time.Duration, now time.Time) string {
	s := x.m.GetSpec()
	switch {
	case version != "" && s.GetVersion() != version:
		return fmt.Sprintf("rollout: version %s -> %s", s.GetVersion(), version)
	case !img.upToDate(s.GetImage()):
		return fmt.Sprintf("rollout: image %s -> %s", s.GetImage(), orReason(img.image, img.want))
	}
	if renewal > 0 {
		if na := x.m.GetStatus().GetCertificatesNotAfter(); na != nil && na.AsTime().Sub(now) < renewal {
			left := na.AsTime().Sub(now)
			return fmt.Sprintf("certificates expire in %s (renewal window %s)", days(left), days(renewal))
		}
	}
	return ""
}

// blocker says what holds x back, from its first False condition other
// than NodeReady ("; HostProvisioned=False ImageNotFound: image ... not
// found"), or "" when nothing is known. It is added to the planners'
// waiting messages so that the cause shows where the user looks.
func (x machine) blocker() string {
	for _, c := range x.m.GetStatus().GetConditions() {
		failed := c.GetType() == MachineBootstrapFailed && c.GetStatus() == conditions.True
		if !failed && (c.GetStatus() != conditions.False || c.GetType() == MachineNodeReady || c.GetType() == MachineDrained || c.GetType() == MachineBootstrapFailed) {
			continue
		}
		msg := c.GetMessage()
		if len(msg) > 300 {
			msg = msg[:300] + "..."
		}
		return fmt.Sprintf(": %s=%s %s: %s", c.GetType(), c.GetStatus(), c.GetReason(), msg)
	}
	return ""
}

// stuckReasons are the reasons of planner conditions that hold an object
// back until a person acts (as opposed to progress such as ScalingUp).
var stuckReasons = map[string]bool{
	ReasonImageNotFound: true, ReasonNoImageMatches: true, ReasonImageVersionMismatch: true,
	ReasonNoSpareHost: true, ReasonQuorumAtRisk: true, ReasonMinorVersionSkipped: true,
	ReasonDowngrade: true, ReasonKubeletNewer: true, ReasonTooManyUnhealthy: true,
	ReasonRolloutBlocked: true,
}

// Stuck reports whether c holds its object back until a person acts: a
// False condition with one of the planners' blocking reasons. The
// executor records a Warning event when such a condition appears.
func Stuck(c *typesv1.Condition) bool {
	return c.GetStatus() == conditions.False && stuckReasons[c.GetReason()]
}

// certRequeue is how long until x's certificates enter the renewal
// window; 0 when never or already.
func (x machine) certRequeue(renewal time.Duration, now time.Time) time.Duration {
	na := x.m.GetStatus().GetCertificatesNotAfter()
	if renewal <= 0 || na == nil {
		return 0
	}
	if d := na.AsTime().Add(-renewal).Sub(now); d > 0 {
		return d
	}
	return 0
}

func days(d time.Duration) string {
	if d < 0 {
		return "0d (expired)"
	}
	return fmt.Sprintf("%dd", int(d/(24*time.Hour)))
}

// owned returns the machines of owner ("ControlPlane/NAME") sorted by
// name.
func owned(ms []*typesv1.Machine, owner string) []machine {
	var out []machine
	for _, m := range ms {
		if m.GetSpec().GetOwner() == owner {
			out = append(out, machine{m})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name() < out[j].name() })
	return out
}

// spareHosts returns the hosts that are Available, bound to no Machine
// and match selector, sorted by name.
func spareHosts(hosts []*typesv1.Host, selector map[string]string, taken map[string]bool) []string {
	var out []string
	for _, h := range hosts {
		name := h.GetMetadata().GetName()
		if h.GetStatus().GetState() != typesv1.HostState_HOST_STATE_AVAILABLE || h.GetStatus().GetMachine() != "" || taken[name] {
			continue
		}
		if !matches(h.GetMetadata().GetLabels(), selector) {
			continue
		}
		out = append(out, name)
	}
	sort.Strings(out)
	return out
}

func matches(labels, selector map[string]string) bool {
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return true
}

func selectorString(sel map[string]string) string {
	if len(sel) == 0 {
		return "<all hosts>"
	}
	keys := make([]string, 0, len(sel))
	for k := range sel {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + sel[k]
	}
	return strings.Join(parts, ",")
}

// machineName names a new machine of owner on host, unique among the
// names in used, and adds it to used.
func machineName(ownerName, host string, used map[string]bool) string {
	base := ownerName + "-" + host
	name := base
	for i := 2; used[name]; i++ {
		name = fmt.Sprintf("%s-%d", base, i)
	}
	used[name] = true
	return name
}

// machineNames are the names of ms.
func machineNames(ms []*typesv1.Machine) map[string]bool {
	used := make(map[string]bool, len(ms))
	for _, m := range ms {
		used[m.GetMetadata().GetName()] = true
	}
	return used
}

// hostsInUse are the hosts bound to any of ms.
func hostsInUse(ms []*typesv1.Machine) map[string]bool {
	out := map[string]bool{}
	for _, m := range ms {
		out[m.GetSpec().GetHost()] = true
	}
	return out
}

// quorumCheck says whether removing the etcd member of victim keeps
// quorum: the current members must have quorum to commit the change, and
// the healthy members left must have quorum of the smaller cluster. It
// returns "" when it is safe, else why not, naming the members.
func quorumCheck(ms []machine, victim machine) string {
	var members, healthy, unhealthy []string
	for _, m := range ms {
		if m.member() == "" {
			continue
		}
		members = append(members, m.member())
		if m.etcdOK() {
			healthy = append(healthy, m.member())
		} else {
			unhealthy = append(unhealthy, m.member())
		}
	}
	n := len(members)
	if n == 0 || victim.member() == "" {
		return ""
	}
	left := len(healthy)
	if victim.etcdOK() {
		left--
	}
	q, qAfter := n/2+1, (n-1)/2+1
	if len(healthy) >= q && left >= qAfter && n > 1 {
		return ""
	}
	msg := fmt.Sprintf("removing etcd member %s would leave %d healthy of %d members, below quorum %d", victim.member(), left, n-1, qAfter)
	if len(healthy) < q {
		msg = fmt.Sprintf("only %d of %d etcd members are healthy, below quorum %d: removing member %s could not be committed", len(healthy), n, q, victim.member())
	}
	if n == 1 {
		msg = fmt.Sprintf("removing etcd member %s would remove the only member and lose the cluster's data: roll out with rolloutMaxSurge 1 onto a spare host", victim.member())
	}
	if len(unhealthy) > 0 {
		msg += "; unhealthy: " + strings.Join(unhealthy, ", ")
	}
	msg += "; healthy: " + orNone(healthy)
	return msg
}

func orNone(s []string) string {
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, ", ")
}

// minorSkip says why moving the machines' versions to target is refused:
// a skipped minor or a downgrade of a minor; "" when allowed.
func minorSkip(ms []machine, target string) (reason, msg string) {
	t, err := validation.ParseVersion(target)
	if err != nil {
		return "", ""
	}
	for _, m := range ms {
		v, err := validation.ParseVersion(m.m.GetSpec().GetVersion())
		if err != nil {
			continue
		}
		switch {
		case v.Major != t.Major || t.Minor > v.Minor+1:
			return ReasonMinorVersionSkipped, fmt.Sprintf("machine %s runs %s: %s -> %s skips a minor version; upgrade one minor at a time", m.name(), v, v.MinorString(), t.MinorString())
		case t.Minor < v.Minor:
			return ReasonDowngrade, fmt.Sprintf("machine %s runs %s: %s is a minor downgrade, which kubeadm cannot do", m.name(), v, t)
		}
	}
	return "", ""
}

// removal returns the actions that take x out: drain (when it has a node
// and is not drained; drainTimeout > 0 is a nodeDrainTimeout after which
// the removal proceeds, 0 the executor's default after which it halts),
// then leave etcd, then delete. It returns the next
// action only, so each is observed before the next.
func removal(x machine, drainTimeout time.Duration, reason string) Action {
	switch {
	case x.node() != "" && !x.drained() && x.ready():
		return Drain{Machine: x.name(), Node: x.node(), Timeout: drainTimeout, Proceed: drainTimeout > 0}
	case x.member() != "":
		return RemoveEtcdMember{Machine: x.name(), Member: x.member()}
	default:
		return DeleteMachine{Machine: x.name(), Host: x.host(), Reason: reason}
	}
}

// setCond sets a condition with the planners' defaults.
func setCond(list []*typesv1.Condition, gen int64, now time.Time, t, status, reason, msg string) []*typesv1.Condition {
	c := conditions.New(t, status, reason, msg)
	c.ObservedGeneration = gen
	if status == conditions.False && t != ConditionUpToDate {
		c.Severity = "Warning"
	}
	list, _ = conditions.Set(list, c, now)
	return list
}

func minPositive(a, b time.Duration) time.Duration {
	switch {
	case a <= 0:
		return b
	case b <= 0:
		return a
	case a < b:
		return a
	}
	return b
}
