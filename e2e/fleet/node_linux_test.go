package fleet

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"

	"github.com/kilnhq/kiln/agent/lay"
	"github.com/kilnhq/kiln/agent/personalize"
	"github.com/kilnhq/kiln/agent/probe"
	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/e2e/lab/netns"
	"github.com/kilnhq/kiln/host/command"
	"github.com/kilnhq/kiln/imagebuilder/golden"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/imagebuilder/manifest"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/imagebuilder/spec"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/pki"
	"github.com/kilnhq/kiln/internal/testenv"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// The lab cluster's networks (examples/lab-cluster.yaml); the hosts' /24
// (10.249.X.0/24, X from the test's PID) stays clear of them.
const (
	podCIDR     = "10.244.0.0/16"
	serviceCIDR = "10.96.0.0/12"
	agentPort   = "7441"
)

// needNodeTools skips unless this machine can build, lay and boot a lab
// node: root, the tools, cgroup v1 (what the lab's nspawn hosts are
// proven on), the kube-tools cache and a rootfs cache entry or debootstrap.
func needNodeTools(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: builds a golden image and boots a Kubernetes node")
	}
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root: builds an image, boots systemd-nspawn in a network namespace")
	}
	for tool, pkg := range map[string]string{"systemd-nspawn": "systemd-container", "busctl": "systemd",
		"nft": "nftables", "ip": "iproute2", "unshare": "util-linux", "sfdisk": "fdisk", "losetup": "mount",
		"debugfs": "e2fsprogs", "mkfs.ext4": "e2fsprogs"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (Debian package %s)", tool, pkg)
		}
	}
	if _, err := os.Stat("/sys/fs/cgroup/memory"); err != nil {
		testenv.Skip(t, "needs the cgroup v1 hierarchy the lab's nspawn hosts are proven on")
	}
	rel := kubetools.Pinned()
	c := kubetools.Cache{Dir: filepath.Join(rootfs.CacheRoot(), "kube-tools")}
	if _, err := c.Verify(rel); err != nil {
		testenv.Skipf(t, "kube-tools cache incomplete: %v (run: make kube-tools)", err)
	}
	if _, err := exec.LookPath("debootstrap"); err != nil {
		s, err := loadLabSpec()
		require.NoError(t, err)
		if _, err := os.Stat(golden.RootfsSpec(s, "").Dir()); err != nil {
			testenv.Skipf(t, "no rootfs cache entry %s and no debootstrap to build it", golden.RootfsSpec(s, "").Dir())
		}
	}
}

func loadLabSpec() (*spec.Spec, error) { return spec.Load(DefaultLabSpec()) }

// buildAgent builds a static kiln-agent whose bytes depend only on the
// source (no VCS stamp), so the image cache key changes only when the
// agent does.
func buildAgent(t *testing.T, ctx context.Context) string {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "kiln-agent")
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	cmd := exec.CommandContext(ctx, goBin, "build", "-trimpath", "-buildvcs=false", "-o", dst, "github.com/kilnhq/kiln/cmd/kiln-agent")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build kiln-agent: %s", out)
	return dst
}

// labNet is a guard (nft table dropping forwarded traffic out of the
// uplinks) and a bridge with .1 of the hosts' /24; close undoes both.
type labNet struct {
	prefix, bridge, table string
}

func (n *labNet) addr(i int) string { return fmt.Sprintf("%s.%d", n.prefix, i) }

func newLabNet(t *testing.T, ctx context.Context) *labNet {
	t.Helper()
	id := os.Getpid() % 100000
	n := &labNet{prefix: fmt.Sprintf("10.249.%d", 20+id%200), bridge: "kfb" + strconv.Itoa(id), table: "kiln-fleet-" + strconv.Itoa(id)}
	out, err := exec.CommandContext(ctx, "ip", "-o", "route", "show", "default").Output()
	require.NoError(t, err)
	var uplinks []string
	f := strings.Fields(string(out))
	for i := 0; i+1 < len(f); i++ {
		if f[i] == "dev" {
			uplinks = append(uplinks, f[i+1])
		}
	}
	if len(uplinks) == 0 {
		testenv.Skip(t, "no default route: cannot name the uplink to guard")
	}
	run(t, ctx, "nft", "add", "table", "inet", n.table)
	t.Cleanup(func() { runCleanup(t, "nft", "delete", "table", "inet", n.table) })
	run(t, ctx, "nft", "add", "chain", "inet", n.table, "guardfwd", "{ type filter hook forward priority -200; policy accept; }")
	for _, up := range uplinks {
		run(t, ctx, "nft", "add", "rule", "inet", n.table, "guardfwd", "oifname", up, "counter", "drop")
	}
	run(t, ctx, "ip", "link", "add", n.bridge, "address", netns.BridgeMAC(n.bridge), "type", "bridge")
	t.Cleanup(func() { runCleanup(t, "ip", "link", "del", n.bridge) })
	run(t, ctx, "ip", "addr", "add", n.addr(1)+"/24", "dev", n.bridge)
	run(t, ctx, "ip", "link", "set", n.bridge, "up")
	return n
}

