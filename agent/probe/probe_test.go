package probe

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kilnhq/kiln/internal/conditions"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func cond(t *testing.T, resp *agentv1.ProbeResponse, typ string) *typesv1.Condition {
	t.Helper()
	c := conditions.Get(resp.GetConditions(), typ)
	require.NotNil(t, c, "no %s condition in %v", typ, resp.GetConditions())
	return c
}

func TestProbeHealthyNode(t *testing.T) {
	n := newFakeNode(t, time.Now().Add(365*24*time.Hour))
	c := cluster()
	c.CloudProvider = "external"
	resp := probeOnce(t, n, c)
	var types []string
	for _, c := range resp.GetConditions() {
		types = append(types, c.GetType())
		if c.GetStatus() != conditions.True {
			t.Errorf("Probe() %s = %s (%s: %s), want True", c.GetType(), c.GetStatus(), c.GetReason(), c.GetMessage())
		}
		if c.GetReason() == "" || c.GetMessage() == "" {
			t.Errorf("Probe() %s has no reason or message: %v", c.GetType(), c)
		}
	}
	if !slices.Equal(types, Types) {
		t.Errorf("Probe() types = %v, want %v", types, Types)
	}
	if !resp.GetHealthy() {
		t.Errorf("Probe().Healthy = false, want true")
	}
	// The API calls use the kubelet's client certificate (the
	// cloud-provider check finds no uninitialised node, so needs no pods).
	for _, r := range n.apiRequests {
		if !strings.HasPrefix(r, "system:node:node-1 ") {
			t.Errorf("API request %q not made as system:node:node-1", r)
		}
	}
	if msg := cond(t, resp, ClusterDNSResolves).GetMessage(); !strings.Contains(msg, "kubernetes.default.svc.cluster.local. = 10.96.0.1") {
		t.Errorf("ClusterDNSResolves message = %q, want the real answer", msg)
	}
}

func TestProbeWorkerLeavesOutEtcdAndCloud(t *testing.T) {
	n := newFakeNode(t, time.Now().Add(365*24*time.Hour))
	c := cluster()
	c.Role = "worker"
	resp := probeOnce(t, n, c)
	for _, typ := range []string{EtcdMemberHealthy, CloudProviderInitialized} {
		if conditions.Get(resp.GetConditions(), typ) != nil {
			t.Errorf("Probe(worker, no cloud provider) reports %s, want it left out", typ)
		}
	}
	if !resp.GetHealthy() {
		t.Errorf("Probe(worker).Healthy = false: %v", resp.GetConditions())
	}
}

func TestProbeSkip(t *testing.T) {
	n := newFakeNode(t, time.Now().Add(365*24*time.Hour))
	n.set(func(n *fakeNode) { n.dnsAnswer = "drop" })
	resp := probeOnce(t, n, cluster(), ClusterDNSResolves)
	if conditions.Get(resp.GetConditions(), ClusterDNSResolves) != nil {
		t.Errorf("Probe(skip %s) reported it", ClusterDNSResolves)
	}
	if !resp.GetHealthy() {
		t.Errorf("Probe(skip DNS).Healthy = false: %v", resp.GetConditions())
	}
}

