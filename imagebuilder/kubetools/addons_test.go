package kubetools

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/imagebuilder/manifest"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

// kubeadmV1344List is what kubeadm v1.34.4 prints for
// `kubeadm config images list --kubernetes-version v1.34.4`.
const kubeadmV1344List = `registry.k8s.io/kube-apiserver:v1.34.4
registry.k8s.io/kube-controller-manager:v1.34.4
registry.k8s.io/kube-scheduler:v1.34.4
registry.k8s.io/kube-proxy:v1.34.4
registry.k8s.io/coredns/coredns:v1.12.1
registry.k8s.io/pause:3.10.1
registry.k8s.io/etcd:3.6.5-0
`

func TestAddonsFromImages(t *testing.T) {
	for _, tc := range []struct {
		name    string
		list    string
		want    manifest.Addons
		wantErr string
	}{
		{name: "kubeadm v1.34.4", list: kubeadmV1344List,
			want: manifest.Addons{KubeProxy: "v1.34.4", CoreDNS: "v1.12.1", Etcd: "3.6.5-0", Pause: "3.10.1"}},
		{name: "a mirror with a port", list: "mirror.example:5000/k8s/kube-proxy:v1.35.0\nmirror.example:5000/coredns/coredns:v1.13.1\nmirror.example:5000/pause:3.10.1\nmirror.example:5000/etcd:3.6.6-0\n",
			want: manifest.Addons{KubeProxy: "v1.35.0", CoreDNS: "v1.13.1", Etcd: "3.6.6-0", Pause: "3.10.1"}},
		{name: "no coredns", list: "registry.k8s.io/kube-proxy:v1.34.4\nregistry.k8s.io/pause:3.10.1\nregistry.k8s.io/etcd:3.6.5-0\n",
			wantErr: "no tag for coredns"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := AddonsFromImages(strings.Fields(tc.list))
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				require.True(t, errdefs.IsInvalidArgument(err), "AddonsFromImages: %v, want InvalidArgument", err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
			require.True(t, got.Complete())
		})
	}
}

// TestAddonsAsksKubeadm runs a stand-in kubeadm (a shell script printing
// kubeadm v1.34.4's list and the arguments it got) through ExecRunner: the
// tags come from the binary's answer for the version asked.
func TestAddonsAsksKubeadm(t *testing.T) {
	dir := t.TempDir()
	kubeadm := filepath.Join(dir, "kubeadm")
	args := filepath.Join(dir, "args")
	script := "#!/bin/sh\necho \"$@\" > " + args + "\ncat <<'LIST'\n" + kubeadmV1344List + "LIST\n"
	require.NoError(t, os.WriteFile(kubeadm, []byte(script), 0o755))

	a, err := Addons(context.Background(), ExecRunner{}, kubeadm, "v1.34.4")
	require.NoError(t, err)
	require.Equal(t, manifest.Addons{KubeProxy: "v1.34.4", CoreDNS: "v1.12.1", Etcd: "3.6.5-0", Pause: "3.10.1"}, a)
	got, err := os.ReadFile(args)
	require.NoError(t, err)
	require.Equal(t, "config images list --kubernetes-version v1.34.4\n", string(got))

	require.NoError(t, os.WriteFile(kubeadm, []byte("#!/bin/sh\necho 'unknown flag' >&2\nexit 1\n"), 0o755))
	_, err = Addons(context.Background(), ExecRunner{}, kubeadm, "v1.34.4")
	require.ErrorContains(t, err, "config images list --kubernetes-version v1.34.4: exit status 1: unknown flag")
}

// TestAddonsFromCachedKubeadm asks the real kubeadm of the pinned release's
// kube-tools cache, when it has been built (make kube-tools).
func TestAddonsFromCachedKubeadm(t *testing.T) {
	r := Pinned()
	kubeadm := filepath.Join(Cache{Dir: "/var/cache/kiln/kube-tools"}.BinDir(r), Kubeadm)
	if _, err := os.Stat(kubeadm); err != nil {
		testenv.Skipf(t, "no kubeadm %s in the kube-tools cache (%v): run %s", r.Kubernetes, err, BuildCommand(r))
	}
	a, err := Addons(context.Background(), ExecRunner{}, kubeadm, r.Kubernetes)
	require.NoError(t, err)
	require.Equal(t, manifest.Addons{KubeProxy: r.Kubernetes, CoreDNS: r.CoreDNS, Etcd: r.Etcd, Pause: r.Pause}, a)
}