func run(t *testing.T, ctx context.Context, name string, args ...string) string {
	t.Helper()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	require.NoError(t, err, "%s %s: %s", name, strings.Join(args, " "), out)
	return string(out)
}

func runCleanup(t *testing.T, name string, args ...string) {
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Errorf("cleanup: %s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
}

// serveDir serves dir over HTTP on loopback (Range requests included, as
// the controller's boot server does) and returns its base URL.
func serveDir(t *testing.T, dir string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := &http.Server{Handler: http.FileServer(http.Dir(dir)), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close() })
	return "http://" + ln.Addr().String() + "/"
}

// timings collects "| step | seconds |" rows for the log.
type timings struct {
	t    *testing.T
	rows []string
}

func (tm *timings) add(step string, d time.Duration) {
	tm.rows = append(tm.rows, fmt.Sprintf("| %s | %.1f s |", step, d.Seconds()))
	tm.t.Logf("%-32s %6.1fs", step, d.Seconds())
}

// rig is what the node tests share: the lab image served over loopback
// HTTP, a guarded lab network, a test CA standing in for the controller's
// and the controller's client certificate, and the times of each step.
type rig struct {
	t       *testing.T
	ctx     context.Context
	tm      *timings
	lnet    *labNet
	m       *manifest.Manifest
	rawURL  string
	ca      *pki.CA
	client  tls.Certificate
	hostLog *os.File
}

func newRig(t *testing.T, ctx context.Context) *rig {
	t.Helper()
	r := &rig{t: t, ctx: ctx, tm: &timings{t: t}}
	t.Cleanup(func() { t.Logf("times:\n%s", strings.Join(r.tm.rows, "\n")) })

	start := time.Now()
	agent := buildAgent(t, ctx)
	r.tm.add("build kiln-agent", time.Since(start))
	start = time.Now()
	dir, m, err := LabImage(ctx, ImageOptions{Agent: agent, Progress: testWriter{t}})
	require.NoError(t, err)
	r.tm.add("lab image (first call)", time.Since(start))
	start = time.Now()
	dir2, m2, err := LabImage(ctx, ImageOptions{Agent: agent})
	require.NoError(t, err)
	r.tm.add("lab image (warm call)", time.Since(start))
	require.Equal(t, dir, dir2)
	require.Equal(t, m.RawSHA256, m2.RawSHA256)
	t.Logf("image %s in %s: %d MiB raw, %d MiB data", m.Tag, dir, m.RawSize>>20, m.DataSize()>>20)
	r.m = m
	raw, _, _, _ := golden.FileNames(m.Tag)
	r.rawURL = serveDir(t, dir) + raw

	r.lnet = newLabNet(t, ctx)
	r.hostLog, err = os.Create(filepath.Join(t.TempDir(), "host.log"))
	require.NoError(t, err)
	t.Cleanup(func() { r.hostLog.Close() })
	r.ca, err = pki.NewCA("kiln-e2e-fleet", time.Now())
	require.NoError(t, err)
	ctlCert, ctlKey, err := r.ca.Issue(pki.RoleController, pki.ControllerName, nil, time.Hour, time.Now())
	require.NoError(t, err)
	r.client, err = tls.X509KeyPair(ctlCert, ctlKey)
	require.NoError(t, err)
	return r
}