func TestProbeFaults(t *testing.T) {
	tests := []struct {
		name       string
		fault      func(n *fakeNode)
		cluster    func(c *agentv1.ClusterConfig)
		typ        string
		status     string
		reason     string
		msgContain string
	}{
		{"kubelet unhealthy", func(n *fakeNode) { n.healthz = "" }, nil, KubeletHealthy, "False", "KubeletUnhealthy", "HTTP 500"},
		{"kubelet down", func(n *fakeNode) { n.opts.KubeletHealthz = "http://127.0.0.1:1/healthz" }, nil, KubeletHealthy, "False", "KubeletUnreachable", "connection refused"},
		{"containerd not serving", func(n *fakeNode) { n.containerdSrv.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING) }, nil, ContainerdHealthy, "False", "NotServing", "NOT_SERVING"},
		{"containerd socket missing", func(n *fakeNode) { n.opts.ContainerdSocket = "/run/nothing.sock" }, nil, ContainerdHealthy, "False", "SocketMissing", "/run/nothing.sock"},
		{"api not ready", func(n *fakeNode) { n.readyz = 500 }, nil, APIServerReady, "False", "NotReady", "etcd failed"},
		{"no kubelet.conf", func(n *fakeNode) { os.Remove(filepath.Join(n.root, kubeletConf)) }, nil, APIServerReady, "False", "NoCredentials", "kubelet.conf"},
		{"node not ready", func(n *fakeNode) { n.nodeReady = "False" }, nil, NodeReady, "False", "KubeletReady", "node Ready is False"},
		{"disk pressure", func(n *fakeNode) { n.pressure = "DiskPressure" }, nil, NodeReady, "False", "DiskPressure",
			"node Ready is True: kubelet is posting ready status; the kubelet reports DiskPressure (kubelet has diskpressure): it evicts pods (CoreDNS among them)"},
		{"disk pressure advice", func(n *fakeNode) { n.pressure = "DiskPressure" }, nil, NodeReady, "False", "DiskPressure", "/etc/kiln/kubeadm-patches"},
		{"memory pressure", func(n *fakeNode) { n.pressure = "MemoryPressure" }, nil, NodeReady, "False", "MemoryPressure", "free memory on the node"},
		{"pid pressure", func(n *fakeNode) { n.pressure = "PIDPressure" }, nil, NodeReady, "False", "PIDPressure", "forks too many processes"},
		{"not ready under pressure", func(n *fakeNode) { n.nodeReady = "False"; n.pressure = "DiskPressure" }, nil, NodeReady, "False", "KubeletReady", "node Ready is False: kubelet is posting ready status; the kubelet reports DiskPressure"},
		{"dns refused", func(n *fakeNode) { n.opts.DNSServer = closedUDPPort(t) }, nil, ClusterDNSResolves, "False", "NoEndpoints", "connection refused: " + NoEndpointsAdvice},
		{"dns refused under disk pressure", func(n *fakeNode) { n.opts.DNSServer = closedUDPPort(t); n.pressure = "DiskPressure" }, nil, ClusterDNSResolves, "False", "NoEndpoints",
			"a node under DiskPressure evicts it; this node reports DiskPressure (kubelet has diskpressure)"},
		{"dns nxdomain", func(n *fakeNode) { n.dnsAnswer = "" }, nil, ClusterDNSResolves, "False", "NoAnswer", "NXDOMAIN"},
		{"dns wrong answer", func(n *fakeNode) { n.dnsAnswer = "10.96.0.99" }, nil, ClusterDNSResolves, "False", "WrongAnswer", "want 10.96.0.1"},
		{"dns silent", func(n *fakeNode) { n.dnsAnswer = "drop"; n.opts.Timeout = 1500 * time.Millisecond }, nil, ClusterDNSResolves, "False", "NoAnswer", "no answer"},
		{"no service cidr", nil, func(c *agentv1.ClusterConfig) { c.ServiceCidr = "" }, ClusterDNSResolves, "Unknown", "NoServiceCIDR", "service CIDR"},
		{"etcd unhealthy", func(n *fakeNode) { n.etcdHealth = "false" }, nil, EtcdMemberHealthy, "False", "Unhealthy", "RAFT NO LEADER"},
		{"etcd down", func(n *fakeNode) { n.opts.EtcdEndpoint = "https://127.0.0.1:1" }, nil, EtcdMemberHealthy, "False", "Unreachable", "connection refused"},
		{"ccm missing", func(n *fakeNode) { n.taints = []string{uninitializedTaint} }, func(c *agentv1.ClusterConfig) { c.CloudProvider = "external" },
			CloudProviderInitialized, "False", "CloudControllerManagerNotRunning", "no cloud-controller-manager pod is running in the cluster (0 pending): run the cloud-controller-manager with hostNetwork: true"},
		{"ccm missing seen from a worker", func(n *fakeNode) {
			n.taints = []string{uninitializedTaint}
			n.ccmPhase = "Pending"
			os.Remove(filepath.Join(n.root, adminConf))
		}, func(c *agentv1.ClusterConfig) { c.CloudProvider = "external"; c.Role = "worker" },
			CloudProviderInitialized, "False", "CloudControllerManagerNotRunning", "running on this node (0 pending)"},
		{"ccm pending", func(n *fakeNode) { n.taints = []string{uninitializedTaint}; n.ccmPhase = "Pending" }, func(c *agentv1.ClusterConfig) { c.CloudProvider = "external" },
			CloudProviderInitialized, "False", "CloudControllerManagerNotRunning", "in the cluster (1 pending)"},
		{"ccm running", func(n *fakeNode) { n.taints = []string{uninitializedTaint}; n.ccmPhase = "Running" }, func(c *agentv1.ClusterConfig) { c.CloudProvider = "external" },
			CloudProviderInitialized, "False", "Initializing", "have not initialised it yet"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n := newFakeNode(t, time.Now().Add(365*24*time.Hour))
			if tt.fault != nil {
				n.set(tt.fault)
			}
			c := cluster()
			if tt.cluster != nil {
				tt.cluster(c)
			}
			resp := probeOnce(t, n, c)
			got := cond(t, resp, tt.typ)
			if got.GetStatus() != tt.status || got.GetReason() != tt.reason || !strings.Contains(got.GetMessage(), tt.msgContain) {
				t.Errorf("Probe(%s) %s = %s/%s %q, want %s/%s containing %q", tt.name, tt.typ, got.GetStatus(), got.GetReason(), got.GetMessage(), tt.status, tt.reason, tt.msgContain)
			}
			if resp.GetHealthy() {
				t.Errorf("Probe(%s).Healthy = true, want false", tt.name)
			}
		})
	}
}

