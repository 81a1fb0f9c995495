package resources

import (
	"context"
	"fmt"
	"strings"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/classvar"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/topologyplan"
	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// observeTopology fills in what the topology rules of obj read from the
// store, and completes a topology Cluster's spec with its class's
// defaults (spec.cluster of the revision it follows, variables
// substituted) for the fields the user left empty: a topology Cluster is
// stored complete, so its CIDRs are checked and kept like any other's.
// batchClasses (nil outside a batch) are the classes a batch applies with
// obj: a Cluster's class is the stored one with the batch's spec, or the
// batch's when none is stored.
func (s *Service) observeTopology(ctx context.Context, obj proto.Message, observed *validation.Observed, batchClasses map[string]*typesv1.ClusterClass) error {
	switch o := obj.(type) {
	case *typesv1.Cluster:
		t := o.GetSpec().GetTopology()
		if t == nil || t.GetClass() == "" {
			return nil
		}
		class := &typesv1.ClusterClass{}
		_, err := s.store.Get(ctx, "clusterclasses", t.GetClass(), class)
		if err != nil && !errdefs.IsNotFound(err) {
			return fmt.Errorf("cluster class %q: %w", t.GetClass(), err)
		}
		if pending, ok := batchClasses[t.GetClass()]; ok {
			if err != nil {
				class = proto.Clone(pending).(*typesv1.ClusterClass)
				class.Status = nil
			} else {
				class.Spec = proto.Clone(pending.GetSpec()).(*typesv1.ClusterClassSpec)
			}
		} else if err != nil {
			return nil // ValidateAgainst refuses it
		}
		observed.Class = class
		observed.ClassSpec = class.GetSpec()
		if cur := observed.Current.GetCluster(); cur != nil {
			if spec := topologyplan.RevisionSpec(class, cur.GetStatus().GetTopology().GetClassRevision()); spec != nil {
				observed.ClassSpec = spec
			}
		}
		spec, err := topologyplan.ClusterDefaults(o.GetSpec(), observed.ClassSpec)
		if err != nil {
			return errdefs.InvalidArgument("cluster %q: class %q: %v", o.GetMetadata().GetName(), t.GetClass(), err)
		}
		o.Spec = spec
		if observed.ImageVersions, err = s.imageVersions(ctx); err != nil {
			return err
		}
		if _, probs := classvar.Resolve(observed.ClassSpec.GetVariables(), t.GetVariables()); len(probs) == 0 {
			// The objects the cluster would derive must be valid too.
			if _, _, err := topologyplan.Derive(o, observed.ClassSpec, 0); err != nil {
				return errdefs.InvalidArgument("cluster %q: its objects derived from class %q would be invalid: %v", o.GetMetadata().GetName(), t.GetClass(), err)
			}
		}
	case *typesv1.ClusterClass:
		items, err := store.ListAll(ctx, s.store, "clusters", func() proto.Message { return &typesv1.Cluster{} })
		if err != nil {
			return err
		}
		for _, it := range items {
			if c := it.Msg.(*typesv1.Cluster); c.GetSpec().GetTopology().GetClass() == o.GetMetadata().GetName() {
				observed.ClassClusters = append(observed.ClassClusters, c)
			}
		}
		var broken []string
		for _, c := range observed.ClassClusters {
			vals, probs := classvar.Resolve(o.GetSpec().GetVariables(), c.GetSpec().GetTopology().GetVariables())
			if len(probs) > 0 || vals == nil {
				continue // ValidateAgainst names these
			}
			if _, reason, err := topologyplan.Derive(c, o.GetSpec(), 0); err != nil && reason == topologyplan.ReasonTemplateInvalid {
				broken = append(broken, fmt.Sprintf("%s (%v)", c.GetMetadata().GetName(), err))
			}
		}
		if len(broken) > 0 {
			return errdefs.InvalidArgument("ClusterClass %q: the change would make invalid objects for %d cluster(s): %s", o.GetMetadata().GetName(), len(broken), strings.Join(broken, ", "))
		}
		if len(observed.ClassClusters) > 0 {
			if observed.ImageVersions, err = s.imageVersions(ctx); err != nil {
				return err
			}
		}
	}
	return nil
}

// imageVersions maps every Image to its Kubernetes version.
func (s *Service) imageVersions(ctx context.Context) (map[string]string, error) {
	items, err := store.ListAll(ctx, s.store, "images", func() proto.Message { return &typesv1.Image{} })
	if err != nil {
		return nil, err
	}
	out := make(map[string]string, len(items))
	for _, it := range items {
		out[it.Name] = it.Msg.(*typesv1.Image).GetSpec().GetKubernetesVersion()
	}
	return out, nil
}
