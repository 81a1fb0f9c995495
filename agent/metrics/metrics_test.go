package metrics_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/dns/dnsmessage"

	"github.com/kilnhq/kiln/agent/agenttest"
	"github.com/kilnhq/kiln/agent/journal"
	"github.com/kilnhq/kiln/agent/lay"
	"github.com/kilnhq/kiln/agent/metrics"
	"github.com/kilnhq/kiln/agent/probe"
	"github.com/kilnhq/kiln/internal/pki"
	"github.com/kilnhq/kiln/internal/promtest"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// TestAgentMetrics runs two operations through a journal reporting to
// the agent's metrics, lays a real image (agent/lay from a loopback HTTP
// server into a file) and runs a real health probe (a kubelet healthz and
// a DNS server on loopback), scrapes the loopback endpoint as Prometheus
// would and lints it with promtool.
func TestAgentMetrics(t *testing.T) {
	m := metrics.New()
	j, err := journal.Open(t.TempDir(), nil, journal.WithObserver(m))
	require.NoError(t, err)
	t.Cleanup(func() { j.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- m.Serve(ctx, lis, nil) }()

	ok := func(context.Context, journal.Emit) error { return nil }
	fail := func(context.Context, journal.Emit) error { return errors.New("disk gone") }
	for _, op := range []struct {
		kind, id string
		fn       journal.Func
	}{{"Wipe", "w1", ok}, {"LayImage", "l1", fail}} {
		_ = j.Start(ctx, op.kind, op.id, op.fn, func(*agentv1.OperationEvent) error { return nil })
	}

	img := layImage(t, m)
	runProbe(t, m)

	url := "http://" + lis.Addr().String() + "/metrics"
	var s *promtest.Scrape
	require.Eventually(t, func() bool {
		s = promtest.Get(t, url)
		return s.Sum("kiln_agent_operation_duration_seconds") == 2
	}, 10*time.Second, 20*time.Millisecond, "operations not observed")
	for _, tc := range []struct{ kind, outcome string }{{"Wipe", "success"}, {"LayImage", "failure"}} {
		if got, found := s.Value("kiln_agent_operation_duration_seconds", "operation", tc.kind, "outcome", tc.outcome); !found || got != 1 {
			t.Errorf("kiln_agent_operation_duration_seconds{operation=%q,outcome=%q} count = %v (found %t), want 1", tc.kind, tc.outcome, got, found)
		}
	}
	checkLayAndProbe(t, s, img)
	if _, found := s.Value("process_resident_memory_bytes"); !found {
		t.Errorf("scrape has no process_resident_memory_bytes")
	}
	out := promtest.CheckMetrics(t, s.Text)
	t.Logf("promtool check metrics: ok %s", out)
	checkRulesAndDashboard(t, s)
	cancel()
	require.NoError(t, <-done)
}

// observabilityDir holds the example agent alert rules and dashboard.
const observabilityDir = "../../docs/observability"

// checkRulesAndDashboard: the agent's example alert rules pass promtool
// check rules, and they and the agent dashboard name only metrics the
// agent serves.
func checkRulesAndDashboard(t *testing.T, s *promtest.Scrape) {
	t.Helper()
	known := s.Known()
	rules := filepath.Join(observabilityDir, "kiln-agent-alerts.yaml")
	text, err := os.ReadFile(rules)
	require.NoError(t, err)
	if missing := promtest.Unknown(string(text), known); len(missing) > 0 {
		t.Errorf("%s names metrics the agent does not serve: %v", rules, missing)
	}
	t.Logf("promtool check rules: %s", strings.TrimSpace(promtest.CheckRules(t, rules)))

	path := filepath.Join(observabilityDir, "kiln-agent-dashboard.json")
	text, err = os.ReadFile(path)
	require.NoError(t, err)
	var dash struct {
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
				t.Errorf("dashboard panel %q: query %q names metrics the agent does not serve: %v", p.Title, tg.Expr, missing)
			}
		}
	}
}

