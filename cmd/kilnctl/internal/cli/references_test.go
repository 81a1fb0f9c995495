package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/controllertest"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestDanglingRefs(t *testing.T) {
	meta := func(name string, labels map[string]string) *typesv1.ObjectMeta {
		return &typesv1.ObjectMeta{Name: name, Labels: labels}
	}
	image := &controllerv1.Resource{Kind: &controllerv1.Resource_Image{Image: &typesv1.Image{Metadata: meta("img-20261203", nil)}}}
	cluster := &controllerv1.Resource{Kind: &controllerv1.Resource_Cluster{Cluster: &typesv1.Cluster{Metadata: meta("lab", nil)}}}
	host := &controllerv1.Resource{Kind: &controllerv1.Resource_Host{Host: &typesv1.Host{Metadata: meta("h1", map[string]string{"lab": "true"})}}}
	cp := func(cluster, image string, sel map[string]string) *controllerv1.Resource {
		return &controllerv1.Resource{Kind: &controllerv1.Resource_ControlPlane{ControlPlane: &typesv1.ControlPlane{
			Metadata: meta("lab-cp", nil), Spec: &typesv1.ControlPlaneSpec{Cluster: cluster, Image: image, HostSelector: sel}}}}
	}
	md := &controllerv1.Resource{Kind: &controllerv1.Resource_MachineDeployment{MachineDeployment: &typesv1.MachineDeployment{
		Metadata: meta("lab-workers", nil), Spec: &typesv1.MachineDeploymentSpec{Cluster: "lab"}}}}
	machine := &controllerv1.Resource{Kind: &controllerv1.Resource_Machine{Machine: &typesv1.Machine{
		Metadata: meta("m1", nil), Spec: &typesv1.MachineSpec{Cluster: "lab", Host: "h9", Image: "img-20261203"}}}}
	hc := &controllerv1.Resource{Kind: &controllerv1.Resource_HealthCheck{HealthCheck: &typesv1.HealthCheck{
		Metadata: meta("lab-nodes", nil), Spec: &typesv1.HealthCheckSpec{Cluster: "prod"}}}}

	tests := []struct {
		name    string
		stored  []*controllerv1.Resource
		applied []*controllerv1.Resource
		want    []string
	}{
		{"everything named exists", []*controllerv1.Resource{image, cluster, host},
			[]*controllerv1.Resource{cp("lab", "img-20261203", map[string]string{"lab": "true"})}, nil},
		{"satisfied by the same apply", nil,
			[]*controllerv1.Resource{cp("lab", "img-20261203", map[string]string{"lab": "true"}), image, cluster, host}, nil},
		{"missing image, cluster and hosts", []*controllerv1.Resource{image, host},
			[]*controllerv1.Resource{cp("prod", "img-20261202", map[string]string{"rack": "r9", "lab": "true"})},
			[]string{
				"controlplane/lab-cp: spec.cluster prod does not exist (kilnctl get clusters lists 0)",
				"controlplane/lab-cp: spec.image img-20261202 does not exist (kilnctl get images lists 1: img-20261203)",
				"controlplane/lab-cp: spec.hostSelector lab=true,rack=r9 matches no host (kilnctl get hosts -l lab=true,rack=r9 lists none of 1)",
			}},
		{"no hosts at all", []*controllerv1.Resource{cluster}, []*controllerv1.Resource{md},
			[]string{"machinedeployment/lab-workers: no host exists to place it on (kilnctl get hosts lists 0)"}},
		{"machine's host", []*controllerv1.Resource{image, cluster, host}, []*controllerv1.Resource{machine},
			[]string{"machine/m1: spec.host h9 does not exist (kilnctl get hosts lists 1)"}},
		{"health check's cluster", []*controllerv1.Resource{cluster}, []*controllerv1.Resource{hc},
			[]string{"healthcheck/lab-nodes: spec.cluster prod does not exist (kilnctl get clusters lists 1: lab)"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFleet()
			for _, r := range append(append([]*controllerv1.Resource(nil), tt.stored...), tt.applied...) {
				f.add(r)
			}
			got := danglingRefs(tt.applied, f)
			if strings.Join(got, "\n") != strings.Join(tt.want, "\n") {
				t.Errorf("danglingRefs() =\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(tt.want, "\n"))
			}
		})
	}
	if got := refKinds([]*controllerv1.Resource{host, image}); len(got) != 0 {
		t.Errorf("refKinds(host, image) = %v, want none (nothing to check, nothing listed)", got)
	}
}

