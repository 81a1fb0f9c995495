package kubetools

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/imagebuilder/ociarchive"
	"github.com/kilnhq/kiln/imagebuilder/ociarchive/ociarchivetest"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

// pinnedCache returns the machine's kube-tools cache, skipping the test
// when `make kube-tools` has not filled it (tests never build Kubernetes).
func pinnedCache(t *testing.T) (Cache, *Manifest) {
	t.Helper()
	root := os.Getenv("KILN_CACHE")
	if root == "" {
		root = "/var/cache/kiln"
	}
	c := Cache{Dir: filepath.Join(root, "kube-tools")}
	m, err := c.Verify(Pinned())
	if errdefs.IsNotFound(err) {
		testenv.Skipf(t, "no kube-tools cache in %s: run `make kube-tools` first", c.Dir)
	}
	if errdefs.IsFailedPrecondition(err) {
		testenv.Skipf(t, "the kube-tools cache is stale or damaged (%v): run `make kube-tools` first", err)
	}
	require.NoError(t, err)
	return c, m
}

func output(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	require.NoError(t, err, "%s %s:\n%s", name, strings.Join(args, " "), out)
	return strings.TrimSpace(string(out))
}

// TestPinnedCacheVersions runs every cached binary and checks the version it
// reports, and that kubeadm asks for exactly the images Kiln writes.
func TestPinnedCacheVersions(t *testing.T) {
	c, _ := pinnedCache(t)
	r := Pinned()
	bin := func(n string) string { return filepath.Join(c.BinDir(r), n) }

	if got := output(t, bin(Kubeadm), "version", "-o", "short"); got != r.Kubernetes {
		t.Errorf("kubeadm version -o short = %q, want %q", got, r.Kubernetes)
	}
	tests := []struct {
		name string
		args []string
		want string
	}{
		{Kubelet, []string{"--version"}, "Kubernetes " + r.Kubernetes},
		{KubeAPIServer, []string{"--version"}, "Kubernetes " + r.Kubernetes},
		{KubeControllerManager, []string{"--version"}, "Kubernetes " + r.Kubernetes},
		{KubeScheduler, []string{"--version"}, "Kubernetes " + r.Kubernetes},
		{KubeProxy, []string{"--version"}, "Kubernetes " + r.Kubernetes},
		{Kubectl, []string{"version", "--client"}, "Client Version: " + r.Kubernetes},
		{Etcd, []string{"--version"}, "etcd Version: " + strings.TrimPrefix(r.EtcdModuleVersion(), "v")},
		{CoreDNS, []string{"-version"}, "CoreDNS-" + strings.TrimPrefix(r.CoreDNS, "v")},
	}
	for _, tt := range tests {
		if got := output(t, bin(tt.name), tt.args...); !strings.Contains(got, tt.want) {
			t.Errorf("%s %s = %q, want it to contain %q", tt.name, strings.Join(tt.args, " "), got, tt.want)
		}
	}

	list := strings.Fields(output(t, bin(Kubeadm), "config", "images", "list", "--kubernetes-version", r.Kubernetes))
	if want := ImageRefs(r); !slices.Equal(list, want) {
		t.Errorf("kubeadm config images list = %v, want ImageRefs() = %v", list, want)
	}
}

// TestPinnedArchivesRun writes the seven archives from the cache, imports
// them into a private containerd under the names kubeadm uses, and runs a
// command in each image that a cluster depends on.
func TestPinnedArchivesRun(t *testing.T) {
	if testing.Short() {
		t.Skip("writes and imports about 400 MB of images")
	}
	c, _ := pinnedCache(t)
	sock := ociarchivetest.StartContainerd(t)
	r := Pinned()
	imgs, err := Images(context.Background(), r, c.BinDir(r), DebianHostTools("amd64"), ExecRunner{})
	if errdefs.IsNotFound(err) {
		testenv.Skipf(t, "kube-proxy image needs host tools: %v", err)
	}
	require.NoError(t, err)
	dir := t.TempDir()
	for _, ni := range imgs {
		p := filepath.Join(dir, ni.Name+".tar")
		_, err := ociarchive.WriteFile(p, ni.Image)
		require.NoError(t, err)
		ociarchivetest.Ctr(t, sock, "images", "import", p)
	}
	listed := ociarchivetest.Ctr(t, sock, "images", "ls", "-q")
	for _, ref := range ImageRefs(r) {
		if !strings.Contains(listed, ref) {
			t.Errorf("ctr images ls = %q, want %s", listed, ref)
		}
	}
	refs := ImageRefs(r)
	tests := []struct {
		ref  string
		args []string
		want string
	}{
		{refs[0], []string{"kube-apiserver", "--version"}, "Kubernetes " + r.Kubernetes},
		{refs[3], []string{"kube-proxy", "--version"}, "Kubernetes " + r.Kubernetes},
		{refs[3], []string{"iptables", "-m", "statistic", "--help"}, "statistic match options"},
		{refs[3], []string{"conntrack", "--version"}, "conntrack"},
		{refs[6], []string{"etcd", "--version"}, "etcd Version: 3.6.5"},
		{refs[4], []string{"/coredns", "-version"}, "CoreDNS-1.12.1"},
	}
	for i, tt := range tests {
		id := "kiln-run-" + string(rune('a'+i))
		out := ociarchivetest.Ctr(t, sock, append([]string{"run", "--rm", tt.ref, id}, tt.args...)...)
		if !strings.Contains(out, tt.want) {
			t.Errorf("ctr run %s %s = %q, want it to contain %q", tt.ref, strings.Join(tt.args, " "), out, tt.want)
		}
	}
}