// boot makes host name (address .i of the lab network), lays the image
// onto its disk, writes its identity, powers it on from disk and returns
// it once its installed agent answers over mTLS.
func (r *rig) boot(name string, i int) *node {
	t, ctx := r.t, r.ctx
	t.Helper()
	ip := r.lnet.addr(i)
	// The disk is the image's size: netns reads `sfdisk -J` with its
	// warnings, and a disk larger than the image makes sfdisk warn that
	// the backup GPT is not at the end (reported; not this package's).
	var tracked []netns.Resource
	h, err := netns.New(ctx, netns.Options{
		Name: name, Lab: "fl" + strconv.Itoa(os.Getpid()%100000), StateDir: filepath.Join(t.TempDir(), name),
		Bridge: r.lnet.bridge, Address: ip + "/24", Gateway: r.lnet.addr(1), DiskSize: int64(r.m.RawSize),
		Track:  func(res netns.Resource) { tracked = append(tracked, res) },
		Logger: slog.New(slog.NewTextHandler(r.hostLog, nil)).With("host", name),
	})
	require.NoError(t, err)
	t.Cleanup(func() { closeHost(t, h, tracked) })

	// Lay the image as the boot agent does: the raw image by block map.
	start := time.Now()
	res, err := lay.New(slog.New(slog.NewTextHandler(r.hostLog, nil)), lay.WithFileTargets(true)).Lay(ctx, r.m.LayRequest(r.rawURL, h.DiskPath(), true), nil)
	require.NoError(t, err)
	r.tm.add("lay (block map) "+name, time.Since(start))
	t.Logf("laid %d MiB (fetched %d MiB) onto %s", res.GetBytesWritten()>>20, res.GetBytesFetched()>>20, h.DiskPath())

	// The host's identity; the controller address answers nothing.
	keyPEM, csr, err := pki.NewKeyAndCSR(name)
	require.NoError(t, err)
	certPEM, err := r.ca.SignCSR(csr, pki.RoleAgent, name, time.Hour, time.Now(), pki.WithHosts(ip))
	require.NoError(t, err)
	start = time.Now()
	require.NoError(t, personalize.New(command.Exec{}, nil).WriteIdentity(ctx, &agentv1.WriteIdentityRequest{
		Target: h.DiskPath(), Hostname: name, ControllerUrl: "https://127.0.0.1:9", CaHash: r.ca.Hash(),
		CertificatePem: certPEM, KeyPem: keyPEM, CaPem: r.ca.CertPEM(),
	}))
	r.tm.add("write identity "+name, time.Since(start))

	start = time.Now()
	require.NoError(t, h.PowerOn(ctx, machine.BootDisk))
	waitFor(t, ctx, 2*time.Minute, name+"'s systemd running", func() (bool, string) {
		st, err := h.SystemState(ctx)
		if err != nil {
			return false, err.Error() + "; " + h.LastBootError()
		}
		return st == "running" || st == "degraded", st
	}, func() string { return consoleTail(h) })
	r.tm.add("boot to running "+name, time.Since(start))

	// The installed agent, dialled as the controller.
	conn, err := grpc.NewClient(ip+":"+agentPort,
		grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: r.ca.Pool(), ServerName: ip, Certificates: []tls.Certificate{r.client}, MinVersion: tls.VersionTLS13})),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 15 * time.Second, Timeout: 10 * time.Second, PermitWithoutStream: true}))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	n := &node{t: t, ctx: ctx, tm: r.tm, name: name, ip: ip, h: h, agent: agentv1.NewAgentClient(conn), log: filepath.Join(t.TempDir(), "operations.log")}
	start = time.Now()
	waitFor(t, ctx, 90*time.Second, "the installed agent of "+name+" answering Facts over mTLS", func() (bool, string) {
		fctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		_, err := n.agent.Facts(fctx, &agentv1.FactsRequest{})
		return err == nil, fmt.Sprint(err)
	}, func() string { return n.exec("journalctl", "-u", "kiln-agent", "--no-pager", "-n", "30") })
	r.tm.add("agent answers "+name, time.Since(start))
	return n
}

// cluster is the lab cluster (examples/lab-cluster.yaml) as n joins it
// in role, with the API server at endpoint.
func (n *node) cluster(role, endpoint string) *agentv1.ClusterConfig {
	return &agentv1.ClusterConfig{
		Name: "lab", KubernetesVersion: kubetools.Pinned().Kubernetes,
		PodCidr: podCIDR, ServiceCidr: serviceCIDR, DnsDomain: "cluster.local",
		ControlPlaneEndpoint: endpoint, CgroupDriver: "cgroupfs",
		Role: role, NodeName: n.name, AdvertiseAddress: n.ip,
	}
}

