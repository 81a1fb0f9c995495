package kube

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	kubeletv1beta1 "k8s.io/kubelet/config/v1beta1"
	"sigs.k8s.io/yaml"

	"github.com/kilnhq/kiln/agent/identity"
	"github.com/kilnhq/kiln/agent/probe"
	"github.com/kilnhq/kiln/imagebuilder/golden"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/pki"
	"github.com/kilnhq/kiln/internal/testenv"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Lab addresses. The pod and service CIDRs do not overlap the bridge.
const (
	netPrefix   = "10.252.0"
	podCIDR     = "172.20.0.0/16"
	serviceCIDR = "172.21.0.0/16"
	agentPort   = "7441"
)

func requireTools(t *testing.T) (binDir, imagesDir string) {
	t.Helper()
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root: boots systemd-nspawn nodes in network namespaces")
	}
	for _, tool := range []string{"systemd-nspawn", "nft", "ip", "nsenter", "mount"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (Debian packages systemd-container, nftables, iproute2, util-linux)", tool)
		}
	}
	if _, err := os.Stat("/sys/fs/cgroup/memory"); err != nil {
		testenv.Skip(t, "needs the cgroup v1 hierarchy the lab nodes were proven with")
	}
	cache := kubetools.Cache{Dir: filepath.Join(rootfs.CacheRoot(), "kube-tools")}
	rel := kubetools.Pinned()
	binDir, imagesDir = cache.BinDir(rel), cache.ImagesDir(rel)
	if d := os.Getenv("KILN_KUBE_TOOLS_DIR"); d != "" { // a release directory elsewhere
		binDir, imagesDir = filepath.Join(d, "bin"), filepath.Join(d, "images")
	}
	for _, f := range []string{filepath.Join(binDir, "kubeadm"), filepath.Join(binDir, "kubelet"), filepath.Join(binDir, "kubectl"), filepath.Join(imagesDir, "kube-apiserver.tar")} {
		if _, err := os.Stat(f); err != nil {
			testenv.Skipf(t, "kube-tools cache incomplete (%s missing): run make kube-tools", f)
		}
	}
	return binDir, imagesDir
}

// baseRoot returns the cached Debian root of the nodes, building it when
// debootstrap is available.
func baseRoot(t *testing.T, ctx context.Context) string {
	t.Helper()
	spec := rootfs.Spec{Packages: golden.NodePackages}
	if _, err := os.Stat(spec.Dir()); err != nil {
		if _, err := exec.LookPath("debootstrap"); err != nil {
			testenv.Skipf(t, "no cached node root (%s) and no debootstrap to build one", spec.Dir())
		}
		t.Logf("building the node root (debootstrap, a few minutes)")
	}
	dir, err := rootfs.Build(ctx, spec, io.Discard)
	require.NoError(t, err)
	return dir
}

// buildAgent builds a static kiln-agent for the nodes.
func buildAgent(t *testing.T, ctx context.Context, dst string) {
	t.Helper()
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	cmd := exec.CommandContext(ctx, goBin, "build", "-o", dst, "github.com/kilnhq/kiln/cmd/kiln-agent")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build kiln-agent: %s", out)
}

// linkOrCopy hard-links src to dst, copying when they are on different
// file systems.
func linkOrCopy(src, dst string, mode os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	if real, err := filepath.EvalSymlinks(src); err == nil {
		src = real
	}
	if err := os.Link(src, dst); err == nil {
		return nil
	}
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, mode)
}

func writeFile(t *testing.T, root, p, content string, mode os.FileMode) {
	t.Helper()
	full := filepath.Join(root, p)
	require.NoError(t, os.MkdirAll(filepath.Dir(full), 0o755))
	require.NoError(t, os.WriteFile(full, []byte(content), mode))
}

const agentUnit = `[Unit]
Description=Kiln host agent
After=network.target

[Service]
ExecStart=/usr/local/bin/kiln-agent run --data-dir /var/lib/kiln-agent --listen :` + agentPort + ` --heartbeat-interval 1h
Restart=always
RestartSec=2

[Install]
WantedBy=multi-user.target
`

// containerd 1.6 config of a node without CAP_SYS_RESOURCE; Prepare
// keeps SystemdCgroup matching the kubelet's driver.
const containerdConfig = `version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10.1"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/etc/cni/net.d"
`

func cniConfig(subnet string) string {
	return `{
  "cniVersion": "1.0.0",
  "name": "kilnlab",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "` + subnet + `"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`
}

// labNode is a node with its agent client.
type labNode struct {
	*Node
	IP, PodSubnet string
	agent         agentv1.AgentClient
}

func (n *labNode) cluster(role string) *agentv1.ClusterConfig {
	return &agentv1.ClusterConfig{
		Name:                 "kilnlab",
		KubernetesVersion:    kubetools.Pinned().Kubernetes,
		PodCidr:              podCIDR,
		ServiceCidr:          serviceCIDR,
		ControlPlaneEndpoint: netPrefix + ".2:6443",
		DnsDomain:            "cluster.local",
		CgroupDriver:         "cgroupfs",
		Role:                 role,
		NodeName:             n.Name,
		AdvertiseAddress:     n.IP,
	}
}

type recver interface {
	Recv() (*agentv1.OperationEvent, error)
}

