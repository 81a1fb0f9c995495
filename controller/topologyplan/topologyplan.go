// Package topologyplan decides what the topology of a cluster makes of it:
// from the pinned revision of its ClusterClass and the cluster's
// spec.topology, the ControlPlane, MachineDeployments and HealthChecks the
// cluster should have (variables substituted, defaults applied), and the
// creates, updates and deletes that bring the stored objects there. A
// derived object that a user edited is put back, and the plan says so in
// an event. It also decides a class's revisions (PlanClass): a spec change
// makes a new revision and the Rollout that carries it to the clusters.
//
// The planners are pure: no I/O, no clock. controller/topologyexec runs
// what they decide.
package topologyplan

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"sort"
	"strings"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/kilnhq/kiln/controller/classvar"
	"github.com/kilnhq/kiln/controller/validation"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Labels and annotations of derived objects.
const (
	// LabelOwned marks an object derived from a cluster's topology; its
	// value is the cluster's name.
	LabelOwned = "kiln.dev/topology-owned"
	// AnnotationSpecHash is the hash of the spec the controller last
	// wrote: a stored spec with another hash was edited by someone else.
	AnnotationSpecHash = "kiln.dev/topology-spec-hash"
	// AnnotationRevision is the class revision the object was derived from.
	AnnotationRevision = "kiln.dev/topology-class-revision"
	// LabelClass marks the Rollouts of a class with its name.
	LabelClass = "kiln.dev/cluster-class"
	// MachineLabelDeployment is the Machine label that names a worker
	// machine's MachineDeployment (set by controller/clusterexec), which
	// a pool's HealthCheck selects.
	MachineLabelDeployment = "deployment"
)

// Store kinds of the derived objects.
const (
	KindControlPlane      = "ControlPlane"
	KindMachineDeployment = "MachineDeployment"
	KindHealthCheck       = "HealthCheck"
)

// The Cluster condition the topology sets, and its reasons.
const (
	ConditionTopologyReconciled = "TopologyReconciled"

	ReasonAsExpected        = "AsExpected"
	ReasonClassNotFound     = "ClassNotFound"
	ReasonClassPending      = "ClassPending"
	ReasonRevisionMissing   = "RevisionMissing"
	ReasonVariablesInvalid  = "VariablesInvalid"
	ReasonWorkerClassAbsent = "WorkerClassNotFound"
	// ReasonTemplateInvalid: a derived object would be invalid (a
	// substituted value that is no duration, ...).
	ReasonTemplateInvalid = "TemplateInvalid"
)

// ControlPlaneName is the name of a topology cluster's ControlPlane (and
// of its HealthCheck).
func ControlPlaneName(cluster string) string { return cluster + "-control-plane" }

// PoolName is the name of the MachineDeployment (and HealthCheck) of pool
// of cluster.
func PoolName(cluster, pool string) string { return cluster + "-" + pool }

// Input is what Plan reads.
type Input struct {
	Cluster *typesv1.Cluster
	// Class is the cluster's ClusterClass; nil when it does not exist.
	Class *typesv1.ClusterClass
	// The objects labelled LabelOwned with the cluster's name.
	ControlPlanes      []*typesv1.ControlPlane
	MachineDeployments []*typesv1.MachineDeployment
	HealthChecks       []*typesv1.HealthCheck
}

// Action is one change of a derived object. The set is closed: Create,
// Update, Delete.
type Action interface {
	fmt.Stringer
	isAction()
}

// Create stores a new derived object (a *ControlPlane, *MachineDeployment
// or *HealthCheck with metadata name, labels and annotations, and spec).
type Create struct {
	Kind   string
	Object proto.Message
}

// Update replaces the spec, the LabelOwned label and the annotations of
// the stored object Name with Object's. Fields are the spec fields that
// change (the generation is bumped when there are any; none: only the
// annotations change); Reverted is true when the stored spec is not the
// one the controller last wrote (a user edited it).
type Update struct {
	Kind     string
	Name     string
	Object   proto.Message
	Fields   []string
	Reverted bool
}

// Delete removes a derived object the topology no longer names (a pool
// that was removed).
type Delete struct {
	Kind, Name string
}

func (Create) isAction() {}
func (Update) isAction() {}
func (Delete) isAction() {}

func (a Create) String() string {
	return fmt.Sprintf("create %s %s %s", a.Kind, metaOf(a.Object).GetName(), specText(a.Object))
}

