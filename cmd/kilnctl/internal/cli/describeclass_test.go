package cli

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/controllertest"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestDescribeClusterClass applies examples/clusterclass/edge-store.yaml to a real
// controller, moves one cluster to a second revision of the class, and
// checks what `kilnctl get clusterclasses` and `kilnctl describe
// clusterclass` tell a user: the revision, the clusters of the class, the
// revision each follows and whether it is up to date.
func TestDescribeClusterClass(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	env := controllertest.Start(t)
	admin := env.AdminConfigPath
	reader := env.ConfigFor(t, "reader", "alice")
	mustKilnctl(t, admin, "apply", "-f", filepath.Join(examplesDir, "clusterclass/edge-store.yaml"))
	require.Eventually(t, func() bool {
		out := mustKilnctl(t, reader, "get", "clusterclasses")
		return strings.Contains(out, "edge-store") && strings.Fields(strings.Split(out, "\n")[1])[3] == "2"
	}, 20*time.Second, 100*time.Millisecond, "both clusters never became up to date")
	out := mustKilnctl(t, reader, "get", "clusterclasses")
	require.Equal(t, []string{"NAME", "REVISION", "CLUSTERS", "UP-TO-DATE"}, strings.Fields(strings.Split(out, "\n")[0])[:4], "kilnctl get clusterclasses =\n%s", out)
	require.Equal(t, []string{"edge-store", "1", "2", "2"}, strings.Fields(strings.Split(out, "\n")[1])[:4], "kilnctl get clusterclasses =\n%s", out)

	// A new revision: store-0042 is moved to it (as its Rollout would),
	// store-0043 is not.
	class := filepath.Join(t.TempDir(), "class.yaml")
	raw := strings.Replace(readExample(t, "clusterclass/edge-store.yaml"), "bake: 10m", "bake: 20m", 1)
	writeFile(t, class, raw)
	mustKilnctl(t, admin, "apply", "-f", class)
	ctx := context.Background()
	require.Eventually(t, func() bool {
		c := &typesv1.ClusterClass{}
		_, err := env.Store().Get(ctx, "clusterclasses", "edge-store", c)
		return err == nil && c.GetStatus().GetRevision() == 2
	}, 20*time.Second, 50*time.Millisecond)
	require.Eventually(t, func() bool {
		c := &typesv1.Cluster{}
		rev, err := env.Store().Get(ctx, "clusters", "store-0042", c)
		require.NoError(t, err)
		c.Status.Topology.ClassRevision = 2
		_, err = env.Store().Update(ctx, "clusters", "store-0042", c, rev)
		return err == nil
	}, 10*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool {
		out := mustKilnctl(t, reader, "describe", "clusterclass", "edge-store")
		return strings.Contains(out, "Clusters: 2 (1 up to date)")
	}, 20*time.Second, 100*time.Millisecond)

	out = mustKilnctl(t, reader, "describe", "cc", "edge-store")
	for _, want := range []string{
		"Revision:       2 (kept for clusters: 1, 2)",
		"Rollout:        edge-store-r2",
		"Worker classes: general, gpu",
		"  podCidr       cidr     10.244.0.0/16  /12../24",
		"  site          string   (required)",
		"  os            enum     debian12       debian12|ubuntu24",
		"Clusters: 2 (1 up to date)",
		"  CLUSTER     REVISION  VERSION  UP-TO-DATE          WAVE  TOPOLOGY",
		"  store-0042  2         v1.34.4  yes                 1     True AsExpected",
		"  store-0043  1         v1.34.4  no: follows 1 of 2  2     True AsExpected",
		"revision 2 of ClusterClass edge-store recorded; Rollout edge-store-r2 carries it to 2 clusters",
	} {
		require.Contains(t, out, want, "kilnctl describe clusterclass edge-store =\n%s", out)
	}
	t.Logf("kilnctl describe clusterclass edge-store:\n%s", out)
}

func readExample(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(examplesDir, name))
	require.NoError(t, err)
	return string(b)
}

func writeFile(t *testing.T, path, data string) {
	t.Helper()
	require.NoError(t, os.WriteFile(path, []byte(data), 0o600))
}
