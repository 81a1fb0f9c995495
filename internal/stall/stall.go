// Package stall tells when a set of objects has stopped changing, and
// what blocks them: the progress check behind `kilnctl wait
// --stall-timeout`, usable by anything that polls the controller.
//
// A Detector is fed snapshots of resource versions with the time they
// were taken; it decides nothing from the wall clock itself. Scope picks
// the objects that make up a cluster (or a control plane, a deployment,
// a machine), Versions keys them for the Detector, and Blocked reports
// their blocking conditions once the Detector says they stalled.
package stall

import (
	"fmt"
	"strings"
	"time"

	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/kilnhq/kiln/internal/conditions"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Detector reports when nothing has changed for a timeout. The zero
// value is not usable; use New.
type Detector struct {
	timeout    time.Duration
	versions   map[string]string
	lastChange time.Time
	seen       bool
}

// New returns a Detector that calls a set stalled once it has not changed
// for timeout.
func New(timeout time.Duration) *Detector { return &Detector{timeout: timeout} }

// Observe records a snapshot taken at now: the resource version of each
// object, keyed by "kind/name" (Versions makes one). Any difference from
// the previous snapshot (a version changed, an object appeared or went)
// is progress. The first snapshot starts the clock. It reports whether
// the set has not changed for the timeout.
func (d *Detector) Observe(now time.Time, versions map[string]string) bool {
	if !d.seen || !sameVersions(d.versions, versions) {
		d.versions = make(map[string]string, len(versions))
		for k, v := range versions {
			d.versions[k] = v
		}
		d.lastChange, d.seen = now, true
		return false
	}
	return now.Sub(d.lastChange) >= d.timeout
}

// LastChange is when the last observed change was seen (the first
// snapshot counts as one); zero before any.
func (d *Detector) LastChange() time.Time { return d.lastChange }

// Timeout is the time without change after which Observe reports a stall.
func (d *Detector) Timeout() time.Duration { return d.timeout }

func sameVersions(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// ScopeKinds returns the kinds to list for Scope of an object of kind:
// everything a cluster is made of for a Cluster; machines and hosts for a
// ControlPlane or MachineDeployment; hosts for a Machine; only the kind
// itself otherwise.
func ScopeKinds(kind string) []string {
	switch kind {
	case "Cluster":
		return []string{"Cluster", "ControlPlane", "MachineDeployment", "Machine", "HealthCheck", "Host"}
	case "ControlPlane", "MachineDeployment":
		return []string{kind, "Machine", "Host"}
	case "Machine":
		return []string{"Machine", "Host"}
	}
	return []string{kind}
}

// Scope picks out of items (lists of the ScopeKinds of kind) the objects
// whose progress is the progress of kind/name: for a Cluster itself, its
// control planes, machine deployments, health checks and machines
// (spec.cluster), and the hosts of those machines; for a ControlPlane or
// MachineDeployment itself, its machines (spec.owner) and their hosts;
// for a Machine itself and its host. The order is items' order.
func Scope(kind, name string, items []*controllerv1.Resource) []*controllerv1.Resource {
	machines := map[string]bool{}
	hosts := map[string]bool{}
	var out []*controllerv1.Resource
	self := func(r *controllerv1.Resource) bool {
		return Kind(r) == kind && Meta(r).GetName() == name
	}
	for _, r := range items {
		keep := self(r)
		switch x := r.GetKind().(type) {
		case *controllerv1.Resource_ControlPlane:
			keep = keep || (kind == "Cluster" && x.ControlPlane.GetSpec().GetCluster() == name)
		case *controllerv1.Resource_MachineDeployment:
			keep = keep || (kind == "Cluster" && x.MachineDeployment.GetSpec().GetCluster() == name)
		case *controllerv1.Resource_HealthCheck:
			keep = keep || (kind == "Cluster" && x.HealthCheck.GetSpec().GetCluster() == name)
		case *controllerv1.Resource_Machine:
			s := x.Machine.GetSpec()
			keep = keep || (kind == "Cluster" && s.GetCluster() == name) || s.GetOwner() == kind+"/"+name
			if keep {
				machines[x.Machine.GetMetadata().GetName()] = true
				if s.GetHost() != "" {
					hosts[s.GetHost()] = true
				}
			}
		}
		if keep {
			out = append(out, r)
		}
	}
	for _, r := range items {
		if h := r.GetHost(); h != nil && !self(r) && (hosts[h.GetMetadata().GetName()] || machines[h.GetStatus().GetMachine()]) {
			out = append(out, r)
		}
	}
	return out
}

// Versions keys items by "kind/name" (kind in lower case, as kilnctl
// writes it) to their resource versions, for Detector.Observe.
func Versions(items []*controllerv1.Resource) map[string]string {
	out := make(map[string]string, len(items))
	for _, r := range items {
		out[Ref(r)] = Meta(r).GetResourceVersion()
	}
	return out
}

// Blocked returns one line per blocking condition of items
// (conditions.Blocking), "machine/lab-cp-x: ImageResolved=False
// ImageNotFound: image ... not found", objects in items' order, the most
// telling condition of each first. An object without a blocking
// condition gets a line when it is a host in the Error state (its error
// reason) or has no conditions at all (nothing reconciles it: a stopped
// controller loop is a cause of stalls too); others are left out.
func Blocked(items []*controllerv1.Resource) []string {
	var out []string
	for _, r := range items {
		conds := Conditions(r)
		b := conditions.Blocking(conds)
		for _, c := range b {
			line := fmt.Sprintf("%s: %s=%s", Ref(r), c.GetType(), c.GetStatus())
			if c.GetReason() != "" {
				line += " " + c.GetReason()
			}
			if m := strings.Join(strings.Fields(c.GetMessage()), " "); m != "" {
				line += ": " + m
			}
			out = append(out, line)
		}
		if len(b) > 0 {
			continue
		}
		switch h := r.GetHost(); {
		case h != nil && h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_ERROR:
			out = append(out, fmt.Sprintf("%s: state Error: %s", Ref(r), h.GetStatus().GetErrorReason()))
		case len(conds) == 0:
			out = append(out, fmt.Sprintf("%s: no conditions: nothing has reported on it", Ref(r)))
		}
	}
	return out
}

// Ref is "kind/name" of r, kind in lower case ("controlplane/lab-cp").
func Ref(r *controllerv1.Resource) string {
	return strings.ToLower(Kind(r)) + "/" + Meta(r).GetName()
}

// Kind is the kind r holds ("ControlPlane"); "" when empty.
func Kind(r *controllerv1.Resource) string {
	if m := object(r); m != nil {
		return string(m.Descriptor().Name())
	}
	return ""
}

// Meta is the metadata of whatever r holds.
func Meta(r *controllerv1.Resource) *typesv1.ObjectMeta {
	m := object(r)
	if m == nil {
		return nil
	}
	fd := m.Descriptor().Fields().ByName("metadata")
	if fd == nil {
		return nil
	}
	meta, _ := m.Get(fd).Message().Interface().(*typesv1.ObjectMeta)
	return meta
}

// Conditions are the status conditions of whatever r holds.
func Conditions(r *controllerv1.Resource) []*typesv1.Condition {
	m := object(r)
	if m == nil {
		return nil
	}
	sfd := m.Descriptor().Fields().ByName("status")
	if sfd == nil || !m.Has(sfd) {
		return nil
	}
	st := m.Get(sfd).Message()
	cfd := st.Descriptor().Fields().ByName("conditions")
	if cfd == nil || !cfd.IsList() {
		return nil
	}
	l := st.Get(cfd).List()
	out := make([]*typesv1.Condition, 0, l.Len())
	for i := 0; i < l.Len(); i++ {
		if c, ok := l.Get(i).Message().Interface().(*typesv1.Condition); ok {
			out = append(out, c)
		}
	}
	return out
}

func object(r *controllerv1.Resource) protoreflect.Message {
	if r == nil {
		return nil
	}
	pr := r.ProtoReflect()
	fd := pr.WhichOneof(pr.Descriptor().Oneofs().ByName("kind"))
	if fd == nil {
		return nil
	}
	return pr.Get(fd).Message()
}
