package controller_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/promtest"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// observabilityDir holds the alert rules and the Grafana dashboard
// documented in docs/observability.md.
const observabilityDir = "../docs/observability"

// TestMetrics scrapes a controller's --metrics-listen endpoint as
// Prometheus would, after applying hosts, creating a cluster and its
// machines, enrolling an agent, failing one enrollment and downloading an
// image from the boot server, and checks what an operator would read off
// it; then lints the exposition with promtool and checks that the alert
// rules and the dashboard only name metrics the controller serves.
func TestMetrics(t *testing.T) {
	ctx := context.Background()
	b := startBoot(t, controllertest.WithConfig(func(c *controller.Config) { c.MetricsListenAddr = "127.0.0.1:0" }))
	require.NotEmpty(t, b.Controller.MetricsAddr(), "metrics server not started")
	url := "http://" + b.Controller.MetricsAddr() + "/metrics"

	st := b.Store()
	_, err := st.Create(ctx, "clusters", "prod", &typesv1.Cluster{
		ApiVersion: "kiln.dev/v1", Kind: "Cluster",
		Metadata: &typesv1.ObjectMeta{Name: "prod"},
		Spec:     &typesv1.ClusterSpec{KubernetesVersion: "v1.34.4"},
		Status:   &typesv1.ClusterStatus{Phase: "Provisioning"},
	})
	require.NoError(t, err)
	for i, m := range []struct{ image, version, phase string }{
		{"debian12-k8s1.34.4-20261202", "v1.34.4", "Running"},
		{"debian12-k8s1.34.4-20261202", "v1.34.4", "Running"},
		{"debian12-k8s1.33.7-20261101", "v1.33.7", "Provisioning"},
	} {
		name := "prod-" + string(rune('a'+i))
		_, err := st.Create(ctx, "machines", name, &typesv1.Machine{
			ApiVersion: "kiln.dev/v1", Kind: "Machine",
			Metadata: &typesv1.ObjectMeta{Name: name},
			Spec:     &typesv1.MachineSpec{Cluster: "prod", Image: m.image, Version: m.version},
			Status:   &typesv1.MachineStatus{Phase: m.phase},
		})
		require.NoError(t, err)
	}

	_, err = st.Create(ctx, "controlplanes", "prod-cp", &typesv1.ControlPlane{
		ApiVersion: "kiln.dev/v1", Kind: "ControlPlane",
		Metadata: &typesv1.ObjectMeta{Name: "prod-cp"},
		Spec:     &typesv1.ControlPlaneSpec{Cluster: "prod", Replicas: 3, Version: "v1.34.4"},
		Status: &typesv1.ControlPlaneStatus{Conditions: []*typesv1.Condition{
			conditions.New("UpToDate", conditions.False, "NoSpareHost", "no Available host for the surge"),
		}},
	})
	require.NoError(t, err)
	// rack1-02's BMC stopped answering: its circuit breaker opened.
	h := &typesv1.Host{}
	rev, err := st.Get(ctx, "hosts", "rack1-02", h)
	require.NoError(t, err)
	if h.Status == nil {
		h.Status = &typesv1.HostStatus{}
	}
	h.Status.Conditions, _ = conditions.Set(h.Status.Conditions,
		conditions.New("BMCReachable", conditions.False, "CircuitOpen", "circuit open for bmc rack1-02"), time.Now())
	_, err = st.Update(ctx, "hosts", "rack1-02", h, rev)
	require.NoError(t, err)

	a, err := enroll(ctx, t, b.Env, b.Token(t, "agent-01", time.Minute), "agent-01")
	require.NoError(t, err)
	cert := parseCert(t, a.certPEM)
	_, err = enroll(ctx, t, b.Env, "abcdef.0123456789abcdef", "agent-02")
	require.Error(t, err, "enroll with an unknown token")

	resp, body := b.get(t, "/images/"+b.imageN, nil)
	require.Equal(t, 200, resp.StatusCode)
	require.Len(t, body, len(b.image))

	require.Eventually(t, b.Controller.IsLeader, 30*time.Second, 50*time.Millisecond, "replica never led")
	s := promtest.Get(t, url)

	for _, tc := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"kiln_fleet_scrape_success", nil, 1},
		{"kiln_leader", nil, 1},
		// rack1-01 and rack1-02 applied (not planned yet: no lifecycle
		// runs here), agent-01 enrolled.
		{"kiln_hosts", []string{"state", "Unknown"}, 2},
		{"kiln_hosts", []string{"state", "Registering"}, 1},
		{"kiln_hosts", []string{"state", "Provisioned"}, 0},
		{"kiln_hosts", []string{"state", "Error"}, 0},
		{"kiln_hosts_by_power", []string{"power", "unknown"}, 3},
		{"kiln_host_state", []string{"host", "agent-01", "state", "Registering"}, 1},
		{"kiln_host_state", []string{"host", "rack1-01", "state", "Unknown"}, 1},
		{"kiln_host_bmc_reachable", []string{"host", "rack1-02", "reason", "CircuitOpen"}, 0},
		{"kiln_bmc_circuits_open", nil, 1},
		{"kiln_rollout_condition", []string{"kind", "ControlPlane", "name", "prod-cp", "condition", "UpToDate", "status", "False", "reason", "NoSpareHost"}, 1},
		{"kiln_host_agent_certificate_expiry_timestamp_seconds", []string{"host", "agent-01"}, float64(cert.NotAfter.Unix())},
		{"kiln_machines", []string{"phase", "Running"}, 2},
		{"kiln_machines", []string{"phase", "Provisioning"}, 1},
		{"kiln_machines_by_image", []string{"image", "debian12-k8s1.34.4-20261202", "kubernetes_version", "v1.34.4"}, 2},
		{"kiln_machines_by_image", []string{"image", "debian12-k8s1.33.7-20261101", "kubernetes_version", "v1.33.7"}, 1},
		{"kiln_clusters", []string{"phase", "Provisioning", "kubernetes_version", "v1.34.4"}, 1},
		{"kiln_enrollments_total", []string{"outcome", "success"}, 1},
		{"kiln_enrollments_total", []string{"outcome", "permission_denied"}, 1},
		{"kiln_boot_served_bytes_total", []string{"kind", "image"}, float64(len(b.image))},
		{"kiln_boot_active_transfers", []string{"kind", "image"}, 0},
		{"kiln_etcd_db_quota_bytes", nil, store.DefaultQuotaBytes},
	} {
		got, ok := s.Value(tc.name, tc.labels...)
		if !ok || got != tc.want {
			t.Errorf("%s%v = %v (found %t), want %v", tc.name, tc.labels, got, ok, tc.want)
		}
	}
	if size, ok := s.Value("kiln_etcd_db_size_bytes"); !ok || size <= 0 {
		t.Errorf("kiln_etcd_db_size_bytes = %v (found %t), want > 0", size, ok)
	}
	if n := s.Sum("kiln_etcd_request_duration_seconds", "method", "Range"); n == 0 {
		t.Errorf("kiln_etcd_request_duration_seconds{method=Range} counted no request")
	}
	for _, name := range []string{"go_goroutines", "process_resident_memory_bytes", "kiln_reconcile_queue_depth"} {
		if _, ok := s.Families[name]; !ok {
			t.Errorf("scrape has no %s", name)
		}
	}

	t.Run("promtool check metrics", func(t *testing.T) {
		out := promtest.CheckMetrics(t, s.Text)
		t.Logf("promtool check metrics: ok %s", strings.TrimSpace(out))
	})

	// Histograms without an observation yet have no series in the text
	// format: the rules and the dashboard may name them, and their names
	// come from the registry's descriptions.
	known := s.Known("kiln_operation_duration_seconds", "kiln_bmc_request_duration_seconds", "kiln_reconcile_duration_seconds")

	t.Run("alert rules", func(t *testing.T) {
		rules := filepath.Join(observabilityDir, "kiln-alerts.yaml")
		text, err := os.ReadFile(rules)
		require.NoError(t, err)
		if missing := promtest.Unknown(string(text), known); len(missing) > 0 {
			t.Errorf("%s names metrics the controller does not serve: %v", rules, missing)
		}
		out := promtest.CheckRules(t, rules)
		t.Logf("promtool check rules: %s", strings.TrimSpace(out))
	})

	t.Run("dashboard", func(t *testing.T) {
		path := filepath.Join(observabilityDir, "kiln-fleet-dashboard.json")
		text, err := os.ReadFile(path)
		require.NoError(t, err)
		var dash struct {
			Title  string `json:"title"`
			Panels []struct {
				Title   string `json:"title"`
				Targets []struct {
					Expr string `json:"expr"`
				} `json:"targets"`
			} `json:"panels"`
		}
		require.NoError(t, json.Unmarshal(text, &dash), "dashboard JSON")
		require.NotEmpty(t, dash.Panels, "dashboard has no panels")
		for _, p := range dash.Panels {
			for _, tg := range p.Targets {
				if missing := promtest.Unknown(tg.Expr, known); len(missing) > 0 {
					t.Errorf("dashboard panel %q: query %q names metrics the controller does not serve: %v", p.Title, tg.Expr, missing)
				}
			}
		}
	})
}