func TestCertificatesValid(t *testing.T) {
	day := 24 * time.Hour
	tests := []struct {
		name     string
		notAfter time.Duration
		status   string
		reason   string
		days     string
	}{
		{"a year", 365 * day, "True", "Valid", "364 days left"},
		{"ten days", 10*day + time.Hour, "False", "ExpiringSoon", "10 days left"},
		{"expired", -2*day - time.Hour, "False", "Expired", "2 days ago"},
	}
	for _, tt := range tests {
		n := newFakeNode(t, time.Now().Add(tt.notAfter))
		got := cond(t, probeOnce(t, n, cluster()), CertificatesValid)
		if got.GetStatus() != tt.status || got.GetReason() != tt.reason || !strings.Contains(got.GetMessage(), tt.days) {
			t.Errorf("CertificatesValid(kubelet cert expiring in %v) = %s/%s %q, want %s/%s with %q", tt.notAfter, got.GetStatus(), got.GetReason(), got.GetMessage(), tt.status, tt.reason, tt.days)
		}
		if tt.status != "True" && !strings.Contains(got.GetMessage(), kubeletClientCert) {
			t.Errorf("CertificatesValid(%s) message %q does not name the file", tt.name, got.GetMessage())
		}
	}
	empty := New(Options{Root: t.TempDir()})
	got := cond(t, func() *agentv1.ProbeResponse {
		r, err := empty.Probe(context.Background(), &agentv1.ProbeRequest{Cluster: cluster(), Skip: []string{KubeletHealthy, ContainerdHealthy, APIServerReady, NodeReady, ClusterDNSResolves, EtcdMemberHealthy}})
		require.NoError(t, err)
		return r
	}(), CertificatesValid)
	if got.GetStatus() != "False" || got.GetReason() != "NoCertificates" {
		t.Errorf("CertificatesValid(no files) = %s/%s, want False/NoCertificates", got.GetStatus(), got.GetReason())
	}
}

func TestNthAddr(t *testing.T) {
	tests := []struct {
		cidr string
		n    int64
		want string
	}{
		{"10.96.0.0/12", 1, "10.96.0.1"},
		{"10.96.0.0/12", 10, "10.96.0.10"},
		{"172.21.0.0/16", 10, "172.21.0.10"},
		{"10.0.0.250/24", 10, "10.0.0.10"},
		{"fd00:10:96::/108", 10, "fd00:10:96::a"},
	}
	for _, tt := range tests {
		got, err := nthAddr(netip.MustParsePrefix(tt.cidr), tt.n)
		require.NoError(t, err)
		if got.String() != tt.want {
			t.Errorf("nthAddr(%q, %d) = %v, want %v", tt.cidr, tt.n, got, tt.want)
		}
	}
	if _, err := nthAddr(netip.MustParsePrefix("10.0.0.0/29"), 10); err == nil {
		t.Errorf("nthAddr(%q, 10) = nil error, want out of range", "10.0.0.0/29")
	}
}

func TestProbeCancelled(t *testing.T) {
	n := newFakeNode(t, time.Now().Add(365*24*time.Hour))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := New(n.opts).Probe(ctx, &agentv1.ProbeRequest{Cluster: cluster()}); err == nil {
		t.Errorf("Probe(cancelled ctx) = nil error, want the context's error")
	}
}

