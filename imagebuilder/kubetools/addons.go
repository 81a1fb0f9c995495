package kubetools

import (
	"bytes"
	"context"
	"fmt"
	"strings"

	"github.com/kilnhq/kiln/imagebuilder/manifest"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// ListImages returns the images kubeadm pins for kubernetesVersion, one
// reference a line as it prints them. It asks the kubeadm binary at
// kubeadm, so the answer is that kubeadm's own constants, not a table of
// Kiln's. It blocks until kubeadm exits; with an explicit version kubeadm
// does not reach the network.
//
// Equivalent to: `kubeadm config images list --kubernetes-version <v>`.
func ListImages(ctx context.Context, run Runner, kubeadm, kubernetesVersion string) ([]string, error) {
	var out, errb bytes.Buffer
	err := run.Run(ctx, Cmd{Path: kubeadm, Args: []string{"config", "images", "list", "--kubernetes-version", kubernetesVersion},
		Env: []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}, Stdout: &out, Stderr: &errb})
	if err != nil {
		return nil, fmt.Errorf("%s config images list --kubernetes-version %s: %w: %s", kubeadm, kubernetesVersion, err, strings.TrimSpace(errb.String()))
	}
	var refs []string
	for _, l := range strings.Split(out.String(), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			refs = append(refs, l)
		}
	}
	return refs, nil
}

// AddonsFromImages picks the kube-proxy, CoreDNS, etcd and pause tags out
// of kubeadm's image list (see ListImages). It returns InvalidArgument,
// naming what is missing, when the list lacks one of them.
func AddonsFromImages(refs []string) (manifest.Addons, error) {
	var a manifest.Addons
	for _, ref := range refs {
		repo, tag := ref, ""
		if i := strings.LastIndex(ref, ":"); i > strings.LastIndex(ref, "/") {
			repo, tag = ref[:i], ref[i+1:]
		}
		name := repo[strings.LastIndex(repo, "/")+1:]
		switch name {
		case KubeProxy:
			a.KubeProxy = tag
		case CoreDNS:
			a.CoreDNS = tag
		case Etcd:
			a.Etcd = tag
		case Pause:
			a.Pause = tag
		}
	}
	var missing []string
	for _, f := range []struct{ name, tag string }{{KubeProxy, a.KubeProxy}, {CoreDNS, a.CoreDNS}, {Etcd, a.Etcd}, {Pause, a.Pause}} {
		if f.tag == "" {
			missing = append(missing, f.name)
		}
	}
	if len(missing) > 0 {
		return manifest.Addons{}, errdefs.InvalidArgument("kubeadm image list %q: no tag for %s", refs, strings.Join(missing, ", "))
	}
	return a, nil
}

// Addons runs the kubeadm at kubeadm (see ListImages) and returns the addon
// tags it pins for kubernetesVersion.
func Addons(ctx context.Context, run Runner, kubeadm, kubernetesVersion string) (manifest.Addons, error) {
	refs, err := ListImages(ctx, run, kubeadm, kubernetesVersion)
	if err != nil {
		return manifest.Addons{}, err
	}
	return AddonsFromImages(refs)
}
