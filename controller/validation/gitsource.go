package validation

import typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"

// checkGitSource checks a GitSource spec on its own.
//
// The kind is registered but not reconciled yet: until it is, the
// controller refuses it rather than store an object nothing acts on.
func checkGitSource(p *problems, s *typesv1.GitSourceSpec) {
	_ = s
	p.add("kind", "GitSource is not served by this controller yet")
}