func (a Update) String() string {
	r := ""
	if a.Reverted {
		r = " (revert)"
	}
	if len(a.Fields) == 0 {
		return fmt.Sprintf("update %s %s annotations %s=%s", a.Kind, a.Name, AnnotationRevision, metaOf(a.Object).GetAnnotations()[AnnotationRevision])
	}
	return fmt.Sprintf("update %s %s%s %s: %s", a.Kind, a.Name, r, strings.Join(a.Fields, ","), specText(a.Object))
}

func (a Delete) String() string { return fmt.Sprintf("delete %s %s", a.Kind, a.Name) }

// Event is an event the executor records on a derived object once the
// plan's actions are done.
type Event struct {
	// Kind is the object's kind (KindControlPlane, ...).
	Kind, Name string
	// Warning is true for a reverted user edit, false for a normal event.
	Warning bool
	Reason  string
	Message string
}

// Result is the plan.
type Result struct {
	Actions []Action
	Events  []Event
	// Topology is the cluster's next status.topology.
	Topology *typesv1.ClusterTopologyStatus
	// Condition is the cluster's TopologyReconciled condition once the
	// actions are done (ObservedGeneration set).
	Condition *typesv1.Condition
}

// Plan derives the cluster's objects from its topology and the pinned
// revision of its class, and diffs them against the observed ones. A
// cluster without a pin is pinned to the class's current revision. When
// the objects cannot be derived (no class, a pinned revision pruned, a
// variable that no longer resolves) Plan changes nothing and says why in
// the condition.
func Plan(in Input) Result {
	c := in.Cluster
	t := c.GetSpec().GetTopology()
	name := c.GetMetadata().GetName()
	gen := c.GetMetadata().GetGeneration()
	pin := c.GetStatus().GetTopology().GetClassRevision()
	res := Result{Topology: proto.Clone(orEmpty(c.GetStatus().GetTopology())).(*typesv1.ClusterTopologyStatus)}
	fail := func(reason, format string, args ...any) Result {
		res.Condition = cond("False", reason, fmt.Sprintf(format, args...), gen)
		return res
	}
	if in.Class == nil {
		return fail(ReasonClassNotFound, "ClusterClass %q does not exist: apply it, or fix spec.topology.class", t.GetClass())
	}
	if pin == 0 {
		pin = in.Class.GetStatus().GetRevision()
		if pin == 0 {
			return fail(ReasonClassPending, "ClusterClass %q has no revision yet: the controller records revision 1 first", t.GetClass())
		}
		res.Topology.ClassRevision = pin
	}
	spec := RevisionSpec(in.Class, pin)
	if spec == nil {
		return fail(ReasonRevisionMissing, "revision %d of ClusterClass %q is not kept (revisions kept: %s): a Rollout must move the cluster to a kept revision", pin, t.GetClass(), keptRevisions(in.Class))
	}
	desired, reason, err := Derive(c, spec, pin)
	if err != nil {
		return fail(reason, "revision %d of ClusterClass %q: %v", pin, t.GetClass(), err)
	}

	type observed struct {
		kind string
		obj  proto.Message
	}
	have := map[string]observed{}
	key := func(kind, n string) string { return kind + "/" + n }
	for _, o := range in.ControlPlanes {
		have[key(KindControlPlane, o.GetMetadata().GetName())] = observed{KindControlPlane, o}
	}
	for _, o := range in.MachineDeployments {
		have[key(KindMachineDeployment, o.GetMetadata().GetName())] = observed{KindMachineDeployment, o}
	}
	for _, o := range in.HealthChecks {
		have[key(KindHealthCheck, o.GetMetadata().GetName())] = observed{KindHealthCheck, o}
	}
	for _, d := range desired {
		n := metaOf(d.Object).GetName()
		k := key(d.Kind, n)
		o, ok := have[k]
		delete(have, k)
		if !ok {
			res.Actions = append(res.Actions, Create{Kind: d.Kind, Object: d.Object})
			continue
		}
		fields := diffSpec(o.obj, d.Object)
		hash := metaOf(d.Object).GetAnnotations()[AnnotationSpecHash]
		md := metaOf(o.obj)
		if len(fields) == 0 && md.GetLabels()[LabelOwned] == name && md.GetAnnotations()[AnnotationSpecHash] == hash &&
			md.GetAnnotations()[AnnotationRevision] == metaOf(d.Object).GetAnnotations()[AnnotationRevision] {
			continue
		}
		written := md.GetAnnotations()[AnnotationSpecHash]
		reverted := len(fields) > 0 && written != "" && written != SpecHash(o.obj)
		res.Actions = append(res.Actions, Update{Kind: d.Kind, Name: n, Object: d.Object, Fields: fields, Reverted: reverted})
		switch {
		case reverted:
			res.Events = append(res.Events, Event{Kind: d.Kind, Name: n, Warning: true, Reason: "TopologyEditReverted",
				Message: fmt.Sprintf("%s %s is owned by the topology of cluster %s; the edit of %s was reverted; change cluster %s's spec.topology instead",
					d.Kind, n, name, strings.Join(fields, ", "), name)})
		case len(fields) > 0:
			res.Events = append(res.Events, Event{Kind: d.Kind, Name: n, Reason: "TopologyUpdated",
				Message: fmt.Sprintf("%s of %s %s set from the topology of cluster %s (class %s revision %d)", strings.Join(fields, ", "), d.Kind, n, name, t.GetClass(), pin)})
		}
	}
	var gone []observed
	for _, o := range have {
		gone = append(gone, o)
	}
	sort.Slice(gone, func(i, j int) bool {
		return key(gone[i].kind, metaOf(gone[i].obj).GetName()) < key(gone[j].kind, metaOf(gone[j].obj).GetName())
	})
	for _, o := range gone {
		res.Actions = append(res.Actions, Delete{Kind: o.kind, Name: metaOf(o.obj).GetName()})
	}
	res.Topology.Version = t.GetVersion()
	res.Topology.ReconciledRevision = pin
	res.Condition = cond("True", ReasonAsExpected, fmt.Sprintf("follows revision %d of ClusterClass %s at %s: control plane %s, %d worker pools",
		pin, t.GetClass(), t.GetVersion(), ControlPlaneName(name), len(t.GetWorkers())), gen)
	return res
}