// finish reads an operation's events to its terminal one, writing every
// message to the node's log file, and returns the terminal event.
func (n *labNode) finish(t *testing.T, name string, s recver, err error) *agentv1.OperationEvent {
	t.Helper()
	require.NoError(t, err, "%s %s", n.Name, name)
	f, ferr := os.OpenFile(filepath.Join(n.Dir, "operations.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	require.NoError(t, ferr)
	defer f.Close()
	fmt.Fprintf(f, "=== %s %s\n", time.Now().Format(time.RFC3339), name)
	var last *agentv1.OperationEvent
	for {
		ev, err := s.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err, "%s %s: stream", n.Name, name)
		fmt.Fprintf(f, "%s %s%s\n", ev.GetState(), ev.GetMessage(), ev.GetError())
		last = ev
	}
	require.NotNil(t, last, "%s %s: no events", n.Name, name)
	return last
}

func (n *labNode) succeed(t *testing.T, name string, s recver, err error) *agentv1.OperationEvent {
	t.Helper()
	ev := n.finish(t, name, s, err)
	if ev.GetState() != agentv1.OperationState_OPERATION_STATE_SUCCEEDED {
		b, _ := os.ReadFile(filepath.Join(n.Dir, "operations.log"))
		t.Errorf("%s %s = %s: %s\n%s", n.Name, name, ev.GetState(), ev.GetError(), tail(string(b), 40))
		n.diagnose(t)
		t.FailNow()
	}
	return ev
}

// diagnose logs what explains a failed step: the kubelet's and
// containerd's recent journal and the containers.
func (n *labNode) diagnose(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, c := range [][]string{
		{"journalctl", "-u", "kubelet", "--no-pager", "-n", "60"},
		{"journalctl", "-u", "containerd", "--no-pager", "-n", "30"},
		{"ctr", "-n", "k8s.io", "containers", "ls"},
		{"ctr", "-n", "k8s.io", "tasks", "ls"},
		{"systemctl", "--failed", "--no-pager"},
	} {
		out, err := n.Exec(ctx, c[0], c[1:]...)
		t.Logf("%s: %s (%v):\n%s", n.Name, strings.Join(c, " "), err, out)
	}
}

// waitHealthy probes the node through its agent until every condition is
// True, and returns the last response.
func (n *labNode) waitHealthy(t *testing.T, ctx context.Context, c *agentv1.ClusterConfig) *agentv1.ProbeResponse {
	t.Helper()
	var last *agentv1.ProbeResponse
	for {
		pctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		resp, err := n.agent.Probe(pctx, &agentv1.ProbeRequest{Cluster: c})
		cancel()
		if err == nil {
			last = resp
			if resp.GetHealthy() {
				return resp
			}
		}
		select {
		case <-ctx.Done():
			t.Errorf("%s did not become healthy: last probe %v (err %v)", n.Name, describe(last), err)
			n.diagnose(t)
			t.FailNow()
		case <-time.After(2 * time.Second):
		}
	}
}

func describe(r *agentv1.ProbeResponse) string {
	var b strings.Builder
	for _, c := range r.GetConditions() {
		fmt.Fprintf(&b, "\n  %s=%s %s: %s", c.GetType(), c.GetStatus(), c.GetReason(), c.GetMessage())
	}
	return b.String()
}

// kubectl runs the pinned kubectl against the cluster.
func kubectl(ctx context.Context, bin, kubeconfig, stdin string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "kubectl"), append([]string{"--kubeconfig", kubeconfig}, args...)...)
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

var (
	forwardBlock = regexp.MustCompile(`(?s)\n[ \t]*forward \. /etc/resolv\.conf \{.*?\}`)
	loopLine     = regexp.MustCompile(`\n[ \t]*loop[ \t]*\n`)
)

// offlineCoreDNS removes forward and loop from CoreDNS's Corefile, so that
// cluster DNS never asks an upstream resolver (the lab's network rule).
func offlineCoreDNS(ctx context.Context, bin, kubeconfig string) error {
	out, err := kubectl(ctx, bin, kubeconfig, "", "-n", "kube-system", "get", "configmap", "coredns", "-o", "json")
	if err != nil {
		return err
	}
	var cm map[string]any
	if err := json.Unmarshal([]byte(out), &cm); err != nil {
		return err
	}
	data, _ := cm["data"].(map[string]any)
	corefile, _ := data["Corefile"].(string)
	patched := loopLine.ReplaceAllString(forwardBlock.ReplaceAllString(corefile, ""), "\n")
	if strings.Contains(patched, "forward") || strings.Contains(patched, "\n    loop") {
		return fmt.Errorf("corefile still forwards:\n%s", patched)
	}
	data["Corefile"] = patched
	b, err := json.Marshal(cm)
	if err != nil {
		return err
	}
	_, err = kubectl(ctx, bin, kubeconfig, string(b), "replace", "-f", "-")
	return err
}

// TestKubeadmTwoNodes drives kubeadm through the agent API on two
// systemd-nspawn nodes: Prepare, Preflight, init, a refused version
// mismatch, a refused wrong CA hash, join, both nodes healthy with a real
// cluster DNS answer, reset of the worker and a second join.
// lab is the setup the tests share.
type lab struct {
	binDir, imagesDir, work string
	nodes                   []*labNode
	step                    func(name string, start time.Time)
}

