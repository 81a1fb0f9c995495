// Package machineplan decides what happens to one Machine and to the
// machines and hosts that cluster deletions leave behind. Plan takes a
// Machine, its Host, its Cluster and the time and returns the Machine's
// phase, the conditions to set, the actions for the executor
// (controller/clusterexec) and when to look again: bind the host, wait for
// it to be Provisioned, bootstrap the node (prepare, preflight, kubeadm
// init or join) or re-attach to the kubeadm operation an earlier
// controller started, retry a failed operation after a jittered backoff
// until its attempts run out (a refused preflight after a backoff of its
// own, and every WaitInterval when it only waits for the host to finish
// something, such as its first boot's image import), probe, and tear a
// deleted Machine down.
// PlanCleanup decides which Machines belong to deleted Clusters and which
// hosts are bound to Machines that are gone.
//
// Everything the planner needs is in the store: the attempt number
// (annotation AnnotationAttempt, part of every operation id), the state of
// the last operation (condition ConditionOperation, written by the
// executor before it starts one and when it ends), the failure and its
// time. A controller that restarts therefore plans what its predecessor
// would have: it re-attaches to an operation recorded as Running instead
// of starting it twice, and waits out the backoff of one that failed. The
// planner does no I/O and reads no clock.
package machineplan

import (
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/kilnhq/kiln/controller/clusterplan"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/liveness"
	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Machine phases (status.phase).
const (
	// PhasePending: created, its host not yet bound.
	PhasePending = "Pending"
	// PhaseProvisioning: its host is being laid with the image.
	PhaseProvisioning = "Provisioning"
	// PhaseWaiting: a join waits for the control plane's init.
	PhaseWaiting = "WaitingForControlPlane"
	// PhaseBootstrapping: prepare, preflight and kubeadm run.
	PhaseBootstrapping = "Bootstrapping"
	// PhaseRunning: the node joined; it is probed.
	PhaseRunning = "Running"
	// PhaseFailed: the bootstrap was refused or failed; it is retried
	// after a backoff while attempts are left (the phase stays Failed
	// until a bootstrap succeeds).
	PhaseFailed = "Failed"
	// PhaseDeleting: the machine is torn down.
	PhaseDeleting = "Deleting"
)

// Annotations on a Machine.
const (
	// AnnotationBootstrap says how the node joins: one of
	// clusterplan.BootstrapInit, BootstrapJoinControlPlane, BootstrapJoin.
	AnnotationBootstrap = "kiln.dev/bootstrap"
	// AnnotationAttempt is the number of the machine's current (or last)
	// bootstrap attempt, from 0; it is part of the operation ids, so a
	// retry starts new operations and a restart re-attaches to the
	// current ones. The executor records it when it starts an attempt.
	AnnotationAttempt = "kiln.dev/bootstrap-attempt"
	// AnnotationRefusals counts the preflight refusals in a row of the
	// machine's current attempt (the executor adds one with each Refused
	// outcome and removes it with any other): the n-th refusal is retried
	// after Config.RefusalBackoff's n-th delay.
	AnnotationRefusals = "kiln.dev/bootstrap-refusals"
	// AnnotationClusterUID is the uid of the Cluster the Machine was
	// created for. A Machine whose Cluster of that name and uid is gone
	// belongs to a deleted cluster (PlanCleanup); Machines without it
	// (made by hand, by simulation mode) are never taken for those.
	AnnotationClusterUID = "kiln.dev/cluster-uid"
)

// Machine conditions.
const (
	// ConditionBootstrapped is True once kubeadm init or join succeeded.
	ConditionBootstrapped = clusterplan.MachineBootstrapped
	// ConditionBootstrapFailed is True while the bootstrap is refused (a
	// failed preflight check) or its last operation failed.
	ConditionBootstrapFailed = clusterplan.MachineBootstrapFailed
	// ConditionHostProvisioned mirrors, until the machine's host is
	// Provisioned, what holds the host back.
	ConditionHostProvisioned = "HostProvisioned"
	// ConditionOperation is the state of the machine's bootstrap
	// operation of the current attempt, written by the executor: True,
	// reason Running, from just before it starts one (write-ahead) until
	// it ends; False with reason Succeeded, Failed (counted against the
	// attempts; its transition time is the failure's), Refused (the
	// preflight refused: nothing ran, not counted; retried after
	// Config.RefusalBackoff), Waiting (the preflight refused only with
	// checks in progress, such as the first boot's image import: not
	// counted; retried every Config.WaitInterval) or Lost (the agent does
	// not know the operation: it never started; not counted).
	ConditionOperation = "BootstrapOperation"
)

// Reasons of ConditionOperation.
const (
	ReasonRunning   = "Running"
	ReasonSucceeded = "Succeeded"
	ReasonFailed    = "Failed"
	ReasonRefused   = "Refused"
	ReasonWaiting   = "Waiting"
	ReasonLost      = "Lost"
)

// ReasonAttemptsExhausted is BootstrapFailed's reason once no attempt is
// left.
const ReasonAttemptsExhausted = "AttemptsExhausted"

// Config is the planner's policy.
type Config struct {
	// MaxAttempts is how many bootstrap operations a machine runs before
	// it stays Failed (default 3).
	MaxAttempts int
	// Backoff is the wait after a failed attempt (default 30s doubling
	// to 5m, 20% jitter seeded by the machine's uid, so the plan is a
	// function of its input).
	Backoff backoff.Policy
	// RefusalBackoff is the wait after the n-th preflight refusal in a
	// row (AnnotationRefusals; default 10s doubling to 5m, 20% jitter):
	// a refusal waits for someone to fix the host, and is not retried in
	// a loop meanwhile.
	RefusalBackoff backoff.Policy
	// WaitInterval is the fixed wait after a refusal whose failed checks
	// are all in progress (default 20s): it ends by itself, so it is
	// looked at again soon and not after a growing backoff.
	WaitInterval time.Duration
}

// DefaultBackoff is Config.Backoff's default.
var DefaultBackoff = backoff.Policy{Base: 30 * time.Second, Max: 5 * time.Minute, Factor: 2, Jitter: 0.2}

// DefaultRefusalBackoff is Config.RefusalBackoff's default.
var DefaultRefusalBackoff = backoff.Policy{Base: 10 * time.Second, Max: 5 * time.Minute, Factor: 2, Jitter: 0.2}

// DefaultWaitInterval is Config.WaitInterval's default.
const DefaultWaitInterval = 20 * time.Second

func (c Config) withDefaults() Config {
	if c.MaxAttempts <= 0 {
		c.MaxAttempts = 3
	}
	if c.Backoff.Base <= 0 {
		c.Backoff = DefaultBackoff
	}
	if c.RefusalBackoff.Base <= 0 {
		c.RefusalBackoff = DefaultRefusalBackoff
	}
	if c.WaitInterval <= 0 {
		c.WaitInterval = DefaultWaitInterval
	}
	return c
}

// Action is one step for the executor. The set is closed: BindHost,
// Bootstrap, Probe, Teardown. Each is idempotent.
type Action interface {
	fmt.Stringer
	isAction()
}

// BindHost binds Host to Machine (Host.status.machine, compare and
// swap). A host bound to another machine meanwhile is a Conflict; the
// next plan tears the machine down.
type BindHost struct {
	Machine, Host string
}

// Bootstrap runs the node's bootstrap under the operation ids of
// Attempt: unless Attach, record the attempt and ConditionOperation
// Running, then Prepare, Preflight and kubeadm (Mode); with Attach,
// follow the kubeadm operation an earlier executor started (Lost when the
// agent does not know it). The outcome is recorded in ConditionOperation
// (and BootstrapFailed, or Bootstrapped).
type Bootstrap struct {
	Machine, Host string
	Mode          string
	Attempt       int
	// OperationID is the kubeadm operation's id.
	OperationID string
	Attach      bool
}

// Probe asks the node's agent how it is and stores its conditions.
type Probe struct {
	Machine, Host string
}

// Teardown takes Machine out: mark it deleting, then (each only when set)
// kubeadm reset (with etcd member removal when RemoveEtcdMember), delete
// Node from the cluster, unbind Host (the host lifecycle then wipes it),
// and delete the Machine.
type Teardown struct {
	Machine string
	Host    string
	Reason  string
	// Reset runs kubeadm reset on the host.
	Reset            bool
	RemoveEtcdMember bool
	// Node is the Node object to delete ("" none).
	Node   string
	Unbind bool
}

func (BindHost) isAction()  {}
func (Bootstrap) isAction() {}
func (Probe) isAction()     {}
func (Teardown) isAction()  {}

func (a BindHost) String() string { return fmt.Sprintf("BindHost %s host=%s", a.Machine, a.Host) }
func (a Bootstrap) String() string {
	verb := "start"
	if a.Attach {
		verb = "attach"
	}
	return fmt.Sprintf("Bootstrap %s host=%s mode=%s attempt=%d %s=%s", a.Machine, a.Host, a.Mode, a.Attempt, verb, a.OperationID)
}
func (a Probe) String() string { return fmt.Sprintf("Probe %s host=%s", a.Machine, a.Host) }
func (a Teardown) String() string {
	s := fmt.Sprintf("Teardown %s host=%s", a.Machine, a.Host)
	if a.Reset {
		s += " reset"
	}
	if a.RemoveEtcdMember {
		s += " removeEtcdMember"
	}
	if a.Node != "" {
		s += " deleteNode=" + a.Node
	}
	if a.Unbind {
		s += " unbind"
	}
	if a.Reason != "" {
		s += fmt.Sprintf(" reason=%q", a.Reason)
	}
	return s
}

// Input is what Plan reads.
type Input struct {
	Machine *typesv1.Machine
	// Host is the machine's host; nil when it does not exist.
	Host *typesv1.Host
	// Cluster is the machine's cluster; nil when it does not exist.
	Cluster *typesv1.Cluster
	// Credentials is true once the cluster's init stored its join
	// credentials (a join needs them and Cluster.status.caHash).
	Credentials bool
}

// Output is Plan's decision.
type Output struct {
	// Phase is the machine's phase ("" leaves it).
	Phase string
	// Conditions are set on the machine (conditions.Set).
	Conditions []*typesv1.Condition
	Actions    []Action
	// Requeue is when to plan again even if nothing changes (0: on the
	// next change or pass).
	Requeue time.Duration
}

// Attempt is the machine's current attempt number (AnnotationAttempt).
func Attempt(m *typesv1.Machine) int {
	n, _ := strconv.Atoi(m.GetMetadata().GetAnnotations()[AnnotationAttempt])
	return n
}

// Refusals is the number of preflight refusals in a row of the machine's
// current attempt (AnnotationRefusals).
func Refusals(m *typesv1.Machine) int {
	n, _ := strconv.Atoi(m.GetMetadata().GetAnnotations()[AnnotationRefusals])
	return n
}

// OperationID is the id of the machine's operation kind ("prepare",
// "init", "join", "reset") in attempt: the same across controller
// restarts, new for a new Machine (uid) or a new attempt.
func OperationID(m *typesv1.Machine, kind string, attempt int) string {
	uid := m.GetMetadata().GetUid()
	if uid == "" {
		uid = strconv.FormatInt(m.GetMetadata().GetCreationTimestamp().AsTime().Unix(), 10)
	}
	id := kind + "." + m.GetMetadata().GetName() + "." + uid
	if attempt > 0 {
		id += ".a" + strconv.Itoa(attempt)
	}
	return id
}

// Mode is how the machine's node joins (AnnotationBootstrap, else from
// its role).
func Mode(m *typesv1.Machine) string {
	if b := m.GetMetadata().GetAnnotations()[AnnotationBootstrap]; b != "" {
		return b
	}
	if m.GetSpec().GetRole() == clusterplan.RoleControlPlane {
		return clusterplan.BootstrapJoinControlPlane
	}
	return clusterplan.BootstrapJoin
}

// Plan decides the next step of in.Machine at now.
func Plan(cfg Config, in Input, now time.Time) Output {
	cfg = cfg.withDefaults()
	m, h := in.Machine, in.Host
	name := m.GetMetadata().GetName()
	conds := m.GetStatus().GetConditions()
	hostName := m.GetSpec().GetHost()
	bound := h != nil && h.GetStatus().GetMachine() == name
	bootstrapped := conditions.IsTrue(conds, ConditionBootstrapped)

	if m.GetMetadata().GetDeletionTimestamp() != nil {
		return Output{Phase: PhaseDeleting, Actions: []Action{teardown(m, h, "")}}
	}
	switch {
	case h == nil:
		return Output{Phase: PhaseDeleting, Actions: []Action{teardown(m, h, "host "+hostName+" does not exist")}}
	case h.GetStatus().GetMachine() == "":
		phase := PhasePending
		if bootstrapped {
			phase = "" // released under a running node: bind it back
		}
		return Output{Phase: phase, Actions: []Action{BindHost{Machine: name, Host: hostName}}}
	case !bound:
		return Output{Phase: PhaseDeleting, Actions: []Action{teardown(m, h, "host "+hostName+" is bound to machine "+h.GetStatus().GetMachine())}}
	}

	if h.GetStatus().GetState() != typesv1.HostState_HOST_STATE_PROVISIONED {
		if bootstrapped {
			return Output{}
		}
		return Output{Phase: PhaseProvisioning, Conditions: []*typesv1.Condition{HostBlocker(h)}}
	}
	var out Output
	if c := conditions.Get(conds, ConditionHostProvisioned); c != nil && c.GetStatus() != conditions.True {
		out.Conditions = append(out.Conditions, conditions.New(ConditionHostProvisioned, conditions.True, "Provisioned",
			fmt.Sprintf("host %s laid with image %s and booted", hostName, h.GetStatus().GetImage())))
	}
	if bootstrapped {
		out.Phase = PhaseRunning
		if conditions.Get(conds, clusterplan.MachineDrained) == nil { // on its way out: no more probes
			out.Actions = append(out.Actions, Probe{Machine: name, Host: hostName})
		}
		return out
	}
	return bootstrap(cfg, in, now, out)
}

// bootstrap plans the bootstrap of a machine whose host is Provisioned.
func bootstrap(cfg Config, in Input, now time.Time, out Output) Output {
	m := in.Machine
	name, hostName := m.GetMetadata().GetName(), m.GetSpec().GetHost()
	conds := m.GetStatus().GetConditions()
	mode := Mode(m)
	kind := "join"
	if mode == clusterplan.BootstrapInit {
		kind = "init"
	}
	attempt := Attempt(m)
	failed := conditions.IsTrue(conds, ConditionBootstrapFailed)
	out.Phase = PhaseBootstrapping
	if failed {
		out.Phase = PhaseFailed // until a bootstrap succeeds
	}
	start := func(attempt int, attach bool) Output {
		out.Actions = append(out.Actions, Bootstrap{Machine: name, Host: hostName, Mode: mode, Attempt: attempt,
			OperationID: OperationID(m, kind, attempt), Attach: attach})
		return out
	}
	op := conditions.Get(conds, ConditionOperation)
	if op.GetStatus() == conditions.True {
		// Started by this or an earlier controller: follow it, never start
		// it twice.
		return start(attempt, true)
	}
	if mode != clusterplan.BootstrapInit && (!in.Credentials || in.Cluster.GetStatus().GetCaHash() == "") {
		if !failed {
			out.Phase = PhaseWaiting
		}
		return out
	}
	// A refusal (nothing ran) is retried under the same attempt: one
	// in progress (an image import) after the short fixed interval, any
	// other after the refusal backoff, so that a host nobody has fixed yet
	// is not checked in a loop.
	switch op.GetReason() {
	case ReasonWaiting:
		if wait := op.GetLastTransitionTime().AsTime().Add(cfg.WaitInterval).Sub(now); wait > 0 {
			out.Requeue = wait
			return out
		}
		return start(attempt, false)
	case ReasonRefused:
		d := cfg.RefusalBackoff.Delay(Refusals(m)-1, jitter(m, attempt))
		if wait := op.GetLastTransitionTime().AsTime().Add(d).Sub(now); wait > 0 {
			out.Requeue = wait
			return out
		}
		return start(attempt, false)
	case ReasonFailed:
	default:
		// Nothing ran yet or the operation was lost (it never reached
		// the agent): same attempt.
		return start(attempt, false)
	}
	if attempt+1 >= cfg.MaxAttempts {
		bf := conditions.Get(conds, ConditionBootstrapFailed)
		msg := fmt.Sprintf("%d of %d bootstrap attempts failed; no attempt is left: delete the machine to replace it (kilnctl delete machine %s); last: %s: %s",
			attempt+1, cfg.MaxAttempts, name, bf.GetReason(), bf.GetMessage())
		if bf.GetReason() == ReasonAttemptsExhausted {
			msg = bf.GetMessage()
		}
		out.Phase = PhaseFailed
		out.Conditions = append(out.Conditions, conditions.New(ConditionBootstrapFailed, conditions.True, ReasonAttemptsExhausted, msg))
		return out
	}
	at := op.GetLastTransitionTime().AsTime().Add(cfg.Backoff.Delay(attempt, jitter(m, attempt)))
	if wait := at.Sub(now); wait > 0 {
		out.Requeue = wait
		return out
	}
	return start(attempt+1, false)
}

// ReasonPreflightWaiting is BootstrapFailed's reason (False) while the
// preflight refuses only with checks in progress.
const ReasonPreflightWaiting = "PreflightWaiting"

// WaitingCondition is the BootstrapFailed condition to record with a
// Waiting outcome (msg: the checks in progress, what they wait for): False,
// reason ReasonPreflightWaiting, so that the machine says what it waits
// for without being Failed; nil when BootstrapFailed is True from a
// failed operation, which a wait does not undo (the phase stays Failed
// until a bootstrap succeeds).
func WaitingCondition(conds []*typesv1.Condition, msg string) *typesv1.Condition {
	if bf := conditions.Get(conds, ConditionBootstrapFailed); bf.GetStatus() == conditions.True && bf.GetReason() != "PreflightFailed" {
		return nil
	}
	return conditions.New(ConditionBootstrapFailed, conditions.False, ReasonPreflightWaiting, msg)
}

// jitter is a random source seeded by the machine and the attempt: the
// same plan for the same input, different delays for different machines.
func jitter(m *typesv1.Machine, attempt int) *rand.Rand {
	h := fnv.New64a()
	h.Write([]byte(m.GetMetadata().GetName() + "/" + m.GetMetadata().GetUid()))
	return rand.New(rand.NewPCG(h.Sum64(), uint64(attempt)))
}

// teardown is the Teardown of m on h (nil: gone).
func teardown(m *typesv1.Machine, h *typesv1.Host, reason string) Teardown {
	name := m.GetMetadata().GetName()
	bound := h != nil && h.GetStatus().GetMachine() == name
	t := Teardown{Machine: name, Host: m.GetSpec().GetHost(), Reason: reason, Unbind: bound, Node: m.GetStatus().GetNodeName()}
	if bound && conditions.IsTrue(m.GetStatus().GetConditions(), ConditionBootstrapped) &&
		h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_PROVISIONED {
		t.Reset = true
		t.RemoveEtcdMember = m.GetSpec().GetRole() == clusterplan.RoleControlPlane && m.GetStatus().GetEtcdMember() != ""
	}
	return t
}

// HostBlocker is the machine's HostProvisioned condition while its host h
// is not Provisioned: False, with the reason and message of what holds
// the host back (a False condition other than progress, such as
// ImageResolved, BMCReachable or Provisioned with a failed step; or the
// Error state's reason), else InProgress with the host's state and step.
func HostBlocker(h *typesv1.Host) *typesv1.Condition {
	name := h.GetMetadata().GetName()
	st := h.GetStatus()
	state := hostlife.StateName(st.GetState())
	where := state
	if s := st.GetProvisioningStep(); s != "" {
		where += ", step " + s
	}
	if state == "" {
		where = "not yet reconciled"
	}
	for _, c := range st.GetConditions() {
		// A missed heartbeat is expected while the host reboots.
		if c.GetStatus() != conditions.False || c.GetReason() == hostlife.ReasonInProgress || c.GetReason() == hostlife.ReasonNotWanted || c.GetType() == liveness.ConditionAgentReachable {
			continue
		}
		return conditions.New(ConditionHostProvisioned, conditions.False, c.GetReason(),
			fmt.Sprintf("host %s (%s): %s=False: %s (kilnctl describe host %s)", name, where, c.GetType(), c.GetMessage(), name))
	}
	if st.GetState() == typesv1.HostState_HOST_STATE_ERROR {
		return conditions.New(ConditionHostProvisioned, conditions.False, "HostError",
			fmt.Sprintf("host %s is in Error: %s (kilnctl describe host %s)", name, st.GetErrorReason(), name))
	}
	msg := fmt.Sprintf("host %s: %s", name, where)
	if le := st.GetLastError(); le != "" {
		msg += "; last error: " + le
	}
	return conditions.New(ConditionHostProvisioned, conditions.False, hostlife.ReasonInProgress, msg)
}