// layImage lays a 4 MiB image of random bytes (nothing to skip) with
// agent/lay reporting to m, and returns its size.
func layImage(t *testing.T, m *metrics.Metrics) int {
	t.Helper()
	img := make([]byte, 4<<20)
	_, err := rand.Read(img)
	require.NoError(t, err)
	sum := sha256.Sum256(img)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.ServeContent(w, r, "image.raw", time.Time{}, bytes.NewReader(img))
	}))
	t.Cleanup(srv.Close)
	l := lay.New(slog.New(slog.DiscardHandler), lay.WithFileTargets(true), lay.WithObserver(m))
	res, err := l.Lay(context.Background(), &agentv1.LayImageRequest{Url: srv.URL + "/image.raw", Sha256: hex.EncodeToString(sum[:]),
		Format: lay.FormatRaw, Target: filepath.Join(t.TempDir(), "disk.img"), RawSize: uint64(len(img))}, nil)
	require.NoError(t, err, "lay")
	t.Logf("laid %d bytes (fetched %d) in %.3fs", res.GetBytesWritten(), res.GetBytesFetched(), res.GetSeconds())
	return len(img)
}

// runProbe runs KubeletHealthy against a healthz that answers ok,
// ClusterDNSResolves against a DNS server that answers the kubernetes
// service's address, and APIServerReady without a kubeconfig (not True).
func runProbe(t *testing.T, m *metrics.Metrics) {
	t.Helper()
	kubelet := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) }))
	t.Cleanup(kubelet.Close)
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { pc.Close() })
	go serveDNS(pc, [4]byte{10, 96, 0, 1})
	p := probe.New(probe.Options{Root: t.TempDir(), KubeletHealthz: kubelet.URL + "/healthz", DNSServer: pc.LocalAddr().String(), Timeout: 3 * time.Second, Observer: m})
	t.Cleanup(func() { p.Close() })
	resp, err := p.Probe(context.Background(), &agentv1.ProbeRequest{
		Cluster: &agentv1.ClusterConfig{ServiceCidr: "10.96.0.0/12", Role: "worker", NodeName: "node-a"},
		Skip:    []string{probe.ContainerdHealthy, probe.NodeReady, probe.CertificatesValid, probe.EtcdMemberHealthy, probe.CloudProviderInitialized},
	})
	require.NoError(t, err)
	for _, c := range resp.GetConditions() {
		t.Logf("probe: %s=%s %s: %s", c.GetType(), c.GetStatus(), c.GetReason(), c.GetMessage())
	}
}

// serveDNS answers every A query with a.
func serveDNS(pc net.PacketConn, a [4]byte) {
	buf := make([]byte, 1500)
	for {
		n, addr, err := pc.ReadFrom(buf)
		if err != nil {
			return
		}
		var q dnsmessage.Message
		if q.Unpack(buf[:n]) != nil || len(q.Questions) != 1 {
			continue
		}
		resp := dnsmessage.Message{Header: dnsmessage.Header{ID: q.Header.ID, Response: true, Authoritative: true}, Questions: q.Questions}
		if q.Questions[0].Type == dnsmessage.TypeA {
			resp.Answers = []dnsmessage.Resource{{
				Header: dnsmessage.ResourceHeader{Name: q.Questions[0].Name, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET, TTL: 5},
				Body:   &dnsmessage.AResource{A: a},
			}}
		}
		if b, err := resp.Pack(); err == nil {
			_, _ = pc.WriteTo(b, addr)
		}
	}
}

// checkLayAndProbe checks the lay's and the probe's samples in s.
func checkLayAndProbe(t *testing.T, s *promtest.Scrape, img int) {
	t.Helper()
	for _, name := range []string{"kiln_agent_lay_written_bytes_total", "kiln_agent_lay_fetched_bytes_total"} {
		if got, found := s.Value(name); !found || got != float64(img) {
			t.Errorf("%s = %v (found %t), want %d", name, got, found, img)
		}
	}
	if got, found := s.Value("kiln_agent_lay_throughput_bytes_per_second"); !found || got != 1 {
		t.Errorf("kiln_agent_lay_throughput_bytes_per_second count = %v (found %t), want 1", got, found)
	}
	if sum := s.Families["kiln_agent_lay_throughput_bytes_per_second"].GetMetric()[0].GetHistogram().GetSampleSum(); !(sum > 0) {
		t.Errorf("kiln_agent_lay_throughput_bytes_per_second sum = %v, want a rate above 0", sum)
	}
	for _, tc := range []struct {
		check, result string
	}{{probe.KubeletHealthy, "True"}, {probe.ClusterDNSResolves, "True"}} {
		if got, found := s.Value("kiln_agent_probe_checks_total", "check", tc.check, "result", tc.result); !found || got != 1 {
			t.Errorf("kiln_agent_probe_checks_total{check=%q,result=%q} = %v (found %t), want 1", tc.check, tc.result, got, found)
		}
		if got, found := s.Value("kiln_agent_probe_check_duration_seconds", "check", tc.check); !found || got != 1 {
			t.Errorf("kiln_agent_probe_check_duration_seconds{check=%q} count = %v (found %t), want 1", tc.check, got, found)
		}
	}
	if got := s.Sum("kiln_agent_probe_checks_total", "check", probe.APIServerReady, "result", "True"); got != 0 {
		t.Errorf("kiln_agent_probe_checks_total{check=APIServerReady,result=True} = %v without a kubeconfig, want 0", got)
	}
	if got := s.Sum("kiln_agent_probe_checks_total"); got != 3 {
		t.Errorf("kiln_agent_probe_checks_total summed = %v, want 3 (the skipped checks are not counted)", got)
	}
}