// startLab boots count nodes (kiln-kn1, kiln-kn2, ...) with their agents
// answering, and registers their teardown.
func startLab(t *testing.T, ctx context.Context, count int) *lab {
	t.Helper()
	binDir, imagesDir := requireTools(t)
	var times []string
	step := func(name string, start time.Time) {
		d := time.Since(start)
		times = append(times, fmt.Sprintf("| %s | %.1f s |", name, d.Seconds()))
		t.Logf("%-28s %6.1fs", name, d.Seconds())
	}
	t.Cleanup(func() { t.Logf("times:\n%s", strings.Join(times, "\n")) })

	start := time.Now()
	base := baseRoot(t, ctx)
	step("node root (cached)", start)

	// The layer every node shares above the Debian root: the pinned
	// Kubernetes binaries, the agent, units, containerd's config.
	work := t.TempDir()
	layer := filepath.Join(work, "layer")
	start = time.Now()
	buildAgent(t, ctx, filepath.Join(layer, "usr/local/bin/kiln-agent"))
	step("build kiln-agent", start)
	for _, b := range []string{"kubeadm", "kubelet", "kubectl"} {
		require.NoError(t, linkOrCopy(filepath.Join(binDir, b), filepath.Join(layer, "usr/bin", b), 0o755))
	}
	writeFile(t, layer, "etc/systemd/system/kubelet.service", golden.KubeletUnitFile, 0o644)
	writeFile(t, layer, "etc/systemd/system/kubelet.service.d/10-kubeadm.conf", golden.KubeadmDropIn, 0o644)
	writeFile(t, layer, "etc/systemd/system/cgroup-rw.service", golden.CgroupRWUnitFile, 0o644)
	writeFile(t, layer, "etc/systemd/system/kiln-agent.service", agentUnit, 0o644)
	// The kubelet's kernel defaults, shown inside the node only (as the
	// golden lab image does).
	writeFile(t, layer, "etc/systemd/system/"+golden.LabSysctlUnit, golden.LabSysctlUnitFile(), 0o644)
	for _, kv := range golden.LabSysctls {
		writeFile(t, layer, strings.TrimPrefix(golden.LabSysctlDir, "/")+"/"+kv[0], kv[1]+"\n", 0o444)
	}
	require.NoError(t, os.MkdirAll(filepath.Join(layer, "etc/systemd/system/sysinit.target.wants"), 0o755))
	require.NoError(t, os.Symlink("/etc/systemd/system/cgroup-rw.service", filepath.Join(layer, "etc/systemd/system/sysinit.target.wants/cgroup-rw.service")))
	require.NoError(t, os.Symlink("/etc/systemd/system/"+golden.LabSysctlUnit, filepath.Join(layer, "etc/systemd/system/sysinit.target.wants", golden.LabSysctlUnit)))
	require.NoError(t, os.MkdirAll(filepath.Join(layer, "etc/systemd/system/multi-user.target.wants"), 0o755))
	require.NoError(t, os.Symlink("/etc/systemd/system/kiln-agent.service", filepath.Join(layer, "etc/systemd/system/multi-user.target.wants/kiln-agent.service")))
	// The lab image's kubeadm patch: the nodes' disk is the machine's.
	writeFile(t, layer, strings.TrimPrefix(golden.LabKubeletPatchFile, "/"), golden.LabKubeletPatch, 0o644)
	writeFile(t, layer, "etc/containerd/config.toml", containerdConfig, 0o644)
	hosts := "127.0.0.1 localhost\n" + netPrefix + ".2 kiln-kn1\n" + netPrefix + ".3 kiln-kn2\n"
	writeFile(t, layer, "etc/hosts", hosts, 0o644)

	// Network: guard first, then bridge and namespaces.
	// Names unique to this run, so that runs and other labs never share them.
	suffix := strconv.Itoa(os.Getpid() % 100000)
	lnet, err := NewNet(ctx, "kkb"+suffix, netPrefix, "kilnkube"+suffix)
	t.Cleanup(func() {
		if err := lnet.Close(); err != nil {
			t.Errorf("network teardown: %v", err)
		}
	})
	require.NoError(t, err)

	// A test CA stands in for the controller's: it issues each agent's
	// identity and the controller-role client certificate.
	ca, err := pki.NewCA("kiln-e2e-kube", time.Now())
	require.NoError(t, err)
	certPEM, keyPEM, err := ca.Issue(pki.RoleController, pki.ControllerName, nil, time.Hour, time.Now())
	require.NoError(t, err)
	clientCert, err := tls.X509KeyPair(certPEM, keyPEM)
	require.NoError(t, err)

	var nodes []*labNode
	for i := range count {
		nodes = append(nodes, &labNode{IP: fmt.Sprintf("%s.%d", netPrefix, i+2), PodSubnet: fmt.Sprintf("172.20.%d.0/24", i)})
	}
	for i, n := range nodes {
		name := fmt.Sprintf("kiln-kn%d", i+1)
		n.Node = &Node{
			Name: name, NetNS: name + "-" + suffix, Dir: filepath.Join(work, name),
			Lower: []string{layer, base},
			Binds: []string{"--bind-ro=" + imagesDir + ":/opt/kiln-images"},
		}
		require.NoError(t, lnet.AddNode(ctx, n.NetNS, i+2))
		require.NoError(t, n.Mount(ctx))
		t.Cleanup(func() {
			if err := n.Stop(); err != nil {
				t.Errorf("node %s teardown: %v", n.Name, err)
			}
		})
		writeFile(t, n.Root, "etc/hostname", name+"\n", 0o644)
		writeFile(t, n.Root, "etc/machine-id", fmt.Sprintf("%032x\n", time.Now().UnixNano()+int64(i)), 0o444)
		// Each node's pod subnet, and the other node's through it.
		writeFile(t, n.Root, "etc/cni/net.d/10-kilnlab.conflist", cniConfig(n.PodSubnet), 0o644)
		keyPEM, csr, err := pki.NewKeyAndCSR(name)
		require.NoError(t, err)
		agentCert, err := ca.SignCSR(csr, pki.RoleAgent, name, time.Hour, time.Now(), pki.WithHosts(n.IP))
		require.NoError(t, err)
		_, err = identity.Save(filepath.Join(n.Root, "var/lib/kiln-agent"), identity.Files{
			KeyPEM: keyPEM, CertPEM: agentCert, CAPEM: ca.CertPEM(),
			Controller: identity.Controller{Address: "127.0.0.1:9", CAHash: ca.Hash(), Host: name},
		})
		require.NoError(t, err)
	}

	for _, n := range nodes {
		d, err := n.Boot(ctx)
		require.NoError(t, err)
		step("boot "+n.Name, time.Now().Add(-d))
		conf := &tls.Config{RootCAs: ca.Pool(), ServerName: n.IP, Certificates: []tls.Certificate{clientCert}, MinVersion: tls.VersionTLS13}
		conn, err := grpc.NewClient(n.IP+":"+agentPort, grpc.WithTransportCredentials(credentials.NewTLS(conf)),
			// A lost lab network fails the stream instead of hanging it.
			grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 15 * time.Second, Timeout: 10 * time.Second, PermitWithoutStream: true}))
		require.NoError(t, err)
		t.Cleanup(func() { conn.Close() })
		n.agent = agentv1.NewAgentClient(conn)
	}
	// The agents answer.
	for _, n := range nodes {
		start = time.Now()
		for {
			fctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			_, err := n.agent.Facts(fctx, &agentv1.FactsRequest{})
			cancel()
			if err == nil {
				break
			}
			if time.Since(start) > 60*time.Second {
				out, _ := n.Exec(ctx, "journalctl", "-u", "kiln-agent", "--no-pager", "-n", "30")
				t.Fatalf("agent on %s does not answer: %v\n%s", n.Name, err, out)
			}
			time.Sleep(500 * time.Millisecond)
		}
		step("agent up "+n.Name, start)
	}

	return &lab{binDir: binDir, imagesDir: imagesDir, work: work, nodes: nodes, step: step}
}

