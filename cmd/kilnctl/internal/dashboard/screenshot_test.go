package dashboard_test

import (
	"context"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// screenshotVar names the directory TestScreenshots writes to; the test
// is opt-in: `KILN_DASHBOARD_SCREENSHOTS=$PWD/docs/dashboard go test
// ./cmd/kilnctl/internal/dashboard -run TestScreenshots`.
const screenshotVar = "KILN_DASHBOARD_SCREENSHOTS"

func screenshot(t *testing.T, ctx context.Context, path string) {
	t.Helper()
	png, err := chromedp.Run(ctx, chromedp.CaptureScreenshot())
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(path, png, 0o644))
	t.Logf("wrote %s (%d bytes)", path, len(png))
}

// TestScreenshots takes the screenshots in docs/dashboard: the overview
// of the 1,000-host, 100-cluster fleet the benchmark uses, and the cluster
// and host pages of a controller running --simulate (the real host
// lifecycle and cluster executor on simulated BMCs and agents), the host
// caught while its image is being laid.
func TestScreenshots(t *testing.T) {
	dir := os.Getenv(screenshotVar)
	if dir == "" {
		t.Skip("set " + screenshotVar + "=DIR to write the dashboard's screenshots to DIR")
	}
	requireChromium(t)
	require.NoError(t, os.MkdirAll(dir, 0o755))

	big := startFleet(t, fixture{hosts: 1000, clusters: 100})
	base, loginURL := startDashboard(t, big.ConfigFor(t, "reader", "alice"))
	ctx := newBrowser(t)
	login(t, ctx, loginURL, base)
	waitJS(t, ctx, `document.querySelector('[data-total="hosts"]')?.textContent === '1000'`, 60*time.Second)
	screenshot(t, ctx, filepath.Join(dir, "overview.png"))

	env := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) {
		c.Simulate = 12
		c.HeartbeatInterval = 2 * time.Second
		c.ReconcileInterval = 500 * time.Millisecond
	}))
	st := env.Store()
	now := timestamppb.Now()
	meta := func(name string, labels map[string]string) *typesv1.ObjectMeta {
		return &typesv1.ObjectMeta{Name: name, Generation: 1, CreationTimestamp: now, Labels: labels}
	}
	for _, r := range []struct {
		kind, name string
		m          proto.Message
	}{
		{"clusters", "sim", &typesv1.Cluster{Metadata: meta("sim", map[string]string{"env": "lab", "upgrade-wave": "1"}), Spec: &typesv1.ClusterSpec{
			KubernetesVersion: "v1.34.4", PodCidr: "10.244.0.0/16", ServiceCidr: "10.96.0.0/12", ControlPlaneEndpoint: "10.0.0.10:6443"}}},
		{"controlplanes", "sim-cp", &typesv1.ControlPlane{Metadata: meta("sim-cp", nil), Spec: &typesv1.ControlPlaneSpec{
			Cluster: "sim", Replicas: 1, Version: "v1.34.4", Image: sim.ImageName}}},
		{"machinedeployments", "sim", &typesv1.MachineDeployment{Metadata: meta("sim", nil), Spec: &typesv1.MachineDeploymentSpec{
			Cluster: "sim", Replicas: 8, Version: "v1.34.4", Image: sim.ImageName}}},
		{"healthchecks", "sim-nodes", &typesv1.HealthCheck{Metadata: meta("sim-nodes", nil), Spec: &typesv1.HealthCheckSpec{
			Cluster: "sim", MaxUnhealthy: "40%", UnhealthyConditions: []*typesv1.UnhealthyCondition{{Type: "NodeReady", Status: "False", Timeout: "5m"}}}}},
	} {
		_, err := st.Create(context.Background(), r.kind, r.name, r.m)
		require.NoError(t, err, "create %s/%s", r.kind, r.name)
	}
	base, loginURL = startDashboard(t, env.ConfigFor(t, "reader", "alice"))
	ctx = newBrowser(t)
	login(t, ctx, loginURL, base)

	// A host while its image is laid, once its progress (bytes, rate,
	// ETA) is stored.
	var laying string
	require.Eventually(t, func() bool {
		items, _, err := st.List(context.Background(), "hosts", func() proto.Message { return &typesv1.Host{} }, store.ListOptions{})
		require.NoError(t, err)
		for _, it := range items {
			op := it.Msg.(*typesv1.Host).GetStatus().GetLastOperation()
			if op.GetKind() == "LayImage" && op.GetState() == "Running" && op.GetProgress().GetDoneBytes() > 0 {
				laying = it.Name
				return true
			}
		}
		return false
	}, 2*time.Minute, 100*time.Millisecond, "no host laying its image with progress stored")
	require.Equal(t, int64(http.StatusOK), open(t, ctx, base+"/hosts/"+laying))
	screenshot(t, ctx, filepath.Join(dir, "host.png"))

	// The cluster once its machines are up.
	require.Eventually(t, func() bool {
		c := &typesv1.Cluster{}
		_, err := st.Get(context.Background(), "clusters", "sim", c)
		return err == nil && c.GetStatus().GetPhase() == "Ready"
	}, 4*time.Minute, 250*time.Millisecond, "cluster sim not Ready")
	require.Equal(t, int64(http.StatusOK), open(t, ctx, base+"/clusters/sim"))
	screenshot(t, ctx, filepath.Join(dir, "cluster.png"))
}

