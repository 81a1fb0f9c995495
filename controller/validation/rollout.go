package validation

import typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"

// checkRollout checks a Rollout spec on its own.
//
// The kind is registered but not reconciled yet: until it is, the
// controller refuses it rather than store an object nothing acts on.
func checkRollout(p *problems, s *typesv1.RolloutSpec) {
	_ = s
	p.add("kind", "Rollout is not served by this controller yet")
}