// Desired is one derived object.
type Desired struct {
	Kind   string
	Object proto.Message
}

// Derive returns the objects cluster c derives from class spec (revision
// rev): its ControlPlane, a MachineDeployment per pool, and a
// HealthCheck per template that has one, in that order. On error it
// returns the condition reason that says why.
func Derive(c *typesv1.Cluster, spec *typesv1.ClusterClassSpec, rev int64) ([]Desired, string, error) {
	t := c.GetSpec().GetTopology()
	name := c.GetMetadata().GetName()
	vals, probs := classvar.Resolve(spec.GetVariables(), t.GetVariables())
	if len(probs) > 0 {
		s := make([]string, len(probs))
		for i, p := range probs {
			s[i] = "variable " + p.String()
		}
		return nil, ReasonVariablesInvalid, fmt.Errorf("%s", strings.Join(s, "; "))
	}
	workers := map[string]*typesv1.ClusterClassMachines{}
	for _, w := range spec.GetWorkers() {
		workers[w.GetName()] = w.GetTemplate()
	}
	for _, p := range t.GetWorkers() {
		if _, ok := workers[p.GetClass()]; !ok {
			return nil, ReasonWorkerClassAbsent, fmt.Errorf("pool %s names worker class %q, which the class does not have (it has %s)", p.GetName(), p.GetClass(), workerNames(spec))
		}
	}
	meta := func(n string) *typesv1.ObjectMeta {
		return &typesv1.ObjectMeta{Name: n,
			Labels:      map[string]string{LabelOwned: name},
			Annotations: map[string]string{AnnotationRevision: fmt.Sprint(rev)}}
	}
	var out []Desired
	add := func(kind string, obj proto.Message) {
		md := metaOf(obj)
		md.Annotations[AnnotationSpecHash] = SpecHash(obj)
		out = append(out, Desired{kind, obj})
	}
	cpT, err := classvar.Substitute(orEmptyMachines(spec.GetControlPlane()), vals)
	if err != nil {
		return nil, ReasonTemplateInvalid, fmt.Errorf("controlPlane: %w", err)
	}
	replicas := t.GetControlPlaneReplicas()
	if replicas == 0 {
		replicas = 1
	}
	cpName := ControlPlaneName(name)
	add(KindControlPlane, &typesv1.ControlPlane{ApiVersion: "kiln.dev/v1", Kind: KindControlPlane, Metadata: meta(cpName),
		Spec: &typesv1.ControlPlaneSpec{Cluster: name, Replicas: replicas, Version: t.GetVersion(), Image: cpT.GetImage(),
			HostSelector: cpT.GetHostSelector(), RolloutMaxSurge: cpT.GetRolloutMaxSurge(), ImageSelector: cpT.GetImageSelector()}})
	var hcs []Desired
	if hc := cpT.GetHealthCheck(); hc != nil {
		s := proto.Clone(hc).(*typesv1.HealthCheckSpec)
		s.Cluster, s.Selector = name, map[string]string{"cluster": name, "role": "control-plane"}
		hcs = append(hcs, Desired{KindHealthCheck, &typesv1.HealthCheck{ApiVersion: "kiln.dev/v1", Kind: KindHealthCheck, Metadata: meta(cpName), Spec: s}})
	}
	for _, p := range t.GetWorkers() {
		wT, err := classvar.Substitute(orEmptyMachines(workers[p.GetClass()]), vals)
		if err != nil {
			return nil, ReasonTemplateInvalid, fmt.Errorf("worker class %s: %w", p.GetClass(), err)
		}
		n := PoolName(name, p.GetName())
		add(KindMachineDeployment, &typesv1.MachineDeployment{ApiVersion: "kiln.dev/v1", Kind: KindMachineDeployment, Metadata: meta(n),
			Spec: &typesv1.MachineDeploymentSpec{Cluster: name, Replicas: p.GetReplicas(), Version: t.GetVersion(), Image: wT.GetImage(),
				HostSelector: wT.GetHostSelector(), Strategy: wT.GetStrategy(), ImageSelector: wT.GetImageSelector()}})
		if hc := wT.GetHealthCheck(); hc != nil {
			s := proto.Clone(hc).(*typesv1.HealthCheckSpec)
			s.Cluster, s.Selector = name, map[string]string{"cluster": name, MachineLabelDeployment: n}
			hcs = append(hcs, Desired{KindHealthCheck, &typesv1.HealthCheck{ApiVersion: "kiln.dev/v1", Kind: KindHealthCheck, Metadata: meta(n), Spec: s}})
		}
	}
	for _, h := range hcs {
		add(h.Kind, h.Object)
	}
	// The substituted values are checked as if the objects were applied.
	for _, d := range out {
		if err := validation.Validate(wrap(d.Object)); err != nil {
			return nil, ReasonTemplateInvalid, err
		}
	}
	return out, "", nil
}

