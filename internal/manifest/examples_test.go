package manifest_test

import (
	"os"
	"path/filepath"
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
