package topologyplan

import (
	"fmt"
	"slices"
	"sort"

	"google.golang.org/protobuf/proto"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// RolloutName is the name of the Rollout that carries revision rev of
// class to its clusters.
func RolloutName(class string, rev int64) string { return fmt.Sprintf("%s-r%d", class, rev) }

// ClassResult is what PlanClass decides for a ClusterClass.
type ClassResult struct {
	// Status is the class's next status; nil when it does not change.
	Status *typesv1.ClusterClassStatus
	// Rollout, when set, is to be created (an existing one of that name
	// is left as it is): it carries the new revision to the clusters.
	Rollout *typesv1.Rollout
	// Event says what changed ("" when nothing did).
	Event string
}

// PlanClass decides a class's revisions and counts its clusters (all, and
// those up to date: UpToDate): revision 1 at creation, one more
// at every change of spec (a new entry in status.revisions and a Rollout
// "<class>-r<rev>" built from spec.rollout when the class has clusters),
// and the pruning of the revisions no cluster of clusters (the clusters
// whose spec.topology.class names the class) pins any more. The current
// revision is always kept.
func PlanClass(class *typesv1.ClusterClass, clusters []*typesv1.Cluster) ClassResult {
	name := class.GetMetadata().GetName()
	st := proto.Clone(class.GetStatus()).(*typesv1.ClusterClassStatus)
	if st == nil {
		st = &typesv1.ClusterClassStatus{}
	}
	var res ClassResult
	cur := st.GetRevision()
	latest := RevisionSpec(class, cur)
	switch {
	case cur == 0:
		st.Revision = 1
		st.Revisions = append(st.Revisions, &typesv1.ClusterClassRevision{Revision: 1, Spec: cloneSpec(class.GetSpec())})
		res.Event = fmt.Sprintf("revision 1 of ClusterClass %s recorded", name)
	case latest == nil || !proto.Equal(latest, class.GetSpec()):
		st.Revision = cur + 1
		st.Revisions = append(st.Revisions, &typesv1.ClusterClassRevision{Revision: st.Revision, Spec: cloneSpec(class.GetSpec())})
		res.Event = fmt.Sprintf("revision %d of ClusterClass %s recorded", st.Revision, name)
		if len(clusters) > 0 {
			spec := proto.Clone(class.GetSpec().GetRollout()).(*typesv1.RolloutSpec)
			if spec == nil {
				spec = &typesv1.RolloutSpec{}
			}
			spec.Change = &typesv1.RolloutChange{ClusterClass: name, ClassRevision: st.Revision}
			rn := RolloutName(name, st.Revision)
			res.Rollout = &typesv1.Rollout{ApiVersion: "kiln.dev/v1", Kind: "Rollout",
				Metadata: &typesv1.ObjectMeta{Name: rn, Labels: map[string]string{LabelClass: name}}, Spec: spec}
			res.Event += fmt.Sprintf("; Rollout %s carries it to %d clusters", rn, len(clusters))
		}
	}
	// Prune what no cluster pins. A cluster without a pin yet takes the
	// current revision.
	pinned := map[int64]bool{st.Revision: true}
	for _, c := range clusters {
		pinned[c.GetStatus().GetTopology().GetClassRevision()] = true
	}
	var pruned []int64
	st.Revisions = slices.DeleteFunc(st.Revisions, func(r *typesv1.ClusterClassRevision) bool {
		if pinned[r.GetRevision()] {
			return false
		}
		pruned = append(pruned, r.GetRevision())
		return true
	})
	sort.Slice(st.Revisions, func(i, j int) bool { return st.Revisions[i].GetRevision() < st.Revisions[j].GetRevision() })
	if len(pruned) > 0 {
		if res.Event != "" {
			res.Event += "; "
		}
		res.Event += fmt.Sprintf("revisions %v pruned: no cluster follows them", pruned)
	}
	st.Clusters, st.UpToDateClusters = int32(len(clusters)), 0
	for _, c := range clusters {
		if Reconciled(c) && c.GetStatus().GetTopology().GetClassRevision() == st.Revision {
			st.UpToDateClusters++
		}
	}
	if !proto.Equal(st, orEmptyClassStatus(class.GetStatus())) {
		res.Status = st
	}
	return res
}

func orEmptyClassStatus(s *typesv1.ClusterClassStatus) *typesv1.ClusterClassStatus {
	if s == nil {
		return &typesv1.ClusterClassStatus{}
	}
	return s
}

// UpToDate reports whether cluster c follows the class's current revision
// and its derived objects match it (Reconciled).
func UpToDate(class *typesv1.ClusterClass, c *typesv1.Cluster) bool {
	return Reconciled(c) && c.GetStatus().GetTopology().GetClassRevision() == class.GetStatus().GetRevision()
}

// Reconciled reports whether the derived objects of cluster c match its
// pinned revision and its spec: status.topology.reconciledRevision is the
// pin and TopologyReconciled is True for the cluster's generation.
func Reconciled(c *typesv1.Cluster) bool {
	if t := c.GetStatus().GetTopology(); t.GetReconciledRevision() != t.GetClassRevision() || t.GetClassRevision() == 0 {
		return false
	}
	for _, cd := range c.GetStatus().GetConditions() {
		if cd.GetType() == ConditionTopologyReconciled {
			return cd.GetStatus() == "True" && cd.GetObservedGeneration() == c.GetMetadata().GetGeneration()
		}
	}
	return false
}

func cloneSpec(s *typesv1.ClusterClassSpec) *typesv1.ClusterClassSpec {
	if s == nil {
		return &typesv1.ClusterClassSpec{}
	}
	return proto.Clone(s).(*typesv1.ClusterClassSpec)
}
