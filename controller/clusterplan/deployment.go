package clusterplan

import (
	"fmt"
	"sort"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Strategy types of a MachineDeployment.
const (
	StrategyRollingUpdate = "RollingUpdate"
	StrategyOnDelete      = "OnDelete"
)

// DeploymentInput is what PlanMachineDeployment decides from.
type DeploymentInput struct {
	Cluster           *typesv1.Cluster
	ControlPlane      *typesv1.ControlPlane
	MachineDeployment *typesv1.MachineDeployment
	// Machines are all Machines of the cluster (control plane included:
	// the API server's version is that of its oldest member).
	Machines []*typesv1.Machine
	Hosts    []*typesv1.Host
	// Images are all Images (see ControlPlaneInput.Images).
	Images []*typesv1.Image
}

// DeploymentPlan is what PlanMachineDeployment decided.
type DeploymentPlan struct {
	Actions []Action
	Status  *typesv1.MachineDeploymentStatus
	Requeue time.Duration
}

// Bounds are a rolling update's limits resolved against replicas.
type Bounds struct {
	MaxSurge, MaxUnavailable int
}

// ResolveBounds turns a strategy's maxSurge and maxUnavailable into counts
// as Kubernetes does: defaults 1 and 0, a percentage of surge rounds up
// and one of unavailable down, and when both come out 0 unavailable
// becomes 1 so a rollout can progress. Unparseable values take the
// defaults (validation refuses them on apply).
func ResolveBounds(st *typesv1.RolloutStrategy, replicas int) Bounds {
	surge, err := validation.ParseIntOrPercent(st.GetMaxSurge(), validation.IntOrPercent{Value: 1})
	if err != nil {
		surge = validation.IntOrPercent{Value: 1}
	}
	unav, err := validation.ParseIntOrPercent(st.GetMaxUnavailable(), validation.IntOrPercent{})
	if err != nil {
		unav = validation.IntOrPercent{}
	}
	b := Bounds{MaxSurge: surge.Scaled(replicas, true), MaxUnavailable: unav.Scaled(replicas, false)}
	if b.MaxSurge == 0 && b.MaxUnavailable == 0 {
		b.MaxUnavailable = 1
	}
	return b
}

// PlanMachineDeployment decides the next step of a MachineDeployment.
//
// New machines are created only once the control plane is Ready and its
// oldest member runs a version at least the deployment's (a kubelet is
// never newer than its API server). RollingUpdate surges onto spare
// Available hosts matching the selector (at most replicas+maxSurge
// machines) and reimages in place (drain, delete, and the wiped host takes
// a new Machine) within maxUnavailable: the number of available workers
// (Ready, not draining) is never brought below replicas-maxUnavailable.
// OnDelete replaces only machines that were deleted. A machine whose node
// certificates expire within the cluster's renewal window is outdated.
func PlanMachineDeployment(in DeploymentInput, now time.Time) (p DeploymentPlan) {
	md := in.MachineDeployment
	spec := md.GetSpec()
	gen := md.GetMetadata().GetGeneration()
	status := proto.Clone(md.GetStatus()).(*typesv1.MachineDeploymentStatus)
	if status == nil {
		status = &typesv1.MachineDeploymentStatus{}
	}
	conds := status.GetConditions()
	set := func(t, st, reason, msg string) { conds = setCond(conds, gen, now, t, st, reason, msg) }
	defer func() {
		status.Conditions = conds
		p.Status = status
	}()

	version := spec.GetVersion()
	if version == "" {
		version = in.Cluster.GetSpec().GetKubernetesVersion()
	}
	renewal := time.Duration(in.Cluster.GetSpec().GetCertificateRenewalDays()) * 24 * time.Hour
	owner := "MachineDeployment/" + md.GetMetadata().GetName()
	replicas := int(spec.GetReplicas())
	st := spec.GetStrategy()
	onDelete := st.GetType() == StrategyOnDelete
	b := ResolveBounds(st, replicas)
	drainTimeout, _ := time.ParseDuration(st.GetNodeDrainTimeout())
	minAvail := replicas - b.MaxUnavailable
	ref := imageRef{name: spec.GetImage(), selector: spec.GetImageSelector()}
	img := resolveImage(ref, version, in.Images)
	status.Image = img.image
	setImageCondition(set, ref, img)

	var live, ready, available, fresh, outdated []machine
	reasons := map[string]string{}
	for _, m := range owned(in.Machines, owner) {
		if m.deleting() || m.removing() {
			// On its way out: finish the removal (drain, then delete).
			p.Actions = append(p.Actions, removal(m, drainTimeout, orReason(m.outdated(version, img, renewal, now), "removal in progress")))
			continue
		}
		live = append(live, m)
		if m.ready() {
			ready = append(ready, m)
		}
		if m.available() {
			available = append(available, m)
		}
		if r := m.outdated(version, img, renewal, now); r != "" {
			outdated = append(outdated, m)
			reasons[m.name()] = r
		} else {
			fresh = append(fresh, m)
		}
		p.Requeue = minPositive(p.Requeue, m.certRequeue(renewal, now))
	}
	status.Replicas = int32(len(live))
	status.ReadyReplicas = int32(len(ready))
	status.UpdatedReplicas = int32(len(fresh))
	status.UnavailableReplicas = int32(max(0, replicas-len(available)))

	// The control-plane gate.
	gateMsg, gateReason := cpGate(in, version)
	if gateMsg != "" {
		set(ConditionControlPlaneReady, conditions.False, gateReason, gateMsg)
	} else {
		set(ConditionControlPlaneReady, conditions.True, ReasonAsExpected, "")
	}

	// Creations: up to replicas up-to-date machines, at most
	// replicas+maxSurge in all (OnDelete: replicas in all).
	limit := replicas + b.MaxSurge
	if onDelete {
		limit = replicas
	}
	want := min(replicas-len(fresh), limit-len(live))
	hostsMsg := ""
	created := 0
	if want > 0 && gateMsg == "" && !img.blocked() {
		taken := hostsInUse(in.Machines)
		spares := spareHosts(in.Hosts, spec.GetHostSelector(), taken)
		used := machineNames(in.Machines)
		for i := 0; i < want && i < len(spares); i++ {
			p.Actions = append(p.Actions, CreateMachine{
				Machine: machineName(md.GetMetadata().GetName(), spares[i], used), Host: spares[i],
				Role: RoleWorker, Version: version, Image: img.image, Owner: owner, Bootstrap: BootstrapJoin,
			})
			created++
		}
		if created < want && len(live)+created < replicas {
			hostsMsg = fmt.Sprintf("%d of %d machines and no spare host: none is Available and unbound matching %s", len(live)+created, replicas, selectorString(spec.GetHostSelector()))
		}
	}
	if hostsMsg != "" {
		set(ConditionHostsAvailable, conditions.False, ReasonNoSpareHost, hostsMsg)
	} else {
		set(ConditionHostsAvailable, conditions.True, ReasonAsExpected, "")
	}

	// Removals: surplus first, then (RollingUpdate, gate open) outdated
	// machines, never taking available machines below minAvail.
	budget := len(available) - minAvail
	removed := map[string]bool{}
	take := func(m machine, reason string) bool {
		if m.available() {
			if budget <= 0 {
				return false
			}
			budget--
		}
		p.Actions = append(p.Actions, removal(m, drainTimeout, reason))
		removed[m.name()] = true
		return true
	}
	surplus := len(live) - replicas
	if surplus > 0 {
		for _, m := range removalOrder(live, reasons) {
			if surplus == 0 {
				break
			}
			why := orReason(reasons[m.name()], fmt.Sprintf("scale down to %d", replicas))
			if m.outdated(version, img, renewal, now) == "" && len(fresh) <= replicas && hasOutdated(live, reasons) && gateMsg == "" && !onDelete {
				// Keep up-to-date machines while outdated ones remain to go.
				continue
			}
			if take(m, why) {
				surplus--
			}
		}
	}
	rolling := !onDelete && gateMsg == "" && !img.blocked()
	if rolling {
		for _, m := range removalOrder(outdated, reasons) {
			if removed[m.name()] {
				continue
			}
			// Free removals of unavailable machines only while replacements can come.
			take(m, reasons[m.name()])
		}
	}

	// Conditions.
	if len(available) >= minAvail {
		set(ConditionAvailable, conditions.True, ReasonAsExpected, fmt.Sprintf("%d of %d available (minimum %d)", len(available), replicas, minAvail))
	} else {
		set(ConditionAvailable, conditions.False, ReasonBelowMinimum, fmt.Sprintf("%d of %d available, minimum %d", len(available), replicas, minAvail))
	}
	switch {
	case img.blocked() && (len(outdated) > 0 || len(fresh) < replicas):
		set(ConditionUpToDate, conditions.False, img.reason, fmt.Sprintf("%d of %d machines at %s: %s", len(fresh), replicas, version, img.msg))
	case len(outdated) == 0 && len(fresh) == replicas:
		set(ConditionUpToDate, conditions.True, ReasonAsExpected, fmt.Sprintf("%d machines at %s", replicas, version))
	case len(outdated) > 0 && onDelete:
		set(ConditionUpToDate, conditions.False, ReasonRollingOut, fmt.Sprintf("%d of %d machines outdated; strategy OnDelete: delete them to roll out", len(outdated), len(live)))
	case len(outdated) > 0 && gateMsg != "":
		set(ConditionUpToDate, conditions.False, ReasonWaitingForCP, fmt.Sprintf("%d of %d machines outdated: %s", len(outdated), len(live), gateMsg))
	case len(outdated) > 0 && len(p.Actions) == 0 && len(live) == len(ready):
		set(ConditionUpToDate, conditions.False, ReasonRolloutBlocked, fmt.Sprintf(
			"%d of %d machines outdated and no step is allowed: no spare host matches %s and maxUnavailable is %d; add a host or allow maxUnavailable 1",
			len(outdated), len(live), selectorString(spec.GetHostSelector()), b.MaxUnavailable))
	default:
		set(ConditionUpToDate, conditions.False, ReasonRollingOut, fmt.Sprintf("%d of %d machines at %s", len(fresh), replicas, version))
	}
	return p
}

func hasOutdated(ms []machine, reasons map[string]string) bool {
	for _, m := range ms {
		if reasons[m.name()] != "" {
			return true
		}
	}
	return false
}

// removalOrder sorts machines by who goes first: outdated before current,
// unavailable before available, then oldest, then by name.
func removalOrder(ms []machine, reasons map[string]string) []machine {
	out := append([]machine(nil), ms...)
	rank := func(m machine) int {
		r := 0
		if reasons[m.name()] == "" {
			r += 2
		}
		if m.available() {
			r++
		}
		return r
	}
	sort.SliceStable(out, func(i, j int) bool {
		ri, rj := rank(out[i]), rank(out[j])
		if ri != rj {
			return ri < rj
		}
		ci, cj := out[i].created(), out[j].created()
		if !ci.Equal(cj) {
			return ci.Before(cj)
		}
		return out[i].name() < out[j].name()
	})
	return out
}

// cpGate says why workers at version may not be created yet: the control
// plane is not Ready, or its oldest member is older than version.
func cpGate(in DeploymentInput, version string) (msg, reason string) {
	cp := in.ControlPlane
	if cp == nil {
		return "the cluster has no ControlPlane", ReasonWaitingForCP
	}
	if !conditions.IsTrue(cp.GetStatus().GetConditions(), ConditionReady) {
		return fmt.Sprintf("control plane %s is not Ready", cp.GetMetadata().GetName()), ReasonWaitingForCP
	}
	want, err := validation.ParseVersion(version)
	if err != nil {
		return "", ""
	}
	for _, m := range owned(in.Machines, "ControlPlane/"+cp.GetMetadata().GetName()) {
		v, err := validation.ParseVersion(m.m.GetSpec().GetVersion())
		if err != nil {
			continue
		}
		if v.Compare(want) < 0 {
			return fmt.Sprintf("control-plane machine %s runs %s, older than %s: a kubelet is never newer than its API server; upgrade the control plane first", m.name(), v, want), ReasonKubeletNewer
		}
	}
	return "", ""
}