// prepare runs Prepare and Preflight, which must pass.
func (n *node) prepare(c *agentv1.ClusterConfig) {
	t := n.t
	t.Helper()
	start := time.Now()
	s, err := n.agent.Prepare(n.ctx, &agentv1.PrepareRequest{CgroupDriver: c.GetCgroupDriver()})
	n.succeed("prepare", s, err)
	n.tm.add("prepare "+n.name, time.Since(start))
	start = time.Now()
	rep, err := n.agent.Preflight(n.ctx, &agentv1.PreflightRequest{Cluster: c})
	require.NoError(t, err)
	for _, c := range rep.GetChecks() {
		if !c.GetPassed() {
			t.Logf("%s preflight %s (%s): %s; fix: %s", n.name, c.GetName(), c.GetSeverity(), c.GetMessage(), c.GetFix())
		}
	}
	require.True(t, rep.GetPassed(), "%s: preflight failed", n.name)
	n.tm.add("preflight "+n.name, time.Since(start))
}

// waitReadyDNS probes n until NodeReady and ClusterDNSResolves are True,
// and checks that the DNS answer is the kubernetes service's address.
func (n *node) waitReadyDNS(c *agentv1.ClusterConfig) *agentv1.ProbeResponse {
	t := n.t
	t.Helper()
	var last *agentv1.ProbeResponse
	waitFor(t, n.ctx, 5*time.Minute, n.name+": NodeReady and ClusterDNSResolves", func() (bool, string) {
		pctx, cancel := context.WithTimeout(n.ctx, 20*time.Second)
		defer cancel()
		resp, err := n.agent.Probe(pctx, &agentv1.ProbeRequest{Cluster: c})
		if err != nil {
			return false, err.Error()
		}
		last = resp
		ready := conditions.Get(resp.GetConditions(), probe.NodeReady).GetStatus() == conditions.True
		dns := conditions.Get(resp.GetConditions(), probe.ClusterDNSResolves).GetStatus() == conditions.True
		return ready && dns, describe(resp)
	}, n.diagnose)
	t.Logf("%s probe:%s", n.name, describe(last))
	dns := conditions.Get(last.GetConditions(), probe.ClusterDNSResolves)
	if !strings.Contains(dns.GetMessage(), "= 10.96.0.1") {
		t.Errorf("%s: ClusterDNSResolves = %q, want a real answer 10.96.0.1 for the kubernetes service", n.name, dns.GetMessage())
	}
	return last
}

// TestLabImageBootsAsNode is a lab host's life up to a working
// single-node cluster, as the controller drives it: the lab image (built
// or cached) laid onto a netns machine's disk by agent/lay with the block
// map from an HTTP server, the host's identity written into the laid disk
// by agent/personalize, power on from disk, then through the installed
// agent over mTLS: Prepare, Preflight, KubeadmInit and Probe until the node
// is Ready and cluster DNS answers. Everything the image needs for that is
// in the image; the test only plays the controller.
func TestLabImageBootsAsNode(t *testing.T) {
	needNodeTools(t)
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	r := newRig(t, ctx)
	n := r.boot("fleet-cp1", 2)
	c := n.cluster("control-plane", n.ip+":6443")
	n.prepare(c)

	start := time.Now()
	s, err := n.agent.KubeadmInit(ctx, &agentv1.KubeadmInitRequest{Cluster: c})
	ev := n.succeed("kubeadm init", s, err)
	r.tm.add("kubeadm init", time.Since(start))
	require.Equal(t, n.ip+":6443", ev.GetKubeadmInit().GetApiServerEndpoint())

	start = time.Now()
	n.waitReadyDNS(c)
	r.tm.add("init to Ready + DNS", time.Since(start))
	// The lab units did their part: the node's own name resolves, CoreDNS
	// does not forward upstream.
	if hosts := n.exec("cat", "/etc/hosts"); !strings.Contains(hosts, n.ip+"\t"+n.name) {
		t.Errorf("/etc/hosts lacks %s %s:\n%s", n.ip, n.name, hosts)
	}
	if cf := n.exec("kubectl", "--kubeconfig", "/etc/kubernetes/admin.conf", "-n", "kube-system", "get", "configmap", "coredns", "-o", "jsonpath={.data.Corefile}"); strings.Contains(cf, "forward") {
		t.Errorf("CoreDNS still forwards upstream:\n%s", cf)
	}
}