// labConfigVar names a kilnconfig of a running lab (`make lab` prints its
// path) for TestLabScreenshots.
const labConfigVar = "KILN_DASHBOARD_LAB_KILNCONFIG"

// TestLabScreenshots takes the overview, the cluster page and a host page
// of a running lab into KILN_DASHBOARD_SCREENSHOTS as lab-*.png: opt-in,
// `make lab` first, then `KILN_DASHBOARD_LAB_KILNCONFIG=...
// KILN_DASHBOARD_SCREENSHOTS=$PWD/docs/dashboard go test
// ./cmd/kilnctl/internal/dashboard -run TestLabScreenshots`.
func TestLabScreenshots(t *testing.T) {
	dir, kilnconfig := os.Getenv(screenshotVar), os.Getenv(labConfigVar)
	if dir == "" || kilnconfig == "" {
		t.Skip("set " + screenshotVar + "=DIR and " + labConfigVar + "=KILNCONFIG (of a running lab) to write the lab's dashboard screenshots to DIR")
	}
	requireChromium(t)
	require.NoError(t, os.MkdirAll(dir, 0o755))
	hosts := columns(kilnctl(t, kilnconfig, "get", "hosts"))
	clusters := columns(kilnctl(t, kilnconfig, "get", "clusters"))
	require.NotEmpty(t, hosts, "the lab has no hosts")
	require.NotEmpty(t, clusters, "the lab has no clusters")

	base, loginURL := startDashboard(t, kilnconfig)
	ctx := newBrowser(t)
	login(t, ctx, loginURL, base)
	waitJS(t, ctx, `document.querySelector('[data-total="hosts"]')?.textContent === '`+strconv.Itoa(len(hosts))+`'`, 60*time.Second)
	screenshot(t, ctx, filepath.Join(dir, "lab-overview.png"))
	require.Equal(t, int64(http.StatusOK), open(t, ctx, base+"/clusters/"+clusters[0]["NAME"]))
	screenshot(t, ctx, filepath.Join(dir, "lab-cluster.png"))
	host := hosts[0]["NAME"]
	for _, h := range hosts {
		if h["MACHINE"] != "" && h["MACHINE"] != "-" {
			host = h["NAME"]
			break
		}
	}
	require.Equal(t, int64(http.StatusOK), open(t, ctx, base+"/hosts/"+host))
	screenshot(t, ctx, filepath.Join(dir, "lab-host.png"))
}
