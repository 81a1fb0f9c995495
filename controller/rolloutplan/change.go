package rolloutplan

import (
	"fmt"
	"maps"
	"strconv"

	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// ConditionTopologyReconciled is the Cluster condition the topology
// controller sets True when the derived objects match the cluster's pinned
// class revision and version.
const ConditionTopologyReconciled = "TopologyReconciled"

// AnnotationClassRevision is the annotation the topology controller
// puts on the ControlPlane and MachineDeployments it derives: the class
// revision they were derived from. A class change is done only once every
// derived object carries the new revision (the pin lives in the Cluster's
// status, so the Cluster's generation does not say it).
const AnnotationClassRevision = "kiln.dev/topology-class-revision"

// VersionLabel is the image selector key that names a Kubernetes version
// (the lab's and the examples' convention): a version change moves it
// along with the version, so that the selector keeps choosing an image
// built for the version.
const VersionLabel = "kubernetes"

// change is the Rollout's change, with what it means for one cluster.
type change struct{ *typesv1.RolloutChange }

func (ch change) String() string {
	switch {
	case ch.GetKubernetesVersion() != "":
		return "Kubernetes " + ch.GetKubernetesVersion()
	case ch.GetImage() != "":
		return "image " + ch.GetImage()
	case len(ch.GetImageSelector()) > 0:
		return "the newest image with labels " + selectorString(ch.GetImageSelector())
	}
	return fmt.Sprintf("class %s revision %d", ch.GetClusterClass(), ch.GetClassRevision())
}

func (ch change) isVersion() bool { return ch.GetKubernetesVersion() != "" }
func (ch change) isImage() bool   { return ch.GetImage() != "" || len(ch.GetImageSelector()) > 0 }
func (ch change) isClass() bool   { return ch.GetClusterClass() != "" }

// targets reports whether the rollout chooses cluster c: its labels match
// the selector, and for a class change it is a topology cluster of the
// class.
func (ch change) targets(c *typesv1.Cluster, selector map[string]string) bool {
	if c.GetMetadata().GetDeletionTimestamp() != nil || !matches(c.GetMetadata().GetLabels(), selector) {
		return false
	}
	if ch.isClass() {
		return c.GetSpec().GetTopology().GetClass() == ch.GetClusterClass()
	}
	return true
}

func (ch change) describeTargets(selector map[string]string) string {
	s := "the selector " + selectorString(selector)
	if len(selector) == 0 {
		s = "(no cluster exists)"
	}
	if ch.isClass() {
		s += " with spec.topology.class " + ch.GetClusterClass()
	}
	return s
}

// refuse says why the change would break cluster c ("" when it would
// not): a Kubernetes version that skips a minor or goes back one, an
// image change on a topology cluster (its class names its images), a
// class revision older than the one the cluster follows.
func (ch change) refuse(c ClusterInput) string {
	name := c.Cluster.GetMetadata().GetName()
	topo := c.Cluster.GetSpec().GetTopology()
	switch {
	case ch.isVersion():
		to := ch.GetKubernetesVersion()
		if topo != nil {
			return skew(name, "", topo.GetVersion(), to)
		}
		for _, cp := range c.ControlPlanes {
			v := cp.GetSpec().GetVersion()
			if v == "" {
				v = c.Cluster.GetSpec().GetKubernetesVersion()
			}
			if why := skew(name, "control plane "+cp.GetMetadata().GetName(), v, to); why != "" {
				return why
			}
		}
		return skew(name, "", c.Cluster.GetSpec().GetKubernetesVersion(), to)
	case ch.isImage():
		if topo != nil {
			return fmt.Sprintf("cluster %s: its images come from class %s; change the class instead", name, topo.GetClass())
		}
	case ch.isClass():
		if pin := c.Cluster.GetStatus().GetTopology().GetClassRevision(); pin > ch.GetClassRevision() {
			return fmt.Sprintf("cluster %s follows revision %d of class %s, newer than %d", name, pin, ch.GetClusterClass(), ch.GetClassRevision())
		}
	}
	return ""
}

// skew refuses a version change that skips a minor or goes back one.
func skew(cluster, what, from, to string) string {
	if from == "" || from == to {
		return ""
	}
	f, err1 := validation.ParseVersion(from)
	t, err2 := validation.ParseVersion(to)
	if err1 != nil || err2 != nil {
		return ""
	}
	who := "cluster " + cluster
	if what != "" {
		who += " (" + what + ")"
	}
	switch {
	case f.Major != t.Major:
		return fmt.Sprintf("%s runs %s: %s changes the major version", who, f, t)
	case t.Minor > f.Minor+1:
		return fmt.Sprintf("%s runs %s: %s -> %s skips a minor version; roll %s.x first", who, f, f.MinorString(), t.MinorString(),
			validation.Version{Major: f.Major, Minor: f.Minor + 1}.MinorString())
	case t.Minor < f.Minor:
		return fmt.Sprintf("%s runs %s: %s is a minor downgrade, which kubeadm cannot do", who, f, t)
	}
	return ""
}

// from is what cluster c runs before the change, for status.
func (ch change) from(c ClusterInput) string {
	switch {
	case ch.isClass():
		return "revision " + strconv.FormatInt(c.Cluster.GetStatus().GetTopology().GetClassRevision(), 10)
	case ch.isVersion():
		if topo := c.Cluster.GetSpec().GetTopology(); topo != nil {
			return topo.GetVersion()
		}
		for _, cp := range c.ControlPlanes {
			if v := cp.GetSpec().GetVersion(); v != "" {
				return v
			}
		}
		return c.Cluster.GetSpec().GetKubernetesVersion()
	}
	for _, cp := range c.ControlPlanes {
		if img := cp.GetStatus().GetImage(); img != "" {
			return img
		}
		if img := cp.GetSpec().GetImage(); img != "" {
			return img
		}
	}
	return ""
}

// progress says whether cluster c has finished the change, and if not
// what it waits for and the writes that move it on. A cluster without
// topology moves its ControlPlanes first, then (once they have rolled)
// its Cluster version and MachineDeployments; a topology cluster moves by
// its spec.topology.version or its class revision pin, and the topology
// controller derives the rest.
func (ch change) progress(c ClusterInput) (done bool, why string, acts []Action) {
	name := c.Cluster.GetMetadata().GetName()
	if c.Cluster.GetSpec().GetTopology() != nil {
		return ch.progressTopology(c)
	}
	if ch.isClass() {
		return true, "", nil // not a topology cluster (any more): nothing to move
	}
	for _, cp := range c.ControlPlanes {
		if set, ok := ch.fields(cp.GetSpec().GetVersion(), c.Cluster.GetSpec().GetKubernetesVersion(), cp.GetSpec().GetImage(), cp.GetSpec().GetImageSelector()); !ok {
			acts = append(acts, SetControlPlane{Cluster: name, ControlPlane: cp.GetMetadata().GetName(), Set: set})
		}
	}
	if len(acts) > 0 {
		return false, "control plane moving to " + ch.String(), acts
	}
	for _, cp := range c.ControlPlanes {
		if why := cpRolled(cp); why != "" {
			return false, why, nil
		}
	}
	if ch.isVersion() && c.Cluster.GetSpec().GetKubernetesVersion() != ch.GetKubernetesVersion() {
		acts = append(acts, SetClusterVersion{Cluster: name, Version: ch.GetKubernetesVersion()})
	}
	for _, md := range c.Deployments {
		v := md.GetSpec().GetVersion()
		if v == "" {
			// It follows the Cluster's version, set above.
			v = ch.GetKubernetesVersion()
		}
		if set, ok := ch.fields(v, "", md.GetSpec().GetImage(), md.GetSpec().GetImageSelector()); !ok {
			if md.GetSpec().GetVersion() == "" {
				set.Version = ""
			}
			acts = append(acts, SetDeployment{Cluster: name, Deployment: md.GetMetadata().GetName(), Set: set})
		}
	}
	if len(acts) > 0 {
		return false, "control plane done; workers moving to " + ch.String(), acts
	}
	for _, md := range c.Deployments {
		if why := mdRolled(md); why != "" {
			return false, why, nil
		}
	}
	if why := clusterNotReady(c.Cluster); why != "" {
		return false, why, nil
	}
	return true, "", nil
}

// fields returns the writes that bring an object with version (or, when
// empty, fallback), image and selector to the change, and whether it is
// there already.
func (ch change) fields(version, fallback, image string, selector map[string]string) (Fields, bool) {
	var f Fields
	ok := true
	if ch.isVersion() {
		v := version
		if v == "" {
			v = fallback
		}
		if v != ch.GetKubernetesVersion() {
			ok = false
			f.Version = ch.GetKubernetesVersion()
			if old, has := selector[VersionLabel]; has && old == v {
				f.SetImage = true
				f.ImageSelector = maps.Clone(selector)
				f.ImageSelector[VersionLabel] = ch.GetKubernetesVersion()
			}
		}
	}
	if ch.isImage() && (image != ch.GetImage() || !maps.Equal(selector, ch.GetImageSelector())) {
		ok = false
		f.SetImage, f.Image, f.ImageSelector = true, ch.GetImage(), maps.Clone(ch.GetImageSelector())
	}
	return f, ok
}

func (ch change) progressTopology(c ClusterInput) (bool, string, []Action) {
	name := c.Cluster.GetMetadata().GetName()
	topo := c.Cluster.GetSpec().GetTopology()
	ts := c.Cluster.GetStatus().GetTopology()
	switch {
	case ch.isVersion() && topo.GetVersion() != ch.GetKubernetesVersion():
		return false, "topology moving to " + ch.String(), []Action{SetTopologyVersion{Cluster: name, Version: ch.GetKubernetesVersion()}}
	case ch.isVersion() && ts.GetVersion() != ch.GetKubernetesVersion():
		return false, fmt.Sprintf("topology at %s, waiting for %s", ts.GetVersion(), ch.GetKubernetesVersion()), nil
	case ch.isClass() && ts.GetClassRevision() > ch.GetClassRevision():
		// A later Rollout of the class moved it on: nothing left to do.
		return true, "", nil
	case ch.isClass() && ts.GetClassRevision() < ch.GetClassRevision():
		return false, "moving to " + ch.String(), []Action{SetClassRevision{Cluster: name, Revision: ch.GetClassRevision()}}
	case ch.isImage():
		return true, "", nil // refused before it started; nothing to move
	}
	if ch.isClass() && ts.GetReconciledRevision() != ch.GetClassRevision() {
		return false, fmt.Sprintf("topology derived from revision %d, waiting for revision %d", ts.GetReconciledRevision(), ch.GetClassRevision()), nil
	}
	for _, o := range derived(c) {
		switch {
		case ch.isClass() && o.meta.GetAnnotations()[AnnotationClassRevision] != strconv.FormatInt(ch.GetClassRevision(), 10):
			return false, fmt.Sprintf("%s derived from revision %q, waiting for revision %d", o.name, o.meta.GetAnnotations()[AnnotationClassRevision], ch.GetClassRevision()), nil
		case ch.isVersion() && o.version != "" && o.version != ch.GetKubernetesVersion():
			return false, fmt.Sprintf("%s at %s, waiting for the topology to derive %s", o.name, o.version, ch.GetKubernetesVersion()), nil
		}
	}
	tr := conditions.Get(c.Cluster.GetStatus().GetConditions(), ConditionTopologyReconciled)
	gen := c.Cluster.GetMetadata().GetGeneration()
	switch {
	case tr == nil:
		return false, "topology not reconciled yet", nil
	case tr.GetStatus() != conditions.True || tr.GetObservedGeneration() != gen:
		return false, fmt.Sprintf("topology not reconciled (generation %d of %d): %s", tr.GetObservedGeneration(), gen, tr.GetMessage()), nil
	}
	for _, cp := range c.ControlPlanes {
		if why := cpRolled(cp); why != "" {
			return false, why, nil
		}
	}
	for _, md := range c.Deployments {
		if why := mdRolled(md); why != "" {
			return false, why, nil
		}
	}
	if why := clusterNotReady(c.Cluster); why != "" {
		return false, why, nil
	}
	return true, "", nil
}

type derivedObject struct {
	name    string
	meta    *typesv1.ObjectMeta
	version string
}

// derived are the ControlPlanes and MachineDeployments of a topology
// cluster.
func derived(c ClusterInput) []derivedObject {
	var out []derivedObject
	for _, cp := range c.ControlPlanes {
		out = append(out, derivedObject{"control plane " + cp.GetMetadata().GetName(), cp.GetMetadata(), cp.GetSpec().GetVersion()})
	}
	for _, md := range c.Deployments {
		out = append(out, derivedObject{"machine deployment " + md.GetMetadata().GetName(), md.GetMetadata(), md.GetSpec().GetVersion()})
	}
	return out
}

// cpRolled says what a ControlPlane waits for ("" when every member is
// updated and Ready at its current generation).
func cpRolled(cp *typesv1.ControlPlane) string {
	s := cp.GetStatus()
	return rolled("control plane", cp.GetMetadata(), conditions.Get(s.GetConditions(), "Ready"),
		cp.GetSpec().GetReplicas(), s.GetReplicas(), s.GetUpdatedReplicas(), s.GetReadyReplicas())
}

// mdRolled says what a MachineDeployment waits for ("" when every
// machine is updated and Ready at its current generation).
func mdRolled(md *typesv1.MachineDeployment) string {
	s := md.GetStatus()
	return rolled("machine deployment", md.GetMetadata(), conditions.Get(s.GetConditions(), "UpToDate"),
		md.GetSpec().GetReplicas(), s.GetReplicas(), s.GetUpdatedReplicas(), s.GetReadyReplicas())
}

// rolled is cpRolled and mdRolled: cond is the object's own verdict (its
// Ready or UpToDate condition), which must have seen its generation.
func rolled(what string, meta *typesv1.ObjectMeta, cond *typesv1.Condition, want, replicas, updated, ready int32) string {
	switch {
	case cond == nil || cond.GetObservedGeneration() != meta.GetGeneration():
		return fmt.Sprintf("%s %s: change not planned yet", what, meta.GetName())
	case updated != want || ready != want || replicas != want || cond.GetStatus() != conditions.True:
		msg := fmt.Sprintf("%s %s: %d of %d updated, %d Ready", what, meta.GetName(), updated, want, ready)
		if cond.GetStatus() != conditions.True && cond.GetMessage() != "" {
			msg += " (" + cond.GetMessage() + ")"
		}
		return msg
	}
	return ""
}

func clusterNotReady(c *typesv1.Cluster) string {
	r := conditions.Get(c.GetStatus().GetConditions(), "Ready")
	if r.GetStatus() == conditions.True {
		return ""
	}
	if r == nil {
		return "cluster not Ready yet"
	}
	return "cluster not Ready: " + r.GetMessage()
}
