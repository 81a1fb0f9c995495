package fleet_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/kilnhq/kiln/e2e/fleet"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/internal/testenv"
)

// repoRoot is the checkout this test was built from.
func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// needLab skips unless the machine can run a lab that provisions a real
// cluster: root, the tools, and the kube-tools cache (make kube-tools).
func needLab(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("provisions a real cluster on a lab rack (minutes)")
	}
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root: network namespaces, nftables, systemd-nspawn, loop devices")
	}
	for _, tool := range []string{"ip", "nft", "systemd-nspawn", "ipmi_sim", "sfdisk", "mkfs.ext4", "xorriso", "zstd"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "needs %s (hack/deps.sh installs it)", tool)
		}
	}
	rel := kubetools.Pinned()
	if _, err := os.Stat(filepath.Join(rootfs.CacheRoot(), "kube-tools", rel.Kubernetes, "manifest.json")); err != nil {
		testenv.Skipf(t, "needs the kube-tools cache for %s: run make kube-tools", rel.Kubernetes)
	}
}

// buildBinaries builds the four binaries as make build does.
func buildBinaries(t *testing.T) string {
	t.Helper()
	bin := t.TempDir()
	for _, b := range []string{"kiln-agent", "kiln-controller", "kilnctl", "kiln-imagebuilder"} {
		args := []string{"build", "-trimpath", "-o", filepath.Join(bin, b)}
		if b == "kiln-agent" {
			args = append(args, "-tags", "grpcnotrace")
		}
		cmd := exec.Command("go", append(args, "./cmd/"+b)...)
		cmd.Dir = repoRoot()
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "go build %s: %s", b, out)
	}
	return bin
}

// freeSubnet picks a 10.251.X.0/24 that no interface of this machine uses.
func freeSubnet(t *testing.T) string {
	t.Helper()
	ifs, err := net.InterfaceAddrs()
	require.NoError(t, err)
	for range 200 {
		p := netip.MustParsePrefix(fmt.Sprintf("10.251.%d.0/24", 100+rand.IntN(150)))
		used := false
		for _, a := range ifs {
			if n, ok := a.(*net.IPNet); ok {
				if ip, ok := netip.AddrFromSlice(n.IP); ok && p.Contains(ip.Unmap()) {
					used = true
				}
			}
		}
		if !used {
			return p.String()
		}
	}
	t.Fatal("no free 10.251.X.0/24")
	return ""
}

// labCluster is examples/lab-cluster.yaml as shipped (it names its image
// by labels, so it works whatever the lab image's tag), or, with image
// set, with every spec naming that image instead; with the lab's API load
// balancer as controlPlaneEndpoint either way, as make lab applies it.
func labCluster(t *testing.T, lab *fleet.Lab, image string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(), "examples", "lab-cluster.yaml"))
	require.NoError(t, err)
	if image != "" {
		var docs [][]byte
		for _, d := range bytes.Split(b, []byte("\n---\n")) {
			var r map[string]any
			require.NoError(t, yaml.Unmarshal(d, &r))
			if spec, ok := r["spec"].(map[string]any); ok {
				if _, ok := spec["imageSelector"]; ok {
					delete(spec, "imageSelector")
					spec["image"] = image
				}
			}
			out, err := yaml.Marshal(r)
			require.NoError(t, err)
			docs = append(docs, out)
		}
		b = bytes.Join(docs, []byte("---\n"))
	}
	out, err := fleet.ClusterForLab(b, lab.APIServerEndpoint())
	require.NoError(t, err)
	return out
}

// labTagDate is the date in the tests' lab image tag: one that no file of
// examples/ names (TestExamplesNameNoLabTagDate), so that provisioning the
// shipped examples shows they work on any day, not only the one they were
// written on.
const labTagDate = "20300102"

// startLab builds everything and brings up a lab's rack and controller
// with the lab image applied; the hosts are not registered yet. Down runs
// at cleanup. Each tweak may change the lab's shape or the controller's
// flags before the lab starts.
func startLab(t *testing.T, ctx context.Context, tweaks ...func(*fleet.Config)) (*fleet.Lab, string) {
	t.Helper()
	bin := buildBinaries(t)
	out := &testWriter{t: t}
	dir := t.TempDir()
	require.NoError(t, fleet.BootMedia(ctx, filepath.Join(bin, "kiln-imagebuilder"), filepath.Join(bin, "kiln-agent"), filepath.Join(dir, "media"), out))
	imgDir, m, err := fleet.LabImage(ctx, fleet.ImageOptions{Agent: filepath.Join(bin, "kiln-agent"), TagDate: labTagDate, Progress: out})
	require.NoError(t, err)
	require.True(t, strings.HasSuffix(m.Tag, "-"+labTagDate), "lab image tag %s: want the date %s", m.Tag, labTagDate)
	cfg := fleet.Config{Name: fmt.Sprintf("f%04d", rand.IntN(10000)), Dir: dir, Bin: bin, Subnet: freeSubnet(t),
		Hosts: 3, IPMI: 1, DiskSize: "6G", MediaDir: filepath.Join(dir, "media"), ImageDir: imgDir, Out: out}
	for _, tw := range tweaks {
		tw(&cfg)
	}
	lab, err := fleet.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("controller log (last lines):\n%s", tail(lab.ControllerLog(), 60))
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		if err := lab.Down(ctx); err != nil {
			t.Errorf("lab down: %v", err)
		}
	})
	require.NoError(t, lab.UpRack(ctx))
	require.NoError(t, lab.StartController(ctx))
	res, err := fleet.ImageResource(filepath.Join(imgDir, m.Tag+".image.yaml"), lab.BootURL())
	require.NoError(t, err)
	_, err = lab.Kilnctl(ctx, res, "apply", "-f", "-")
	require.NoError(t, err)
	return lab, m.Tag
}

type testWriter struct{ t *testing.T }

func (w *testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	ls := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(ls[max(0, len(ls)-n):], "\n")
}
