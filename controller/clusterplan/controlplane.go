package clusterplan

import (
	"fmt"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// ControlPlaneInput is what PlanControlPlane decides from.
type ControlPlaneInput struct {
	Cluster      *typesv1.Cluster
	ControlPlane *typesv1.ControlPlane
	// Machines are all Machines of the cluster; the planner keeps those
	// owned by the control plane.
	Machines []*typesv1.Machine
	// Hosts are all Hosts; spares are Available, unbound and match the
	// host selector.
	Hosts []*typesv1.Host
	// Images are all Images: spec.image must name one, and
	// spec.imageSelector picks the newest it matches.
	Images []*typesv1.Image
}

// ControlPlanePlan is what PlanControlPlane decided.
type ControlPlanePlan struct {
	Actions []Action
	Status  *typesv1.ControlPlaneStatus
	// Requeue is when to plan again even if nothing changes (a
	// certificate entering its renewal window); 0 means on change only.
	Requeue time.Duration
}

// PlanControlPlane decides the next step of a control plane. It changes
// one member at a time: it creates a machine and waits until it is Ready
// before the next; a rollout with rolloutMaxSurge 1 adds the new member
// first (3→4→3) and falls back to scaling in first when no spare host
// exists; a member leaves etcd before its machine is deleted; and every
// removal passes the quorum pre-flight, which otherwise sets EtcdQuorum
// False (QuorumAtRisk) naming the members. A target version that skips a
// minor, or goes back one, is refused (UpgradeAllowed False).
func PlanControlPlane(in ControlPlaneInput, now time.Time) (p ControlPlanePlan) {
	cp := in.ControlPlane
	spec := cp.GetSpec()
	gen := cp.GetMetadata().GetGeneration()
	status := proto.Clone(cp.GetStatus()).(*typesv1.ControlPlaneStatus)
	if status == nil {
		status = &typesv1.ControlPlaneStatus{}
	}
	version := spec.GetVersion()
	if version == "" {
		version = in.Cluster.GetSpec().GetKubernetesVersion()
	}
	renewal := time.Duration(in.Cluster.GetSpec().GetCertificateRenewalDays()) * 24 * time.Hour
	owner := "ControlPlane/" + cp.GetMetadata().GetName()
	ms := owned(in.Machines, owner)
	replicas := int(spec.GetReplicas())

	conds := status.GetConditions()
	set := func(t, st, reason, msg string) { conds = setCond(conds, gen, now, t, st, reason, msg) }
	ref := imageRef{name: spec.GetImage(), selector: spec.GetImageSelector()}
	img := resolveImage(ref, version, in.Images)
	status.Image = img.image
	setImageCondition(set, ref, img)

	// Counts for status.
	var live, ready, updated, members, healthyMembers []machine
	var outdated []machine
	reasons := map[string]string{}
	for _, m := range ms {
		if m.member() != "" {
			members = append(members, m)
			if m.etcdOK() {
				healthyMembers = append(healthyMembers, m)
			}
		}
		if m.deleting() {
			continue
		}
		live = append(live, m)
		if m.ready() {
			ready = append(ready, m)
		}
		if r := m.outdated(version, img, renewal, now); r != "" {
			outdated = append(outdated, m)
			reasons[m.name()] = r
		} else if !m.removing() {
			updated = append(updated, m)
		}
		p.Requeue = minPositive(p.Requeue, m.certRequeue(renewal, now))
	}
	status.Replicas = int32(len(live))
	status.ReadyReplicas = int32(len(ready))
	status.UpdatedReplicas = int32(len(updated))
	status.EtcdMembers = int32(len(members))
	quorumMsg, hostsMsg, spareCount := "", "", -1
	defer func() {
		switch {
		case quorumMsg != "":
			set(ConditionEtcdQuorum, conditions.False, ReasonQuorumAtRisk, quorumMsg)
		case len(members) > 0:
			set(ConditionEtcdQuorum, conditions.True, ReasonQuorumHealthy, fmt.Sprintf("%d of %d members healthy", len(healthyMembers), len(members)))
		}
		switch {
		case hostsMsg != "":
			set(ConditionHostsAvailable, conditions.False, ReasonNoSpareHost, hostsMsg)
		case spareCount >= 0 || conditions.Get(conds, ConditionHostsAvailable) != nil:
			set(ConditionHostsAvailable, conditions.True, ReasonAsExpected, "")
		}
		status.Conditions = conds
		p.Status = status
	}()

	if reason, msg := minorSkip(live, version); reason != "" {
		set(ConditionUpgradeAllowed, conditions.False, reason, msg)
		set(ConditionReady, conditions.False, reason, "upgrade refused: "+msg)
		return p
	}
	set(ConditionUpgradeAllowed, conditions.True, ReasonAsExpected, "")

	create := func(reason string) bool {
		spares := spareHosts(in.Hosts, spec.GetHostSelector(), hostsInUse(in.Machines))
		spareCount = len(spares)
		if len(spares) == 0 {
			hostsMsg = fmt.Sprintf("%s needs a host: none is Available and unbound matching %s", reason, selectorString(spec.GetHostSelector()))
			return false
		}
		boot := BootstrapJoinControlPlane
		if len(members) == 0 && len(live) == 0 {
			boot = BootstrapInit
		}
		p.Actions = append(p.Actions, CreateMachine{
			Machine: machineName(cp.GetMetadata().GetName(), spares[0], machineNames(in.Machines)), Host: spares[0],
			Role: RoleControlPlane, Version: version, Image: img.image, Owner: owner, Bootstrap: boot,
		})
		return true
	}
	// remove takes x out one action at a time, after the quorum pre-flight.
	remove := func(x machine, reason string) bool {
		if msg := quorumCheck(ms, x); msg != "" {
			quorumMsg = msg
			return false
		}
		p.Actions = append(p.Actions, removal(x, 0, reason))
		return true
	}
	notReady := func(reason, msg string) {
		set(ConditionReady, conditions.False, reason, msg)
	}

	// 1. Finish a removal in progress (drained, or marked) before anything.
	for _, m := range live {
		if m.removing() {
			remove(m, orReason(reasons[m.name()], "scale down"))
			notReady(ReasonRollingOut, fmt.Sprintf("removing %s", m.name()))
			return p
		}
	}
	// 2. One at a time: wait for a machine that is coming up.
	for _, m := range live {
		if !m.ready() {
			notReady(ReasonProvisioning, fmt.Sprintf("waiting for %s on host %s to become Ready%s", m.name(), m.host(), m.blocker()))
			return p
		}
	}
	// A machine being deleted is still a member until it leaves etcd.
	for _, m := range ms {
		if m.deleting() {
			if m.member() != "" {
				remove(m, "deleted")
			}
			notReady(ReasonRollingOut, fmt.Sprintf("waiting for %s to be deleted", m.name()))
			return p
		}
	}
	switch {
	case img.blocked() && (len(live) < replicas || len(outdated) > 0):
		// No image to lay: neither scale up nor take a member out for a
		// replacement that cannot come.
		notReady(img.reason, img.msg)
	case len(live) < replicas:
		// Scale up (or replace a member taken out by scale-in-first).
		if create(fmt.Sprintf("scaling up to %d", replicas)) {
			notReady(ReasonScalingUp, fmt.Sprintf("%d of %d members; adding one", len(live), replicas))
		} else {
			notReady(ReasonScalingUp, fmt.Sprintf("%d of %d members; waiting for a host", len(live), replicas))
		}
	case len(outdated) > 0:
		victim := pickVictim(outdated)
		why := reasons[victim.name()]
		if len(live) == replicas && spec.GetRolloutMaxSurge() == 1 {
			if create("rollout (surge)") {
				notReady(ReasonRollingOut, fmt.Sprintf("%s: adding a new member before removing %s", why, victim.name()))
				return p
			}
			// No spare host: reimage in place, as with maxSurge 0.
		}
		if remove(victim, why) {
			notReady(ReasonRollingOut, fmt.Sprintf("%s: removing %s", why, victim.name()))
		} else {
			notReady(ReasonQuorumAtRisk, fmt.Sprintf("%s: %s cannot be removed without breaking etcd quorum", why, victim.name()))
		}
	case len(live) > replicas:
		victim := pickVictim(live)
		if remove(victim, fmt.Sprintf("scale down to %d", replicas)) {
			notReady(ReasonScalingDown, fmt.Sprintf("%d of %d members; removing %s", len(live), replicas, victim.name()))
		} else {
			notReady(ReasonQuorumAtRisk, fmt.Sprintf("scale down: %s cannot be removed without breaking etcd quorum", victim.name()))
		}
	default:
		set(ConditionReady, conditions.True, ReasonAsExpected, fmt.Sprintf("%d of %d members Ready at %s", len(ready), replicas, version))
	}
	return p
}

// pickVictim chooses which machine leaves first: one that is not Ready or
// whose etcd member is unhealthy, else the oldest, else by name.
func pickVictim(ms []machine) machine {
	best := ms[0]
	score := func(m machine) int {
		if !m.ready() || (m.member() != "" && !m.etcdOK()) {
			return 0
		}
		return 1
	}
	for _, m := range ms[1:] {
		switch {
		case score(m) < score(best):
			best = m
		case score(m) == score(best) && m.created().Before(best.created()):
			best = m
		}
	}
	return best
}

func orReason(r, def string) string {
	if r == "" {
		return def
	}
	return r
}
