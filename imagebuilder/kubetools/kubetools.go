// Package kubetools produces the pinned Kubernetes release that Kiln installs
// and tests against: kubeadm, kubelet, kube-apiserver,
// kube-controller-manager, kube-scheduler, kube-proxy and kubectl built from
// the Go module proxy (or downloaded from a mirror in the dl.k8s.io layout),
// plus etcd, CoreDNS and pause at the versions that kubeadm expects. Outputs
// live in a cache directory keyed on the Kubernetes version, with a manifest
// of every binary's sha256; a cache that verifies is used as is.
//
// Cache layout under Dir (default /var/cache/kiln/kube-tools):
//
//	v1.34.4/manifest.json       versions and sha256 of every binary
//	v1.34.4/bin/<name>          the ten binaries
//	v1.34.4/images/<name>.tar   docker-archive images (see Images)
//	work/v1.34.4/...            the generated tools modules
package kubetools

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Release pins one Kubernetes release and the component versions its kubeadm
// expects.
type Release struct {
	// Kubernetes is the release tag, e.g. "v1.34.4".
	Kubernetes string
	// Staging is the version of the k8s.io staging modules, e.g. "v0.34.4".
	Staging string
	// Etcd is the etcd image tag kubeadm expects, e.g. "3.6.5-0"; the
	// module version is derived from it (v3.6.5).
	Etcd string
	// CoreDNS is the CoreDNS tag, e.g. "v1.12.1".
	CoreDNS string
	// Pause is the pause image tag, e.g. "3.10.1".
	Pause string
	// GitCommit is written into the Kubernetes binaries' version info. Builds
	// from the module proxy have no git checkout; this is not upstream's
	// commit.
	GitCommit string
	// BuildDate is the fixed build date (RFC 3339) written into the version
	// info, for reproducible binaries: the module's release time.
	BuildDate string
	// Registry is the image registry of the names kubeadm uses.
	Registry string
}

// Pinned returns the release Kiln pins: Kubernetes v1.34.4, the newest minor
// proven to run with Debian 12's containerd 1.6 on the project's machines.
func Pinned() Release {
	return Release{
		Kubernetes: "v1.34.4",
		Staging:    "v0.34.4",
		Etcd:       "3.6.5-0",
		CoreDNS:    "v1.12.1",
		Pause:      "3.10.1",
		GitCommit:  "0000000000000000000000000000000000000000",
		BuildDate:  "2026-02-10T12:53:36Z",
		Registry:   "registry.k8s.io",
	}
}

// Names of the binaries.
const (
	Kubeadm               = "kubeadm"
	Kubelet               = "kubelet"
	KubeAPIServer         = "kube-apiserver"
	KubeControllerManager = "kube-controller-manager"
	KubeScheduler         = "kube-scheduler"
	KubeProxy             = "kube-proxy"
	Kubectl               = "kubectl"
	Etcd                  = "etcd"
	CoreDNS               = "coredns"
	Pause                 = "pause"
)

// KubernetesBinaries are the binaries built from k8s.io/kubernetes/cmd, in
// build order (kubeadm first: it is the one a user checks).
func KubernetesBinaries() []string {
	return []string{Kubeadm, KubeAPIServer, Kubelet, KubeControllerManager, KubeScheduler, KubeProxy, Kubectl}
}

// Binaries are all binaries in the cache, in build order.
func Binaries() []string {
	return append(KubernetesBinaries(), Etcd, CoreDNS, Pause)
}

// Minor returns the release's minor version ("34" for v1.34.4).
func (r Release) Minor() string {
	parts := strings.Split(strings.TrimPrefix(r.Kubernetes, "v"), ".")
	if len(parts) < 2 {
		return ""
	}
	return parts[1]
}

// EtcdModuleVersion is the go.etcd.io/etcd/server/v3 version of the etcd
// image tag ("3.6.5-0" -> "v3.6.5").
func (r Release) EtcdModuleVersion() string {
	v, _, _ := strings.Cut(r.Etcd, "-")
	return "v" + v
}

// Version returns the version the manifest records for a binary.
func (r Release) Version(name string) string {
	switch name {
	case Etcd:
		return r.Etcd
	case CoreDNS:
		return r.CoreDNS
	case Pause:
		return r.Pause
	default:
		return r.Kubernetes
	}
}

// Validate reports an InvalidArgument error when a field is missing.
func (r Release) Validate() error {
	if !strings.HasPrefix(r.Kubernetes, "v1.") || r.Minor() == "" {
		return errdefs.InvalidArgument("release: kubernetes version %q is not of the form v1.Y.Z", r.Kubernetes)
	}
	for name, v := range map[string]string{"staging": r.Staging, "etcd": r.Etcd, "coredns": r.CoreDNS, "pause": r.Pause, "build date": r.BuildDate, "git commit": r.GitCommit, "registry": r.Registry} {
		if v == "" {
			return errdefs.InvalidArgument("release %s: %s version is empty", r.Kubernetes, name)
		}
	}
	return nil
}