// TestServeTLS scrapes the mTLS listener with certificates of each kind:
// a reader's is served, an agent's is refused (403), and no certificate
// or one of another CA fails the handshake.
func TestServeTLS(t *testing.T) {
	ca := agenttest.NewCA(t)
	id := agenttest.Enroll(t, ca, t.TempDir(), "host-a", "127.0.0.1:1")
	m := metrics.New()
	m.ObserveProbe(probe.KubeletHealthy, "True", 3*time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- m.ServeTLS(ctx, lis, id.ServerTLS(), nil) }()
	url := "https://" + lis.Addr().String() + "/metrics"
	client := func(c *tls.Config) *http.Client {
		return &http.Client{Transport: &http.Transport{TLSClientConfig: c}, Timeout: 10 * time.Second}
	}

	for _, role := range []pki.Role{pki.RoleReader, pki.RoleOperator, pki.RoleAdmin, pki.RoleController} {
		s := promtest.GetWith(t, client(agenttest.ClientTLS(t, ca, ca, role, "prometheus")), url)
		if got, found := s.Value("kiln_agent_probe_checks_total", "check", probe.KubeletHealthy, "result", "True"); !found || got != 1 {
			t.Errorf("scrape as %s: kiln_agent_probe_checks_total = %v (found %t), want 1", role, got, found)
		}
	}
	resp, err := client(agenttest.ClientTLS(t, ca, ca, pki.RoleAgent, "host-b")).Get(url)
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("scrape as agent = HTTP %d %q, want 403", resp.StatusCode, body)
	}
	t.Logf("scrape as agent: HTTP %d %s", resp.StatusCode, strings.TrimSpace(string(body)))
	for name, conf := range map[string]*tls.Config{
		"no certificate":           agenttest.ClientTLS(t, ca, nil, "", ""),
		"another CA's certificate": agenttest.ClientTLS(t, ca, agenttest.NewCA(t), pki.RoleReader, "prometheus"),
	} {
		if resp, err := client(conf).Get(url); err == nil {
			resp.Body.Close()
			t.Errorf("scrape with %s = HTTP %d, want a failed handshake", name, resp.StatusCode)
		} else {
			t.Logf("scrape with %s: %v", name, err)
		}
	}
	cancel()
	require.NoError(t, <-done)
}

func TestCanScrape(t *testing.T) {
	for _, tc := range []struct {
		role pki.Role
		want bool
	}{{pki.RoleReader, true}, {pki.RoleOperator, true}, {pki.RoleAdmin, true}, {pki.RoleController, true}, {pki.RoleAgent, false}, {"", false}} {
		if got := metrics.CanScrape(tc.role); got != tc.want {
			t.Errorf("CanScrape(%q) = %t, want %t", tc.role, got, tc.want)
		}
	}
}

func TestCheckLoopback(t *testing.T) {
	for _, tc := range []struct {
		addr string
		ok   bool
	}{
		{"127.0.0.1:9101", true},
		{"[::1]:9101", true},
		{"localhost:9101", true},
		{"0.0.0.0:9101", false},
		{":9101", false},
		{"10.0.0.5:9101", false},
		{"127.0.0.1", false},
	} {
		if err := metrics.CheckLoopback(tc.addr); (err == nil) != tc.ok {
			t.Errorf("CheckLoopback(%q) = %v, want ok %t", tc.addr, err, tc.ok)
		}
	}
}
