package validation

import typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"

// checkClusterClass checks a ClusterClass spec on its own.
//
// The kind is registered but not reconciled yet: until it is, the
// controller refuses it rather than store an object nothing acts on.
func checkClusterClass(p *problems, s *typesv1.ClusterClassSpec) {
	_ = s
	p.add("kind", "ClusterClass is not served by this controller yet")
}
