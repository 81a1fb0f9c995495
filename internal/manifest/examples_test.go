package manifest_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/manifest"
)

// TestFleetExample: every file of examples/fleet decodes against the
// proto (no unknown or misspelled field) and validates, in the layout the
// README describes, and examples/gitops/gitsource.yaml is a valid GitSource.
func TestFleetExample(t *testing.T) {
	files, err := manifest.FilesRecursive("../../examples/fleet")
	require.NoError(t, err)
	kinds := map[string]int{}
	for _, f := range files {
		data, err := os.ReadFile(f)
		require.NoError(t, err)
		docs, err := manifest.Decode(f, data)
		require.NoError(t, err, "decode %s", f)
		for _, d := range docs {
			k, _ := d.KindName()
			kinds[filepath.Base(filepath.Dir(f))+"/"+k]++
		}
	}
	require.Equal(t, map[string]int{"clusterclasses/ClusterClass": 2, "prod/Cluster": 2, "edge/Cluster": 3, "rollouts/Rollout": 1}, kinds)
	// And every file passes the controller's own validation: what the
	// example shows applies.
	_, err = validation.LoadManifestsRecursive(nil, "../../examples/fleet")
	require.NoError(t, err)
	docs, err := validation.LoadManifests(nil, "../../examples/gitops/gitsource.yaml")
	require.NoError(t, err)
	require.Len(t, docs, 1)
}

// TestFleetLabExample: examples/fleet-lab, the lab-sized fleet that
// TestLabRolloutWaves (e2e/fleet) applies, decodes and validates like
// examples/fleet, and so does its class with the revision-2 line
// uncommented, the change that test rolls.
func TestFleetLabExample(t *testing.T) {
	const dir = "../../examples/fleet-lab"
	files, err := manifest.FilesRecursive(dir)
	require.NoError(t, err)
	kinds := map[string]int{}
	for _, f := range files {
		data, err := os.ReadFile(f)
		require.NoError(t, err)
		docs, err := manifest.Decode(f, data)
		require.NoError(t, err, "decode %s", f)
		for _, d := range docs {
			k, _ := d.KindName()
			kinds[filepath.Base(filepath.Dir(f))+"/"+k]++
		}
	}
	require.Equal(t, map[string]int{"clusterclasses/ClusterClass": 1, "clusters/Cluster": 3}, kinds)
	_, err = validation.LoadManifestsRecursive(nil, dir)
	require.NoError(t, err)

	// Revision 2, as the lab test makes it.
	class := filepath.Join(dir, "clusterclasses", "lab-store.yaml")
	b, err := os.ReadFile(class)
	require.NoError(t, err)
	require.Equal(t, 1, strings.Count(string(b), `# patch: "2"`), "%s: the revision-2 line", class)
	r2 := filepath.Join(t.TempDir(), "lab-store.yaml")
	require.NoError(t, os.WriteFile(r2, []byte(strings.Replace(string(b), `# patch: "2"`, `patch: "2"`, 1)), 0o644))
	docs, err := validation.LoadManifests(nil, r2)
	require.NoError(t, err)
	require.Len(t, docs, 1)
	require.Equal(t, map[string]string{"os": "debian12", "kubernetes": "v1.34.4", "patch": "2"},
		docs[0].Resource.GetClusterClass().GetSpec().GetControlPlane().GetImageSelector())
}