func TestKubeadmTwoNodes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	l := startLab(t, ctx, 2)
	binDir, imagesDir, work, nodes, step := l.binDir, l.imagesDir, l.work, l.nodes, l.step
	var start time.Time
	cp, worker := nodes[0], nodes[1]
	for i, n := range nodes {
		role := "control-plane"
		if i == 1 {
			role = "worker"
		}
		start = time.Now()
		s, err := n.agent.Prepare(ctx, &agentv1.PrepareRequest{CgroupDriver: "cgroupfs"})
		n.succeed(t, "prepare", s, err)
		step("prepare "+n.Name, start)
		rep, err := n.agent.Preflight(ctx, &agentv1.PreflightRequest{Cluster: n.cluster(role)})
		require.NoError(t, err)
		for _, c := range rep.GetChecks() {
			if !c.GetPassed() {
				t.Logf("%s preflight %s (%s): %s; fix: %s", n.Name, c.GetName(), c.GetSeverity(), c.GetMessage(), c.GetFix())
			}
		}
		require.True(t, rep.GetPassed(), "%s preflight failed", n.Name)
	}

	// Routes to the other node's pods, as a CNI's host-gw mode would add
	// them once the node is in the cluster (Preflight rightly refuses a
	// host route inside the pod CIDR).
	for i, n := range nodes {
		o := nodes[1-i]
		_, err := run(ctx, "ip", "-n", n.NetNS, "route", "add", o.PodSubnet, "via", o.IP)
		require.NoError(t, err)
	}

	// Offline images: everything on the control plane, what runs on
	// every node on the worker.
	start = time.Now()
	imgs, err := filepath.Glob(filepath.Join(imagesDir, "*.tar"))
	require.NoError(t, err)
	for _, img := range imgs {
		_, err := cp.Exec(ctx, "ctr", "-n", "k8s.io", "images", "import", "/opt/kiln-images/"+filepath.Base(img))
		require.NoError(t, err)
	}
	step("image import "+cp.Name, start)
	start = time.Now()
	for _, img := range []string{"pause.tar", "kube-proxy.tar", "coredns.tar"} {
		_, err := worker.Exec(ctx, "ctr", "-n", "k8s.io", "images", "import", "/opt/kiln-images/"+img)
		require.NoError(t, err)
	}
	step("image import "+worker.Name, start)

	// init
	start = time.Now()
	s, err := cp.agent.KubeadmInit(ctx, &agentv1.KubeadmInitRequest{Cluster: cp.cluster("control-plane")})
	ev := cp.succeed(t, "kubeadm init", s, err)
	step("kubeadm init", start)
	init := ev.GetKubeadmInit()
	require.NotNil(t, init, "init result")
	_, err = pki.ParseHash(init.GetCaHash())
	require.NoError(t, err)
	require.Equal(t, netPrefix+".2:6443", init.GetApiServerEndpoint())
	b, err := os.ReadFile(filepath.Join(cp.Root, "etc/kubernetes/pki/ca.crt"))
	require.NoError(t, err)
	caCerts := pemCertsOf(t, b)
	if got := pki.Hash(caCerts[0]); got != init.GetCaHash() {
		t.Errorf("KubeadmInit CA hash = %s, want %s (from the node's ca.crt)", init.GetCaHash(), got)
	}
	admin := filepath.Join(work, "admin.conf")
	require.NoError(t, os.WriteFile(admin, []byte(init.GetKubeconfig()), 0o600))
	require.NoError(t, offlineCoreDNS(ctx, binDir, admin))

	// A version the host does not have is refused before kubeadm runs.
	wrongVersion := worker.cluster("worker")
	wrongVersion.KubernetesVersion = "v1.34.3"
	s, err = worker.agent.KubeadmJoin(ctx, &agentv1.KubeadmJoinRequest{Cluster: wrongVersion, ApiServerEndpoint: init.GetApiServerEndpoint(), Token: init.GetJoinToken(), CaHash: init.GetCaHash()})
	ev = worker.finish(t, "kubeadm join (version mismatch)", s, err)
	if ev.GetState() != agentv1.OperationState_OPERATION_STATE_FAILED || !strings.Contains(ev.GetError(), "kubeadm version mismatch: v1.34.4 is installed, the cluster pins v1.34.3") {
		t.Errorf("KubeadmJoin(v1.34.3) = %s %q, want FAILED with the version mismatch", ev.GetState(), ev.GetError())
	}
	// A CA hash that is not the cluster's is refused by kubeadm.
	otherCA, err := pki.NewCA("not-the-cluster", time.Now())
	require.NoError(t, err)
	start = time.Now()
	s, err = worker.agent.KubeadmJoin(ctx, &agentv1.KubeadmJoinRequest{Cluster: worker.cluster("worker"), ApiServerEndpoint: init.GetApiServerEndpoint(), Token: init.GetJoinToken(), CaHash: otherCA.Hash()})
	ev = worker.finish(t, "kubeadm join (wrong CA hash)", s, err)
	step("wrong CA hash refused", start)
	if ev.GetState() != agentv1.OperationState_OPERATION_STATE_FAILED || !strings.Contains(ev.GetError(), "are pinned") {
		t.Errorf("KubeadmJoin(wrong CA hash) = %s %q, want FAILED with kubeadm's pin error", ev.GetState(), ev.GetError())
	}
	if strings.Contains(ev.GetError(), init.GetJoinToken()) {
		t.Errorf("KubeadmJoin error contains the join token")
	}

	join := func(label string) {
		start := time.Now()
		s, err := worker.agent.KubeadmJoin(ctx, &agentv1.KubeadmJoinRequest{Cluster: worker.cluster("worker"), ApiServerEndpoint: init.GetApiServerEndpoint(), Token: init.GetJoinToken(), CaHash: init.GetCaHash()})
		worker.succeed(t, "kubeadm join", s, err)
		step(label, start)
	}
	join("kubeadm join")

	start = time.Now()
	wctx, wcancel := context.WithTimeout(ctx, 5*time.Minute)
	cpProbe := cp.waitHealthy(t, wctx, cp.cluster("control-plane"))
	wProbe := worker.waitHealthy(t, wctx, worker.cluster("worker"))
	wcancel()
	step("both nodes healthy", start)
	t.Logf("%s probe:%s", cp.Name, describe(cpProbe))
	t.Logf("%s probe:%s", worker.Name, describe(wProbe))
	for _, r := range []*agentv1.ProbeResponse{cpProbe, wProbe} {
		dns := conditions.Get(r.GetConditions(), probe.ClusterDNSResolves)
		if dns == nil || dns.GetStatus() != conditions.True || !strings.Contains(dns.GetMessage(), "= 172.21.0.1") {
			t.Errorf("ClusterDNSResolves = %v, want True from a real answer 172.21.0.1", dns)
		}
	}
	if conditions.Get(cpProbe.GetConditions(), probe.EtcdMemberHealthy) == nil {
		t.Errorf("control plane probe lacks %s", probe.EtcdMemberHealthy)
	}

	// Reset the worker: the node's Kubernetes state is gone.
	start = time.Now()
	s, err = worker.agent.KubeadmReset(ctx, &agentv1.KubeadmResetRequest{})
	worker.succeed(t, "kubeadm reset", s, err)
	step("kubeadm reset", start)
	for _, f := range []string{"etc/kubernetes/kubelet.conf", "etc/kubernetes/pki/ca.crt", "var/lib/kubelet/config.yaml", "etc/kiln/kubeadm/join.yaml"} {
		if _, err := os.Stat(filepath.Join(worker.Root, f)); !os.IsNotExist(err) {
			t.Errorf("after KubeadmReset %s still has %s (%v)", worker.Name, f, err)
		}
	}
	r, err := worker.agent.Probe(ctx, &agentv1.ProbeRequest{Cluster: worker.cluster("worker"), Skip: []string{probe.ClusterDNSResolves}})
	require.NoError(t, err)
	if c := conditions.Get(r.GetConditions(), probe.CertificatesValid); c.GetReason() != "NoCertificates" {
		t.Errorf("after reset CertificatesValid = %s/%s, want NoCertificates", c.GetStatus(), c.GetReason())
	}
	// The controller deletes the Node object of a host it resets; then
	// the same host joins again.
	_, err = kubectl(ctx, binDir, admin, "", "delete", "node", worker.Name)
	require.NoError(t, err)
	join("kubeadm join again")
	start = time.Now()
	wctx, wcancel = context.WithTimeout(ctx, 5*time.Minute)
	worker.waitHealthy(t, wctx, worker.cluster("worker"))
	wcancel()
	step("rejoined worker healthy", start)
	out, err := kubectl(ctx, binDir, admin, "", "get", "nodes", "-o", "wide")
	require.NoError(t, err)
	t.Logf("nodes:\n%s", out)

	// Reset the control plane, removing its etcd member first (the only
	// member here: kubeadm keeps the data of a last member's cluster out
	// of the way and resets).
	start = time.Now()
	s, err = cp.agent.KubeadmReset(ctx, &agentv1.KubeadmResetRequest{RemoveEtcdMember: true})
	cp.succeed(t, "kubeadm reset (control plane)", s, err)
	step("kubeadm reset control plane", start)
	logb, err := os.ReadFile(filepath.Join(cp.Dir, "operations.log"))
	require.NoError(t, err)
	if !strings.Contains(string(logb), "removing this node's etcd member") {
		t.Errorf("control-plane reset did not remove the etcd member first")
	}
	for _, f := range []string{"etc/kubernetes/manifests/etcd.yaml", "etc/kubernetes/admin.conf", "etc/kubernetes/pki/ca.crt"} {
		if _, err := os.Stat(filepath.Join(cp.Root, f)); !os.IsNotExist(err) {
			t.Errorf("after KubeadmReset %s still has %s (%v)", cp.Name, f, err)
		}
	}
}