// TestLabImageWorkerJoins: a second lab host joins the first as a worker
// and both are Ready with cluster DNS answering on each, which takes the
// image's lab network across hosts: each node's pod CIDR routed via the
// other (host-gw), so the worker reaches CoreDNS on the control plane.
// Then the worker is reset, its lab network goes, and it joins again.
func TestLabImageWorkerJoins(t *testing.T) {
	needNodeTools(t)
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	r := newRig(t, ctx)
	cp := r.boot("fleet-cp1", 2)
	w := r.boot("fleet-w1", 3)
	endpoint := cp.ip + ":6443"
	cc, wc := cp.cluster("control-plane", endpoint), w.cluster("worker", endpoint)
	cp.prepare(cc)
	w.prepare(wc)

	start := time.Now()
	s, err := cp.agent.KubeadmInit(ctx, &agentv1.KubeadmInitRequest{Cluster: cc})
	init := cp.succeed("kubeadm init", s, err).GetKubeadmInit()
	r.tm.add("kubeadm init", time.Since(start))
	start = time.Now()
	js, err := w.agent.KubeadmJoin(ctx, &agentv1.KubeadmJoinRequest{Cluster: wc, ApiServerEndpoint: init.GetApiServerEndpoint(), Token: init.GetJoinToken(), CaHash: init.GetCaHash()})
	w.succeed("kubeadm join", js, err)
	r.tm.add("kubeadm join", time.Since(start))

	start = time.Now()
	cp.waitReadyDNS(cc)
	w.waitReadyDNS(wc)
	r.tm.add("both Ready + DNS", time.Since(start))
	// Each host routes the other's pod CIDR via the other's address.
	// kiln-lab-net adds the routes in a loop (every 3 s, each pass a few
	// kubectl calls), so the control plane's route to a node that just
	// joined can come a few seconds after that node is Ready: wait for it.
	for _, pair := range [][2]*node{{cp, w}, {w, cp}} {
		from, via := pair[0], pair[1]
		waitFor(t, ctx, time.Minute, from.name+"'s route via "+via.name+" to its pods", func() (bool, string) {
			out := from.exec("ip", "-4", "route", "show")
			for _, l := range strings.Split(out, "\n") {
				if strings.HasPrefix(l, "10.244.") && strings.Contains(l, " via "+via.ip+" ") {
					return true, ""
				}
			}
			return false, "routes:\n" + out
		}, func() string { return from.exec("journalctl", "-u", "kiln-lab-net", "--no-pager", "-n", "20") })
	}
	nodes := cp.exec("kubectl", "--kubeconfig", "/etc/kubernetes/admin.conf", "get", "nodes", "-o", "wide")
	t.Logf("nodes:\n%s", nodes)

	// Reset the worker (what remediation does before a rejoin): the lab
	// network goes with it, so Preflight passes again (a route left inside
	// the pod CIDR would fail it), and the host joins and is Ready again.
	start = time.Now()
	rs, err := w.agent.KubeadmReset(ctx, &agentv1.KubeadmResetRequest{})
	w.succeed("kubeadm reset", rs, err)
	waitFor(t, ctx, time.Minute, "fleet-w1's lab network removed after the reset", func() (bool, string) {
		routes := w.exec("ip", "-4", "route", "show", "proto", golden.LabRouteProto)
		links := w.exec("ip", "-o", "link", "show")
		conf := w.exec("ls", "/etc/cni/net.d")
		return strings.TrimSpace(routes) == "" && !strings.Contains(links, "cni0") && !strings.Contains(conf, "kiln-lab"),
			"routes: " + routes + "; links: " + links + "; CNI configs: " + conf
	}, func() string { return w.exec("journalctl", "-u", "kiln-lab-net", "--no-pager", "-n", "20") })
	r.tm.add("reset worker, lab network gone", time.Since(start))
	cp.exec("kubectl", "--kubeconfig", "/etc/kubernetes/admin.conf", "delete", "node", w.name)
	w.prepare(wc)
	start = time.Now()
	js, err = w.agent.KubeadmJoin(ctx, &agentv1.KubeadmJoinRequest{Cluster: wc, ApiServerEndpoint: init.GetApiServerEndpoint(), Token: init.GetJoinToken(), CaHash: init.GetCaHash()})
	w.succeed("kubeadm join again", js, err)
	w.waitReadyDNS(wc)
	r.tm.add("rejoin to Ready + DNS", time.Since(start))
}

