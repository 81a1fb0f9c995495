package clusterplan

import (
	"fmt"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// DefaultNodeStartupTimeout is how long a machine may go without a node
// before it counts as unhealthy, when the HealthCheck does not say.
const DefaultNodeStartupTimeout = 10 * time.Minute

// HealthCheckInput is what PlanHealthCheck decides from.
type HealthCheckInput struct {
	HealthCheck *typesv1.HealthCheck
	// Machines are all Machines of the cluster; the check keeps those
	// whose labels match its selector.
	Machines []*typesv1.Machine
}

// HealthCheckPlan is what PlanHealthCheck decided.
type HealthCheckPlan struct {
	Actions []Action
	Status  *typesv1.HealthCheckStatus
	// Unhealthy maps each unhealthy machine to why.
	Unhealthy map[string]string
	// Requeue is when the next condition timeout runs out.
	Requeue time.Duration
}

// PlanHealthCheck finds the machines that are unhealthy: a machine
// condition that has held an unhealthy status for at least its timeout
// (counted from its last transition time), or no node nodeStartupTimeout
// after the machine was created. When at most maxUnhealthy (count or
// percentage of the checked machines, rounded down; default 100%) are
// unhealthy, it remediates them: a control-plane member first leaves etcd
// (when quorum allows), then the machine is deleted, its host wiped and
// the owner creates a replacement. Above maxUnhealthy it remediates
// nothing and sets RemediationAllowed False saying why.
func PlanHealthCheck(in HealthCheckInput, now time.Time) HealthCheckPlan {
	hc := in.HealthCheck
	spec := hc.GetSpec()
	gen := hc.GetMetadata().GetGeneration()
	status := proto.Clone(hc.GetStatus()).(*typesv1.HealthCheckStatus)
	if status == nil {
		status = &typesv1.HealthCheckStatus{}
	}
	p := HealthCheckPlan{Unhealthy: map[string]string{}}

	startup := DefaultNodeStartupTimeout
	if d, err := time.ParseDuration(spec.GetNodeStartupTimeout()); err == nil && d > 0 {
		startup = d
	}
	maxU, err := validation.ParseIntOrPercent(spec.GetMaxUnhealthy(), validation.IntOrPercent{Value: 100, Percent: true})
	if err != nil {
		maxU = validation.IntOrPercent{Value: 100, Percent: true}
	}

	var checked []machine
	var all []machine
	for _, m := range in.Machines {
		if m.GetSpec().GetCluster() != spec.GetCluster() {
			continue
		}
		x := machine{m}
		all = append(all, x)
		if x.deleting() || !matches(m.GetMetadata().GetLabels(), spec.GetSelector()) {
			continue
		}
		checked = append(checked, x)
	}
	var unhealthy []machine
	for _, m := range checked {
		why, wait := unhealthyReason(m, spec.GetUnhealthyConditions(), startup, now)
		p.Requeue = minPositive(p.Requeue, wait)
		if why != "" {
			p.Unhealthy[m.name()] = why
			unhealthy = append(unhealthy, m)
		}
	}
	limit := maxU.Scaled(len(checked), false)
	status.ExpectedMachines = int32(len(checked))
	status.CurrentHealthy = int32(len(checked) - len(unhealthy))
	status.RemediationsAllowed = int32(max(0, limit-len(unhealthy)))

	conds := status.GetConditions()
	if len(unhealthy) > limit {
		c := conditions.New(ConditionRemediationAllowed, conditions.False, ReasonTooManyUnhealthy,
			fmt.Sprintf("%d of %d unhealthy exceeds maxUnhealthy %s: remediation stopped; fix the common cause (network, power, a bad image) first", len(unhealthy), len(checked), maxU))
		c.Severity = "Warning"
		c.ObservedGeneration = gen
		conds, _ = conditions.Set(conds, c, now)
		status.Conditions = conds
		p.Status = status
		return p
	}
	c := conditions.New(ConditionRemediationAllowed, conditions.True, ReasonAsExpected,
		fmt.Sprintf("%d of %d unhealthy (maxUnhealthy %s)", len(unhealthy), len(checked), maxU))
	c.ObservedGeneration = gen
	conds, _ = conditions.Set(conds, c, now)
	status.Conditions = conds
	p.Status = status

	for _, m := range unhealthy {
		why := "remediation: " + p.Unhealthy[m.name()]
		if m.member() != "" {
			// A control-plane member leaves etcd first, if quorum allows.
			var peers []machine
			for _, o := range all {
				if o.m.GetSpec().GetOwner() == m.m.GetSpec().GetOwner() {
					peers = append(peers, o)
				}
			}
			if msg := quorumCheck(peers, m); msg != "" {
				p.Unhealthy[m.name()] += "; not remediated: " + msg
				continue
			}
			p.Actions = append(p.Actions, RemoveEtcdMember{Machine: m.name(), Member: m.member()})
			continue
		}
		p.Actions = append(p.Actions, DeleteMachine{Machine: m.name(), Host: m.host(), Reason: why, Remediation: true})
	}
	return p
}

// unhealthyReason says why m is unhealthy ("" when it is not) and, when
// it is not yet, how long until a running timeout expires.
func unhealthyReason(m machine, rules []*typesv1.UnhealthyCondition, startup time.Duration, now time.Time) (string, time.Duration) {
	if m.node() == "" {
		since := m.created()
		if bt := m.m.GetStatus().GetBootstrapTime(); bt != nil {
			since = bt.AsTime()
		}
		age := now.Sub(since)
		if age >= startup {
			return fmt.Sprintf("no node %s after creation (nodeStartupTimeout %s)", age.Round(time.Second), startup), 0
		}
		return "", startup - age
	}
	var wait time.Duration
	for _, r := range rules {
		c := conditions.Get(m.m.GetStatus().GetConditions(), r.GetType())
		if c == nil || c.GetStatus() != r.GetStatus() {
			continue
		}
		timeout, err := time.ParseDuration(r.GetTimeout())
		if err != nil {
			continue
		}
		held := now.Sub(c.GetLastTransitionTime().AsTime())
		if held >= timeout {
			return fmt.Sprintf("%s=%s for %s (timeout %s)", r.GetType(), r.GetStatus(), held.Round(time.Second), timeout), 0
		}
		wait = minPositive(wait, timeout-held)
	}
	return "", wait
}