func pemCertsOf(t *testing.T, b []byte) []*x509Certificate {
	t.Helper()
	certs := parsePEMCerts(b)
	require.NotEmpty(t, certs)
	return certs
}

// waitCondition probes n until cond reports the wanted status and reason,
// and returns it.
func (n *labNode) waitCondition(t *testing.T, ctx context.Context, c *agentv1.ClusterConfig, cond, status, reason string) *typesv1.Condition {
	t.Helper()
	var last *typesv1.Condition
	for {
		pctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		resp, err := n.agent.Probe(pctx, &agentv1.ProbeRequest{Cluster: c})
		cancel()
		if err == nil {
			last = conditions.Get(resp.GetConditions(), cond)
			if last.GetStatus() == status && last.GetReason() == reason {
				return last
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s: %s did not become %s/%s: last %v (err %v)", n.Name, cond, status, reason, last, err)
		case <-time.After(2 * time.Second):
		}
	}
}

// TestKubeadmCloudProviderExternal: a cluster with an external cloud
// provider starts its nodes tainted uninitialized; with no
// cloud-controller-manager running, Probe says so and how to fix the
// CCM's scheduling (the deadlock of a CCM that cannot schedule onto
// uninitialised, not-ready control planes); once the taint is gone (what
// a CCM does), the condition turns True.
func TestKubeadmCloudProviderExternal(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	l := startLab(t, ctx, 1)
	n := l.nodes[0]
	c := n.cluster("control-plane")
	c.CloudProvider = "external"

	s, err := n.agent.Prepare(ctx, &agentv1.PrepareRequest{CgroupDriver: "cgroupfs"})
	n.succeed(t, "prepare", s, err)
	start := time.Now()
	imgs, err := filepath.Glob(filepath.Join(l.imagesDir, "*.tar"))
	require.NoError(t, err)
	for _, img := range imgs {
		_, err := n.Exec(ctx, "ctr", "-n", "k8s.io", "images", "import", "/opt/kiln-images/"+filepath.Base(img))
		require.NoError(t, err)
	}
	l.step("image import", start)
	start = time.Now()
	s, err = n.agent.KubeadmInit(ctx, &agentv1.KubeadmInitRequest{Cluster: c, UploadCerts: true})
	ev := n.succeed(t, "kubeadm init (cloud provider external, upload certs)", s, err)
	l.step("kubeadm init", start)
	res := ev.GetKubeadmInit()
	if len(res.GetCertificateKey()) != 64 {
		t.Errorf("KubeadmInit(upload_certs) certificate key = %d characters, want 64 hex digits", len(res.GetCertificateKey()))
	}
	logb, err := os.ReadFile(filepath.Join(n.Dir, "operations.log"))
	require.NoError(t, err)
	if strings.Contains(string(logb), res.GetCertificateKey()) || strings.Contains(string(logb), res.GetJoinToken()) {
		t.Errorf("the init operation's events contain the certificate key or the token")
	}
	admin := filepath.Join(l.work, "admin.conf")
	require.NoError(t, os.WriteFile(admin, []byte(res.GetKubeconfig()), 0o600))

	wctx, wcancel := context.WithTimeout(ctx, 3*time.Minute)
	defer wcancel()
	got := n.waitCondition(t, wctx, c, probe.CloudProviderInitialized, conditions.False, "CloudControllerManagerNotRunning")
	t.Logf("%s: %s", got.GetReason(), got.GetMessage())
	for _, want := range []string{"node.cloudprovider.kubernetes.io/uninitialized", "hostNetwork: true", "node.kubernetes.io/not-ready"} {
		if !strings.Contains(got.GetMessage(), want) {
			t.Errorf("CloudProviderInitialized message %q lacks %q", got.GetMessage(), want)
		}
	}
	// What a cloud-controller-manager does once it has initialised the node.
	_, err = kubectl(ctx, l.binDir, admin, "", "taint", "node", n.Name, "node.cloudprovider.kubernetes.io/uninitialized-")
	require.NoError(t, err)
	n.waitCondition(t, wctx, c, probe.CloudProviderInitialized, conditions.True, "Initialized")
}

// importImages imports image archives (all when names is empty) into the
// node's containerd.
//
// Equivalent to: `ctr -n k8s.io images import /opt/kiln-images/NAME.tar`.
func (n *labNode) importImages(t *testing.T, ctx context.Context, imagesDir string, names ...string) {
	t.Helper()
	if len(names) == 0 {
		all, err := filepath.Glob(filepath.Join(imagesDir, "*.tar"))
		require.NoError(t, err)
		for _, a := range all {
			names = append(names, filepath.Base(a))
		}
	}
	for _, img := range names {
		_, err := n.Exec(ctx, "ctr", "-n", "k8s.io", "images", "import", "/opt/kiln-images/"+img)
		require.NoError(t, err)
	}
}

// TestKubeadmControlPlaneJoin: a second control plane joins with the
// certificate key from an init with upload_certs (stacked etcd grows to
// two members); resetting it with remove_etcd_member takes its member out
// first, so the first control plane keeps a healthy etcd and API server
// (without the removal, a two-member etcd that loses one has no quorum).
func TestKubeadmControlPlaneJoin(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	l := startLab(t, ctx, 2)
	cp1, cp2 := l.nodes[0], l.nodes[1]
	for _, n := range l.nodes {
		s, err := n.agent.Prepare(ctx, &agentv1.PrepareRequest{CgroupDriver: "cgroupfs"})
		n.succeed(t, "prepare", s, err)
	}
	for i, n := range l.nodes {
		o := l.nodes[1-i]
		_, err := run(ctx, "ip", "-n", n.NetNS, "route", "add", o.PodSubnet, "via", o.IP)
		require.NoError(t, err)
	}
	start := time.Now()
	for _, n := range l.nodes {
		n.importImages(t, ctx, l.imagesDir)
	}
	l.step("image import (both)", start)

	start = time.Now()
	s, err := cp1.agent.KubeadmInit(ctx, &agentv1.KubeadmInitRequest{Cluster: cp1.cluster("control-plane"), UploadCerts: true})
	res := cp1.succeed(t, "kubeadm init", s, err).GetKubeadmInit()
	l.step("kubeadm init (upload certs)", start)
	admin := filepath.Join(l.work, "admin.conf")
	require.NoError(t, os.WriteFile(admin, []byte(res.GetKubeconfig()), 0o600))
	require.NoError(t, offlineCoreDNS(ctx, l.binDir, admin))

	start = time.Now()
	s, err = cp2.agent.KubeadmJoin(ctx, &agentv1.KubeadmJoinRequest{
		Cluster: cp2.cluster("control-plane"), ApiServerEndpoint: res.GetApiServerEndpoint(),
		Token: res.GetJoinToken(), CaHash: res.GetCaHash(), ControlPlane: true, CertificateKey: res.GetCertificateKey(),
	})
	cp2.succeed(t, "kubeadm join (control plane)", s, err)
	l.step("kubeadm join control plane", start)
	if _, err := os.Stat(filepath.Join(cp2.Root, "etc/kubernetes/manifests/etcd.yaml")); err != nil {
		t.Errorf("the joined control plane runs no etcd member: %v", err)
	}

	start = time.Now()
	wctx, wcancel := context.WithTimeout(ctx, 5*time.Minute)
	cp1.waitHealthy(t, wctx, cp1.cluster("control-plane"))
	p2 := cp2.waitHealthy(t, wctx, cp2.cluster("control-plane"))
	wcancel()
	l.step("both control planes healthy", start)
	if c := conditions.Get(p2.GetConditions(), probe.EtcdMemberHealthy); c.GetStatus() != conditions.True {
		t.Errorf("second control plane %s = %v, want True", probe.EtcdMemberHealthy, c)
	}
	// Both the node kubeadm init made and the one it joined run the
	// kubelet with the lab's patch: in the file kubeadm wrote and live.
	for _, n := range l.nodes {
		checkLabKubeletConfig(t, ctx, l, admin, n)
	}

	start = time.Now()
	s, err = cp2.agent.KubeadmReset(ctx, &agentv1.KubeadmResetRequest{RemoveEtcdMember: true})
	cp2.succeed(t, "kubeadm reset (remove etcd member)", s, err)
	l.step("kubeadm reset control plane 2", start)
	logb, err := os.ReadFile(filepath.Join(cp2.Dir, "operations.log"))
	require.NoError(t, err)
	t.Logf("reset of %s:\n%s", cp2.Name, tail(string(logb), 25))
	// The first control plane's etcd has one member again and quorum: a
	// linearizable member list (which needs a quorum) answers with cp1
	// alone. (Without the removal it would list two members, and then
	// fail once the two-member etcd lost its leader.)
	var members []string
	deadline := time.Now().Add(2 * time.Minute)
	for {
		members, err = cp1.etcdMembers(ctx)
		if err == nil && len(members) == 1 && members[0] == cp1.Name {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("etcd members of %s after removing the second = %v, %v; want [%s]", cp1.Name, members, err, cp1.Name)
		}
		time.Sleep(500 * time.Millisecond)
	}
	p1, err := cp1.agent.Probe(ctx, &agentv1.ProbeRequest{Cluster: cp1.cluster("control-plane")})
	require.NoError(t, err)
	for _, typ := range []string{probe.EtcdMemberHealthy, probe.APIServerReady} {
		if c := conditions.Get(p1.GetConditions(), typ); c.GetStatus() != conditions.True {
			t.Errorf("after removing the second member, %s %s = %s/%s: %s", cp1.Name, typ, c.GetStatus(), c.GetReason(), c.GetMessage())
		}
	}
}

// checkLabKubeletConfig checks that n's /var/lib/kubelet/config.yaml and
// the configuration its kubelet runs with (the API server's configz proxy)
// carry golden.LabKubeletPatch: absolute eviction thresholds, image GC off.
func checkLabKubeletConfig(t *testing.T, ctx context.Context, l *lab, admin string, n *labNode) {
	t.Helper()
	var want kubeletv1beta1.KubeletConfiguration
	require.NoError(t, yaml.Unmarshal([]byte(golden.LabKubeletPatch), &want))
	b, err := os.ReadFile(filepath.Join(n.Root, "var/lib/kubelet/config.yaml"))
	require.NoError(t, err)
	var file kubeletv1beta1.KubeletConfiguration
	require.NoError(t, yaml.Unmarshal(b, &file))
	out, err := kubectl(ctx, l.binDir, admin, "", "get", "--raw", "/api/v1/nodes/"+n.Name+"/proxy/configz")
	require.NoError(t, err)
	var live struct {
		KubeletConfig kubeletv1beta1.KubeletConfiguration `json:"kubeletconfig"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &live), "configz of %s", n.Name)
	for what, got := range map[string]kubeletv1beta1.KubeletConfiguration{"/var/lib/kubelet/config.yaml": file, "kubelet configz": live.KubeletConfig} {
		for k, v := range want.EvictionHard {
			if got.EvictionHard[k] != v {
				t.Errorf("%s %s evictionHard[%s] = %q, want %q (the lab's kubeadm patch)", n.Name, what, k, got.EvictionHard[k], v)
			}
		}
		if g := got.ImageGCHighThresholdPercent; g == nil || *g != *want.ImageGCHighThresholdPercent {
			t.Errorf("%s %s imageGCHighThresholdPercent = %v, want %d (image GC off)", n.Name, what, g, *want.ImageGCHighThresholdPercent)
		}
		t.Logf("%s %s: evictionHard %v imageGCHighThresholdPercent %v", n.Name, what, got.EvictionHard, derefInt32(got.ImageGCHighThresholdPercent))
	}
}

func derefInt32(p *int32) any {
	if p == nil {
		return nil
	}
	return *p
}

// etcdMembers lists the names of the etcd members n's member knows, asked
// on n's client port with kubeadm's health-check client certificate. The
// list is linearizable: it fails without a quorum.
//
// Equivalent to: `etcdctl --endpoints https://IP:2379 --cacert ca.crt
// --cert healthcheck-client.crt --key healthcheck-client.key member list`.
func (n *labNode) etcdMembers(ctx context.Context) ([]string, error) {
	dir := filepath.Join(n.Root, "etc", "kubernetes", "pki", "etcd")
	cert, err := tls.LoadX509KeyPair(filepath.Join(dir, "healthcheck-client.crt"), filepath.Join(dir, "healthcheck-client.key"))
	if err != nil {
		return nil, err
	}
	ca, err := os.ReadFile(filepath.Join(dir, "ca.crt"))
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil, fmt.Errorf("%s: no certificate", filepath.Join(dir, "ca.crt"))
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{"https://" + net.JoinHostPort(n.IP, "2379")},
		TLS:         &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, MinVersion: tls.VersionTLS12},
		DialTimeout: 5 * time.Second,
	})
	if err != nil {
		return nil, err
	}
	defer cli.Close()
	lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	resp, err := cli.MemberList(lctx)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, m := range resp.Members {
		names = append(names, m.Name)
	}
	return names, nil
}