// closeHost powers the host off gracefully (as a BMC would), removes its
// namespace and veth, and checks nothing it tracked is left: no loop
// device on its disk, no cgroup, no namespace.
func closeHost(t *testing.T, h *netns.Machine, tracked []netns.Resource) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	start := time.Now()
	if err := h.PowerOff(ctx, true); err != nil {
		t.Errorf("power off: %v", err)
	}
	t.Logf("graceful power off: %.1fs", time.Since(start).Seconds())
	if err := h.Close(ctx); err != nil {
		t.Errorf("close host: %v", err)
	}
	if out, _ := exec.Command("losetup", "-j", h.DiskPath()).Output(); len(strings.TrimSpace(string(out))) > 0 {
		t.Errorf("loop device left on the disk: %s", out)
	}
	for _, r := range tracked {
		var left bool
		switch r.Kind {
		case netns.KindNetns:
			_, err := os.Stat("/run/netns/" + r.Value)
			left = err == nil
		case netns.KindCgroup, netns.KindDir:
			_, err := os.Stat(r.Value)
			left = err == nil
		case netns.KindPID:
			left = netns.ProcessAlive(r.Value)
		}
		if left {
			t.Errorf("left behind after power off and close: %s %s", r.Kind, r.Value)
			if err := netns.Remove(ctx, r); err != nil {
				t.Errorf("remove %s %s: %v", r.Kind, r.Value, err)
			}
		}
	}
}

// node is the booted host seen through its agent.
type node struct {
	t        *testing.T
	ctx      context.Context
	tm       *timings
	name, ip string
	h        *netns.Machine
	agent    agentv1.AgentClient
	log      string
}

// exec runs a command inside the host (all its namespaces) and returns
// its output, or the error text. Equivalent to `nsenter -t LEADER -a CMD`.
func (n *node) exec(name string, args ...string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l := n.h.Leader()
	if l == 0 {
		return "host not running"
	}
	out, err := exec.CommandContext(ctx, "nsenter", append([]string{"-t", strconv.Itoa(l), "-a", name}, args...)...).CombinedOutput()
	if err != nil {
		return fmt.Sprintf("%s (%v)", out, err)
	}
	return string(out)
}

// diagnose is what explains a node that does not come up.
func (n *node) diagnose() string {
	var b strings.Builder
	for _, c := range [][]string{
		{"systemctl", "--failed", "--no-pager"},
		{"journalctl", "-u", "kiln-lab-net", "--no-pager", "-n", "20"},
		{"journalctl", "-u", "kubelet", "--no-pager", "-n", "40"},
		{"journalctl", "-u", "containerd", "--no-pager", "-n", "20"},
		{"crictl", "ps", "-a"},
		{"ls", "/etc/cni/net.d"},
	} {
		fmt.Fprintf(&b, "\n$ %s\n%s", strings.Join(c, " "), n.exec(c[0], c[1:]...))
	}
	return b.String()
}

type recver interface {
	Recv() (*agentv1.OperationEvent, error)
}

// succeed reads an operation's events to the terminal one (logging them
// to n.log) and fails the test unless it succeeded.
func (n *node) succeed(what string, s recver, err error) *agentv1.OperationEvent {
	t := n.t
	t.Helper()
	require.NoError(t, err, what)
	f, ferr := os.OpenFile(n.log, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	require.NoError(t, ferr)
	defer f.Close()
	fmt.Fprintf(f, "=== %s\n", what)
	var last *agentv1.OperationEvent
	for {
		ev, err := s.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err, "%s: stream", what)
		fmt.Fprintf(f, "%s %s%s\n", ev.GetState(), ev.GetMessage(), ev.GetError())
		last = ev
	}
	require.NotNil(t, last, "%s: no events", what)
	if last.GetState() != agentv1.OperationState_OPERATION_STATE_SUCCEEDED {
		b, _ := os.ReadFile(n.log)
		t.Fatalf("%s: %s = %s: %s\n%s\n%s", n.name, what, last.GetState(), last.GetError(), tail(string(b), 40), n.diagnose())
	}
	return last
}

func describe(r *agentv1.ProbeResponse) string {
	var b strings.Builder
	for _, c := range r.GetConditions() {
		fmt.Fprintf(&b, "\n  %s=%s %s: %s", c.GetType(), c.GetStatus(), c.GetReason(), c.GetMessage())
	}
	return b.String()
}

// waitFor polls cond every second until it holds, failing after d with its
// last detail and what diagnose says.
func waitFor(t *testing.T, ctx context.Context, d time.Duration, what string, cond func() (bool, string), diagnose func() string) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		ok, detail := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			t.Fatalf("waiting %s for %s: %s\n%s", d, what, detail, diagnose())
		}
		time.Sleep(time.Second)
	}
}

func consoleTail(h *netns.Machine) string {
	b, _ := os.ReadFile(h.ConsoleLog())
	return tail(string(b), 30)
}

func tail(s string, n int) string {
	ls := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(ls[max(0, len(ls)-n):], "\n")
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