func wrap(obj proto.Message) *controllerv1.Resource {
	switch o := obj.(type) {
	case *typesv1.ControlPlane:
		return &controllerv1.Resource{Kind: &controllerv1.Resource_ControlPlane{ControlPlane: o}}
	case *typesv1.MachineDeployment:
		return &controllerv1.Resource{Kind: &controllerv1.Resource_MachineDeployment{MachineDeployment: o}}
	case *typesv1.HealthCheck:
		return &controllerv1.Resource{Kind: &controllerv1.Resource_HealthCheck{HealthCheck: o}}
	}
	return &controllerv1.Resource{}
}

// ClusterDefaults returns spec with the fields it leaves empty taken from
// the class's cluster template (variables substituted with the values of
// spec.topology): what a topology cluster is stored with.
func ClusterDefaults(spec *typesv1.ClusterSpec, class *typesv1.ClusterClassSpec) (*typesv1.ClusterSpec, error) {
	out := proto.Clone(spec).(*typesv1.ClusterSpec)
	tmpl := class.GetCluster()
	if tmpl == nil {
		return out, nil
	}
	vals, _ := classvar.Resolve(class.GetVariables(), spec.GetTopology().GetVariables())
	tmpl, err := classvar.Substitute(tmpl, vals)
	if err != nil {
		return nil, fmt.Errorf("spec.cluster: %w", err)
	}
	dst := out.ProtoReflect()
	tmpl.ProtoReflect().Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if fd.Name() == "topology" || fd.Name() == "kubernetes_version" {
			return true
		}
		if !dst.Has(fd) {
			dst.Set(fd, v)
		}
		return true
	})
	return out, nil
}

