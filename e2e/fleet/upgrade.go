package fleet

import (
	"path/filepath"
)

// PreviousLabSpec is examples/images/lab-previous.yaml in the source tree
// this package was built from: the lab image at the previous Kubernetes
// minor (kubetools.Previous), the "from" side of UpgradeMinor.
func PreviousLabSpec() string {
	return filepath.Join(filepath.Dir(DefaultLabSpec()), "lab-previous.yaml")
}
