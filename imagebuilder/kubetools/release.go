package kubetools

import (
	"strings"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Previous returns the newest patch of the minor before Pinned on the Go
// module proxy: Kubernetes v1.33.13, the "from" side of a minor-version
// upgrade test (make lab-upgrade). Etcd, CoreDNS and Pause are the tags in
// that version's cmd/kubeadm/app/constants (DefaultEtcdVersion,
// CoreDNSVersion, PauseVersion); BuildDate is the module's release time on
// the proxy (k8s.io/kubernetes/@v/v1.33.13.info).
func Previous() Release {
	return Release{
		Kubernetes: "v1.33.13",
		Staging:    "v0.33.13",
		Etcd:       "3.5.24-0",
		CoreDNS:    "v1.12.0",
		Pause:      "3.10",
		GitCommit:  "0000000000000000000000000000000000000000",
		BuildDate:  "2026-06-11T16:59:07Z",
		Registry:   "registry.k8s.io",
	}
}

// Releases returns every release Kiln has a recipe for: Pinned first, then
// Previous.
func Releases() []Release {
	return []Release{Pinned(), Previous()}
}

// Release names accepted by SelectRelease besides a version.
const (
	ReleasePinned   = "pinned"
	ReleasePrevious = "previous"
)

// SelectRelease returns the release a user names: "pinned" (or empty),
// "previous", or a Kubernetes version with or without the leading "v"
// ("v1.33.13", "1.34.4"). It returns InvalidArgument, listing the versions
// it knows, for any other name: kube-tools builds only releases whose
// etcd/CoreDNS/pause tags were read from their kubeadm.
func SelectRelease(name string) (Release, error) {
	switch strings.TrimSpace(name) {
	case "", ReleasePinned:
		return Pinned(), nil
	case ReleasePrevious:
		return Previous(), nil
	}
	v := strings.TrimSpace(name)
	if !strings.HasPrefix(v, "v") {
		v = "v" + v
	}
	for _, r := range Releases() {
		if r.Kubernetes == v {
			return r, nil
		}
	}
	return Release{}, errdefs.InvalidArgument("kube-tools: no recipe for Kubernetes %q: known releases are %s (pinned) and %s (previous)",
		name, Pinned().Kubernetes, Previous().Kubernetes)
}

// ReleaseFor returns the release of a Kubernetes version exactly as an image
// spec's kubernetesVersion names it; an empty version means Pinned. It
// returns InvalidArgument for a version without a recipe.
func ReleaseFor(kubernetesVersion string) (Release, error) {
	if kubernetesVersion == "" {
		return Pinned(), nil
	}
	if kubernetesVersion == ReleasePinned || kubernetesVersion == ReleasePrevious {
		return Release{}, errdefs.InvalidArgument("kube-tools: %q is not a Kubernetes version", kubernetesVersion)
	}
	return SelectRelease(kubernetesVersion)
}

// BuildCommand is the command that fills the cache with r: `make
// kube-tools` for Pinned, with KUBE_RELEASE=<version> otherwise.
func BuildCommand(r Release) string {
	if r.Kubernetes == Pinned().Kubernetes {
		return "make kube-tools"
	}
	return "make kube-tools KUBE_RELEASE=" + r.Kubernetes
}
