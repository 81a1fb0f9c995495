package fleet

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/imagebuilder/spec"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// TestPreviousLabSpec: examples/images/lab-previous.yaml is lab.yaml at the
// previous minor, and validates against that release.
func TestPreviousLabSpec(t *testing.T) {
	prev, err := spec.Load(PreviousLabSpec())
	require.NoError(t, err)
	require.NoError(t, prev.Validate(kubetools.Previous().Kubernetes), "examples/images/lab-previous.yaml")
	if prev.KubernetesVersion != kubetools.Previous().Kubernetes {
		t.Errorf("lab-previous.yaml kubernetesVersion = %s, want %s", prev.KubernetesVersion, kubetools.Previous().Kubernetes)
	}
	if p, c := specSettings(t, PreviousLabSpec()), specSettings(t, DefaultLabSpec()); p != c {
		t.Errorf("lab-previous.yaml differs from lab.yaml in more than kubernetesVersion:\n%s\n--- lab.yaml:\n%s", p, c)
	}
}

// TestLabImagePicksSpecRelease: LabImage looks for the kube-tools release
// of the spec's kubernetesVersion and says how to build it when missing;
// a version without a recipe is refused.
func TestLabImagePicksSpecRelease(t *testing.T) {
	ctx := context.Background()
	agent := filepath.Join(t.TempDir(), "kiln-agent")
	require.NoError(t, os.WriteFile(agent, []byte("#!/bin/sh\n"), 0o755))
	_, _, err := LabImage(ctx, ImageOptions{Spec: PreviousLabSpec(), Agent: agent, CacheDir: t.TempDir(), KubeTools: kubetools.Cache{Dir: t.TempDir()}})
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "kube-tools v1.33.13") ||
		!strings.Contains(err.Error(), "make kube-tools KUBE_RELEASE=v1.33.13") {
		t.Errorf("LabImage(lab-previous.yaml, no kube-tools) = %v, want FailedPrecondition naming v1.33.13 and `make kube-tools KUBE_RELEASE=v1.33.13`", err)
	}

	b, err := os.ReadFile(DefaultLabSpec())
	require.NoError(t, err)
	old := filepath.Join(t.TempDir(), "old.yaml")
	require.NoError(t, os.WriteFile(old, []byte(strings.Replace(string(b), "kubernetesVersion: v1.34.4", "kubernetesVersion: v1.32.0", 1)), 0o644))
	_, _, err = LabImage(ctx, ImageOptions{Spec: old, Agent: agent, CacheDir: t.TempDir(), KubeTools: kubetools.Cache{Dir: t.TempDir()}})
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "no recipe") || !strings.Contains(err.Error(), "v1.32.0") {
		t.Errorf("LabImage(kubernetesVersion v1.32.0) = %v, want InvalidArgument: no recipe", err)
	}
}

// specSettings is a spec file without comments and its kubernetesVersion.
func specSettings(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(name)
	require.NoError(t, err)
	var keep []string
	for _, line := range strings.Split(string(b), "\n") {
		if l := strings.TrimSpace(line); l == "" || strings.HasPrefix(l, "#") || strings.HasPrefix(l, "kubernetesVersion:") {
			continue
		}
		keep = append(keep, line)
	}
	return strings.Join(keep, "\n")
}

func TestClusterDocsAt(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(filepath.Dir(DefaultLabSpec()), "..", "lab-cluster.yaml"))
	require.NoError(t, err)
	docs, err := ParseClusterDocs(b)
	require.NoError(t, err)
	require.Equal(t, "lab", docs.Name())
	cp, w := docs.Replicas()
	require.Equal(t, [2]int{1, 2}, [2]int{cp, w}, "lab-cluster.yaml replicas")

	docs.At("v1.33.13", "debian12-k8s1.33.13-20251202")
	all, err := docs.YAML()
	require.NoError(t, err)
	for _, want := range []string{"kubernetesVersion: v1.33.13", "version: v1.33.13", "image: debian12-k8s1.33.13-20251202", "rolloutMaxSurge: 1"} {
		if !strings.Contains(string(all), want) {
			t.Errorf("At(v1.33.13) lacks %q:\n%s", want, all)
		}
	}
	if strings.Contains(string(all), "v1.34.4") {
		t.Errorf("At(v1.33.13) left v1.34.4:\n%s", all)
	}
	cpOnly, err := docs.YAML("ControlPlane")
	require.NoError(t, err)
	if !strings.Contains(string(cpOnly), "kind: ControlPlane") || strings.Contains(string(cpOnly), "MachineDeployment") || strings.Contains(string(cpOnly), "kind: Cluster") {
		t.Errorf("YAML(ControlPlane) =\n%s", cpOnly)
	}
	// What it renders parses back to the same documents.
	again, err := ParseClusterDocs(all)
	require.NoError(t, err)
	again2, err := again.YAML()
	require.NoError(t, err)
	require.Equal(t, string(all), string(again2))

	if docs.ControlPlaneEndpoint() != "" {
		t.Errorf("lab-cluster.yaml has controlPlaneEndpoint %q; the upgrade expects to provide one", docs.ControlPlaneEndpoint())
	}
	docs.SetControlPlaneEndpoint("10.251.250.1:6443")
	cl, err := docs.YAML("Cluster")
	require.NoError(t, err)
	if !strings.Contains(string(cl), "controlPlaneEndpoint: 10.251.250.1:6443") || docs.ControlPlaneEndpoint() != "10.251.250.1:6443" {
		t.Errorf("SetControlPlaneEndpoint: Cluster =\n%s", cl)
	}

	if _, err := ParseClusterDocs([]byte("kind: ControlPlane\n")); !errdefs.IsInvalidArgument(err) {
		t.Errorf("ParseClusterDocs(no Cluster) = %v, want InvalidArgument", err)
	}
}