// RevisionSpec returns the spec of revision rev of class, nil when the
// class does not keep it.
func RevisionSpec(class *typesv1.ClusterClass, rev int64) *typesv1.ClusterClassSpec {
	for _, r := range class.GetStatus().GetRevisions() {
		if r.GetRevision() == rev {
			return r.GetSpec()
		}
	}
	return nil
}

// SpecHash is a short hash of the spec of a derived object.
func SpecHash(obj proto.Message) string {
	spec := specOf(obj)
	b, _ := proto.MarshalOptions{Deterministic: true}.Marshal(spec)
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8])
}

func specOf(obj proto.Message) proto.Message {
	r := obj.ProtoReflect()
	fd := r.Descriptor().Fields().ByName("spec")
	return r.Get(fd).Message().Interface()
}

// diffSpec lists the top-level spec fields (spec.replicas) in which the
// specs of a and b differ.
func diffSpec(a, b proto.Message) []string {
	ra, rb := specOf(a).ProtoReflect(), specOf(b).ProtoReflect()
	var out []string
	fields := ra.Descriptor().Fields()
	for i := 0; i < fields.Len(); i++ {
		fd := fields.Get(i)
		if !ra.Get(fd).Equal(rb.Get(fd)) && (ra.Has(fd) || rb.Has(fd)) {
			out = append(out, "spec."+fd.JSONName())
		}
	}
	return out
}

func metaOf(obj proto.Message) *typesv1.ObjectMeta {
	r := obj.ProtoReflect()
	fd := r.Descriptor().Fields().ByName("metadata")
	return r.Get(fd).Message().Interface().(*typesv1.ObjectMeta)
}

func cond(status, reason, msg string, gen int64) *typesv1.Condition {
	return &typesv1.Condition{Type: ConditionTopologyReconciled, Status: status, Reason: reason, Message: msg, ObservedGeneration: gen}
}

func orEmpty(s *typesv1.ClusterTopologyStatus) *typesv1.ClusterTopologyStatus {
	if s == nil {
		return &typesv1.ClusterTopologyStatus{}
	}
	return s
}

func orEmptyMachines(m *typesv1.ClusterClassMachines) *typesv1.ClusterClassMachines {
	if m == nil {
		return &typesv1.ClusterClassMachines{}
	}
	return m
}

func keptRevisions(c *typesv1.ClusterClass) string {
	var s []string
	for _, r := range c.GetStatus().GetRevisions() {
		s = append(s, fmt.Sprint(r.GetRevision()))
	}
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, ", ")
}

func workerNames(spec *typesv1.ClusterClassSpec) string {
	var s []string
	for _, w := range spec.GetWorkers() {
		s = append(s, w.GetName())
	}
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, ", ")
}

// specText is a compact, deterministic text of a derived object's spec,
// for transcripts and logs.
func specText(obj proto.Message) string {
	var parts []string
	r := specOf(obj).ProtoReflect()
	fields := r.Descriptor().Fields()
	for i := 0; i < fields.Len(); i++ {
		fd := fields.Get(i)
		if !r.Has(fd) {
			continue
		}
		parts = append(parts, fd.JSONName()+"="+valueText(fd, r.Get(fd)))
	}
	return strings.Join(parts, " ")
}

func valueText(fd protoreflect.FieldDescriptor, v protoreflect.Value) string {
	switch {
	case fd.IsMap():
		var kv []string
		v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
			kv = append(kv, k.String()+":"+mv.String())
			return true
		})
		sort.Strings(kv)
		return "{" + strings.Join(kv, ",") + "}"
	case fd.IsList():
		var items []string
		l := v.List()
		for i := 0; i < l.Len(); i++ {
			if fd.Kind() == protoreflect.MessageKind {
				items = append(items, msgText(l.Get(i).Message()))
			} else {
				items = append(items, l.Get(i).String())
			}
		}
		return "[" + strings.Join(items, ",") + "]"
	case fd.Kind() == protoreflect.MessageKind:
		return msgText(v.Message())
	}
	return v.String()
}

func msgText(m protoreflect.Message) string {
	var parts []string
	fields := m.Descriptor().Fields()
	for i := 0; i < fields.Len(); i++ {
		fd := fields.Get(i)
		if m.Has(fd) {
			parts = append(parts, fd.JSONName()+":"+valueText(fd, m.Get(fd)))
		}
	}
	return "{" + strings.Join(parts, " ") + "}"
}