// TestProbeReusedProberSeesChangedFiles: clients kept between probes are
// rebuilt when their files change (a rotated or removed credential).
func TestProbeReusedProberSeesChangedFiles(t *testing.T) {
	n := newFakeNode(t, time.Now().Add(365*24*time.Hour))
	p := New(n.opts)
	defer p.Close()
	req := &agentv1.ProbeRequest{Cluster: cluster()}
	resp, err := p.Probe(context.Background(), req)
	require.NoError(t, err)
	require.True(t, resp.GetHealthy(), "%v", resp.GetConditions())
	require.NoError(t, os.Remove(filepath.Join(n.root, kubeletConf)))
	require.NoError(t, os.Remove(filepath.Join(n.root, etcdClientKey)))
	resp, err = p.Probe(context.Background(), req)
	require.NoError(t, err)
	for _, typ := range []string{APIServerReady, EtcdMemberHealthy} {
		if got := cond(t, resp, typ); got.GetReason() != "NoCredentials" {
			t.Errorf("second Probe() %s = %s/%s, want NoCredentials after its files were removed", typ, got.GetStatus(), got.GetReason())
		}
	}
}

// closedUDPPort returns a loopback UDP address nothing listens on: a query
// to it fails with connection refused (ICMP port unreachable), as one to
// a service kube-proxy rejects does.
func closedUDPPort(t *testing.T) string {
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := pc.LocalAddr().String()
	require.NoError(t, pc.Close())
	return addr
}

func TestRefused(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want bool
	}{
		// What kube-proxy's REJECT rule gives a local client (the CI failure).
		{"write EPERM", fmt.Errorf("wrapped: %w", &net.OpError{Op: "write", Net: "udp", Err: os.NewSyscallError("write", syscall.EPERM)}), true},
		{"read ECONNREFUSED", &net.OpError{Op: "read", Net: "udp", Err: os.NewSyscallError("recvfrom", syscall.ECONNREFUSED)}, true},
		{"timeout", errors.New("no answer before the deadline"), false},
		{"network unreachable", &net.OpError{Op: "write", Net: "udp", Err: os.NewSyscallError("write", syscall.ENETUNREACH)}, false},
	}
	for _, tt := range tests {
		if got := refused(tt.err); got != tt.want {
			t.Errorf("refused(%s: %v) = %v, want %v", tt.name, tt.err, got, tt.want)
		}
	}
}

// A refused query's message names neither the local address nor its
// ephemeral port, so the same state probed twice gives the same condition
// (a message that changes on each probe is a store write each time).
func TestRefusalMessageIsStable(t *testing.T) {
	eperm := &net.OpError{Op: "write", Net: "udp",
		Source: &net.UDPAddr{IP: net.IPv4(10, 251, 250, 2), Port: 34552},
		Addr:   &net.UDPAddr{IP: net.IPv4(10, 96, 0, 10), Port: 53},
		Err:    os.NewSyscallError("write", syscall.EPERM)}
	require.Equal(t, "the query could not be sent: operation not permitted", refusal(fmt.Errorf("wrapped: %w", eperm)))

	n := newFakeNode(t, time.Now().Add(365*24*time.Hour))
	n.set(func(n *fakeNode) { n.opts.DNSServer = closedUDPPort(t) })
	first := cond(t, probeOnce(t, n, cluster()), ClusterDNSResolves)
	second := cond(t, probeOnce(t, n, cluster()), ClusterDNSResolves)
	require.Equal(t, "NoEndpoints", first.GetReason())
	require.Contains(t, first.GetMessage(), "the query was refused: connection refused: "+NoEndpointsAdvice)
	require.NotContains(t, first.GetMessage(), "->", "the socket's addresses: "+first.GetMessage())
	require.Equal(t, first.GetMessage(), second.GetMessage())
}

// A node under pressure is Ready for the kubelet, but the probe reports
// it False with severity Warning (not Error: the node is up) and makes the
// probe unhealthy.
func TestNodePressureSeverity(t *testing.T) {
	n := newFakeNode(t, time.Now().Add(365*24*time.Hour))
	n.set(func(n *fakeNode) { n.pressure = "DiskPressure" })
	resp := probeOnce(t, n, cluster())
	c := cond(t, resp, NodeReady)
	if c.GetStatus() != "False" || c.GetSeverity() != "Warning" {
		t.Errorf("NodeReady under DiskPressure = %s severity %q, want False severity Warning", c.GetStatus(), c.GetSeverity())
	}
	if resp.GetHealthy() {
		t.Errorf("Probe(DiskPressure).Healthy = true, want false")
	}
}
