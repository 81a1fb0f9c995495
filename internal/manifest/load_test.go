package manifest_test

// The tests of reading and validating files together. They live in the
// external test package because controller/validation imports manifest
// (manifest is a leaf and must not import it).

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/manifest"
)

func init() {
	// FuzzDecode checks where validation places its problems.
	manifest.SetCheckDocument(validation.CheckDocument)
}

func TestLoadValidationLines(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "lab.yaml")
	in := strings.Replace(manifest.GoodCluster, "10.244.0.0/16", "10.244.1.0/16", 1) + "---\napiVersion: kiln.dev/v1\nkind: ControlPlane\nmetadata:\n  name: cp\nspec:\n  cluster: lab\n  replicas: 2\n"
	require.NoError(t, os.WriteFile(p, []byte(in), 0o644))
	_, err := validation.LoadManifests(nil, p)
	require.Error(t, err)
	want := p + `:9: spec.podCidr: "10.244.1.0/16" has host bits set: use 10.244.0.0/16` + "\n" +
		p + ":18: spec.replicas: 2 is even: an even number of control-plane members cannot keep etcd quorum better than one less: use 1, 3 or 5"
	if err.Error() != want {
		t.Errorf("validation.LoadManifests(%q) = %q, want %q", p, err, want)
	}
}

func TestLoadDirectoryAllOrNothing(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "a.yaml"), []byte(manifest.GoodCluster), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "notes.txt"), []byte("not yaml: ["), 0o644))
	docs, err := validation.LoadManifests(nil, dir)
	require.NoError(t, err)
	require.Len(t, docs, 1)

	// One bad file among good ones: nothing comes back.
	require.NoError(t, os.WriteFile(filepath.Join(dir, "b.yml"), []byte(strings.Replace(manifest.GoodCluster, "name: lab", "name: Lab", 1)), 0o644))
	docs, err = validation.LoadManifests(nil, dir)
	if err == nil || docs != nil {
		t.Fatalf("validation.LoadManifests(dir with a bad file) = %d docs, %v, want no docs and an error", len(docs), err)
	}
	if want := filepath.Join(dir, "b.yml") + `:4: metadata.name: "Lab" is not a DNS-1123 name`; !strings.Contains(err.Error(), want) {
		t.Errorf("validation.LoadManifests(dir) = %q, want it to contain %q", err, want)
	}

	// The same resource twice.
	require.NoError(t, os.WriteFile(filepath.Join(dir, "b.yml"), []byte(manifest.GoodCluster), 0o644))
	_, err = validation.LoadManifests(nil, dir)
	if want := filepath.Join(dir, "b.yml") + ":1: Cluster/lab is also defined at " + filepath.Join(dir, "a.yaml") + ":1"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("validation.LoadManifests(dir with a duplicate) = %v, want %q", err, want)
	}

	// Standard input.
	docs, err = validation.LoadManifests(strings.NewReader(manifest.GoodCluster), "-")
	require.NoError(t, err)
	if len(docs) != 1 || docs[0].File != "-" {
		t.Errorf("validation.LoadManifests(stdin) = %v, want one document from -", docs)
	}

	if _, err := validation.LoadManifests(nil, t.TempDir()); err == nil || !strings.Contains(err.Error(), "holds no *.yaml or *.yml files") {
		t.Errorf("validation.LoadManifests(empty dir) = %v, want an error naming the empty directory", err)
	}
}

// TestExamples parses and validates every file in examples/: what we show
// users must apply.
func TestExamples(t *testing.T) {
	docs, err := validation.LoadManifests(nil, "../../examples")
	require.NoError(t, err)
	kinds := map[string]int{}
	for _, d := range docs {
		kind, _ := d.KindName()
		kinds[kind]++
	}
	want := map[string]int{"Host": 3, "Image": 1, "Cluster": 2, "ControlPlane": 2, "MachineDeployment": 2, "HealthCheck": 1}
	for k, n := range want {
		if kinds[k] != n {
			t.Errorf("validation.LoadManifests(examples) has %d %s, want %d", kinds[k], k, n)
		}
	}
	for _, f := range []string{"host-redfish.yaml", "host-ipmi.yaml", "host-byoh.yaml", "image.yaml", "cluster.yaml", "lab-cluster.yaml"} {
		if _, err := os.Stat(filepath.Join("../../examples", f)); err != nil {
			t.Errorf("examples/%s: %v", f, err)
		}
	}
	// The VM lab's cluster (make lab BACKEND=libvirt) has a directory of
	// its own: its Cluster is named lab too.
	docs, err = validation.LoadManifests(nil, "../../examples/lab-vm")
	require.NoError(t, err)
	require.Len(t, docs, 2, "examples/lab-vm: a Cluster and its ControlPlane")
}

// BenchmarkDecode1000Hosts measures parsing and checking a 1000-host file
// (what `kilnctl apply -f fleet.yaml` does before sending anything).
func BenchmarkDecode1000Hosts(b *testing.B) {
	data := manifest.HostsYAML(1000)
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		docs, err := manifest.Decode("fleet.yaml", data)
		if err != nil || len(docs) != 1000 {
			b.Fatalf("Decode() = %d docs, %v", len(docs), err)
		}
		for _, d := range docs {
			if err := validation.Validate(d.Resource); err != nil {
				b.Fatal(err)
			}
		}
	}
}