// Manifest records what a cache directory holds.
type Manifest struct {
	Kubernetes string `json:"kubernetes"`
	Etcd       string `json:"etcd"`
	CoreDNS    string `json:"coredns"`
	Pause      string `json:"pause"`
	// Recipe is Recipe() of the build: flags and generated sources.
	Recipe string `json:"recipe"`
	// Source says where the binaries came from: "go-module-proxy" or
	// "mirror <url>" (credentials removed).
	Source string `json:"source"`
	// GoVersion is the Go toolchain that built them, when built.
	GoVersion string   `json:"goVersion,omitempty"`
	Binaries  []Binary `json:"binaries"`
}

// Binary is one manifest entry.
type Binary struct {
	Name    string `json:"name"`
	Version string `json:"version"`
	SHA256  string `json:"sha256"`
	Size    int64  `json:"size"`
	// Origin is how the binary was obtained: "built" or "downloaded".
	Origin string `json:"origin"`
}

// ManifestFile is the manifest's name inside a version directory.
const ManifestFile = "manifest.json"

// Cache is the root of the kube-tools cache.
type Cache struct {
	Dir string
}

// VersionDir is the directory of one release.
func (c Cache) VersionDir(r Release) string { return filepath.Join(c.Dir, r.Kubernetes) }

// BinDir is the directory holding a release's binaries.
func (c Cache) BinDir(r Release) string { return filepath.Join(c.VersionDir(r), "bin") }

// ImagesDir is the directory holding a release's image archives.
func (c Cache) ImagesDir(r Release) string { return filepath.Join(c.VersionDir(r), "images") }

// WorkDir is where the tools modules of a release are generated.
func (c Cache) WorkDir(r Release) string { return filepath.Join(c.Dir, "work", r.Kubernetes) }

// Verify checks that the cache holds release r completely: the manifest
// names r's versions and every binary is present with its recorded sha256.
// It reads every binary (about 500 MB; a second or two). It returns the
// manifest, or a NotFound error when there is no cache and a
// FailedPrecondition error naming the first mismatch.
func (c Cache) Verify(r Release) (*Manifest, error) {
	dir := c.VersionDir(r)
	b, err := os.ReadFile(filepath.Join(dir, ManifestFile))
	if err != nil {
		if os.IsNotExist(err) {
			return nil, errdefs.NotFound("kube-tools %s: no cache in %s", r.Kubernetes, dir)
		}
		return nil, fmt.Errorf("kube-tools %s: %w", r.Kubernetes, err)
	}
	return verifyDir(dir, b, r)
}

func verifyDir(dir string, manifestJSON []byte, r Release) (*Manifest, error) {
	var m Manifest
	if err := json.Unmarshal(manifestJSON, &m); err != nil {
		return nil, errdefs.FailedPrecondition("kube-tools %s: manifest in %s is unreadable: %v", r.Kubernetes, dir, err)
	}
	if m.Kubernetes != r.Kubernetes || m.Etcd != r.Etcd || m.CoreDNS != r.CoreDNS || m.Pause != r.Pause {
		return nil, errdefs.FailedPrecondition("kube-tools %s: cache in %s holds kubernetes %s etcd %s coredns %s pause %s, want %s %s %s %s",
			r.Kubernetes, dir, m.Kubernetes, m.Etcd, m.CoreDNS, m.Pause, r.Kubernetes, r.Etcd, r.CoreDNS, r.Pause)
	}
	if want := Recipe(r); m.Recipe != want {
		return nil, errdefs.FailedPrecondition("kube-tools %s: cache in %s was built with recipe %s, this kiln-imagebuilder builds with %s",
			r.Kubernetes, dir, m.Recipe, want)
	}
	have := map[string]Binary{}
	for _, b := range m.Binaries {
		have[b.Name] = b
	}
	for _, name := range Binaries() {
		want, ok := have[name]
		if !ok {
			return nil, errdefs.FailedPrecondition("kube-tools %s: manifest in %s lists no %s", r.Kubernetes, dir, name)
		}
		sum, size, err := fileSHA256(filepath.Join(dir, "bin", name))
		if err != nil {
			return nil, errdefs.FailedPrecondition("kube-tools %s: %s: %v", r.Kubernetes, name, err)
		}
		if sum != want.SHA256 || size != want.Size {
			return nil, errdefs.FailedPrecondition("kube-tools %s: %s has sha256 %s (%d bytes), manifest says %s (%d bytes)",
				r.Kubernetes, name, sum, size, want.SHA256, want.Size)
		}
	}
	return &m, nil
}

// fileSHA256 returns the hex sha256 and size of a file.
func fileSHA256(name string) (string, int64, error) {
	f, err := os.Open(name)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, err
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}