// kilnctl apply warns, on standard error, about references to things
// that do not exist, and applies anyway; once they exist it is quiet.
func TestApplyWarnsAboutDanglingReferences(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	env := controllertest.Start(t)
	kenv := map[string]string{"KILNCONFIG": env.AdminConfigPath, "HOME": t.TempDir()}
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(content), 0o644))
		return p
	}
	const cp = `apiVersion: kiln.dev/v1
kind: ControlPlane
metadata:
  name: edge-cp
spec:
  cluster: edge
  replicas: 1
  version: v1.34.4
  image: debian12-k8s1.34.4-20261202
  hostSelector:
    site: edge
---
apiVersion: kiln.dev/v1
kind: HealthCheck
metadata:
  name: edge-nodes
spec:
  cluster: edge
`
	out, errOut, err := run(t, kenv, "apply", "-f", write("cp.yaml", cp))
	require.NoError(t, err, "kilnctl apply with dangling references must still apply")
	if out != "controlplane/edge-cp created\nhealthcheck/edge-nodes created\n" {
		t.Errorf("kilnctl apply stdout = %q, want both created", out)
	}
	for _, want := range []string{
		"Warning: controlplane/edge-cp: spec.cluster edge does not exist (kilnctl get clusters lists 0)\n",
		"Warning: controlplane/edge-cp: spec.image debian12-k8s1.34.4-20261202 does not exist (kilnctl get images lists 0)\n",
		"Warning: controlplane/edge-cp: spec.hostSelector site=edge matches no host (kilnctl get hosts lists 0)\n",
		"Warning: healthcheck/edge-nodes: spec.cluster edge does not exist (kilnctl get clusters lists 0)\n",
	} {
		if !strings.Contains(errOut, want) {
			t.Errorf("kilnctl apply stderr =\n%s\nwant it to contain %q", errOut, want)
		}
	}
	if _, err := kilnctl(t, env.AdminConfigPath, "get", "cp", "edge-cp"); err != nil {
		t.Errorf("kilnctl get cp edge-cp after a warned apply = %v, want it stored", err)
	}

	// The things named, applied together with what names them: no warning.
	image, err := os.ReadFile(filepath.Join(examplesDir, "image.yaml"))
	require.NoError(t, err)
	all := cp + "---\n" + string(image) + `---
apiVersion: kiln.dev/v1
kind: Cluster
metadata:
  name: edge
spec:
  kubernetesVersion: v1.34.4
  podCidr: 10.244.0.0/16
---
apiVersion: kiln.dev/v1
kind: Host
metadata:
  name: edge-h1
  labels:
    site: edge
spec:
  bmc:
    protocol: none
`
	out, errOut, err = run(t, kenv, "apply", "-f", write("all.yaml", all))
	require.NoError(t, err)
	if errOut != "" {
		t.Errorf("kilnctl apply (references satisfied) stderr = %q, want nothing\nstdout:\n%s", errOut, out)
	}

	// Another host selector, matching none of the hosts now stored.
	out, errOut, err = run(t, kenv, "apply", "--dry-run", "-f", write("cp2.yaml", strings.Replace(cp, "site: edge", "site: core", 1)))
	require.NoError(t, err)
	want := "Warning: controlplane/edge-cp: spec.hostSelector site=core matches no host (kilnctl get hosts -l site=core lists none of 1)\n"
	if errOut != want {
		t.Errorf("kilnctl apply --dry-run (selector matching nothing) stderr = %q, want %q\nstdout:\n%s", errOut, want, out)
	}
}
