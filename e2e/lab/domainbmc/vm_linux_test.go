package domainbmc_test

import (
	"context"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/clusterplan"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/provision"
	"github.com/kilnhq/kiln/e2e/fleet"
	"github.com/kilnhq/kiln/e2e/lab/netns"
	"github.com/kilnhq/kiln/imagebuilder/bootmedia"
	"github.com/kilnhq/kiln/imagebuilder/bootmedia/bootmediatest"
	"github.com/kilnhq/kiln/imagebuilder/golden"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/testenv"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// vmTimeout bounds TestVMEndToEnd after the image is built: under TCG on
// a loaded 2-core machine a boot into the agent, a lay of the full image,
// a boot of Debian from disk with its first-boot image import, and a
// control plane's kubeadm init.
const vmTimeout = 60 * time.Minute

// vmMAC is the test domain's NIC; dnsmasq gives it vmAddrIndex of the
// lab subnet.
const (
	vmMAC       = "52:54:00:4b:70:0e"
	vmAddrIndex = 10
)

// TestVMEndToEnd is issue 18's VM end-to-end test: a libvirt domain
// defined with virsh, behind `kilnctl lab bmc`, on a bridge this test
// creates (with DHCP from dnsmasq bound to it, and an nft guard that
// drops everything forwarded from or to it), is provisioned by the
// controller's own lifecycle: booted by virtual media into the boot
// agent, laid with the full golden image (examples/images/vm-lab.yaml:
// image-spec.yaml's kernel, ESP, containerd and kubeadm, plus the lab's
// offline CNI; built once and cached by fleet.LabImage), rebooted from disk into the installed agent, and
// bootstrapped as a single-node control plane. It prints a timeline
// (power on, agent enrolled, laid, rebooted, installed agent, kubeadm
// init, node Ready), each point with the load average.
//
// Opt-in (KILN_E2E_VM=1, `make test-vm`): under TCG it takes far longer
// than one test may in `make test` (docs/lab.md, "make test-vm").
func TestVMEndToEnd(t *testing.T) {
	if os.Getenv("KILN_E2E_VM") == "" {
		t.Skip("opt-in: KILN_E2E_VM=1 (make test-vm); boots a TCG VM for tens of minutes")
	}
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root: bridge, nft, libvirtd, image build")
	}
	for tool, pkg := range map[string]string{"dnsmasq": "dnsmasq-base", "nft": "nftables", "go": "golang"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (%s)", tool, pkg)
		}
	}
	t0 := time.Now()
	var timeline []string
	mark := func(format string, args ...any) {
		line := fmt.Sprintf("%7.1fs  load %-5s %s", time.Since(t0).Seconds(), loadAvg(), fmt.Sprintf(format, args...))
		timeline = append(timeline, line)
		t.Log(line)
	}
	t.Cleanup(func() { t.Logf("timeline:\n%s", strings.Join(timeline, "\n")) })

	tmp := t.TempDir()
	kilnctl := filepath.Join(tmp, "kilnctl")
	out, err := exec.Command("go", "build", "-o", kilnctl, "github.com/kilnhq/kiln/cmd/kilnctl").CombinedOutput()
	require.NoError(t, err, "go build kilnctl: %s", out)
	// One agent binary for the boot media and the image.
	agent := bootmediatest.BuildAgent(t, t.TempDir())
	media := t.TempDir()
	_, err = bootmedia.Build(context.Background(), bootmedia.Spec{AgentBinary: agent, OutDir: media, CacheDir: bootmediatest.CacheDir(t)}, func(l string) { t.Log(l) })
	bootmediatest.SkipIfUnavailable(t, err)
	require.NoError(t, err)
	mark("kilnctl, agent and boot media built")

	// The full golden image, cached by spec, agent and kube-tools.
	imgDir, man, err := fleet.LabImage(context.Background(), fleet.ImageOptions{
		Spec: filepath.Join(filepath.Dir(fleet.DefaultLabSpec()), "vm-lab.yaml"), Agent: agent,
		Progress: testWriter{t},
	})
	if err != nil && strings.Contains(err.Error(), "kube-tools") {
		testenv.Skipf(t, "golden image: %v", err)
	}
	require.NoError(t, err, "golden image")
	require.NotEmpty(t, man.KernelVersion, "vm-lab.yaml's image has a kernel")
	mark("golden image %s (kernel %s, %d MiB raw) in %s", man.Tag, man.KernelVersion, man.RawSize>>20, imgDir)

	// The run ends before go test's -timeout would (a panic there skips
	// the cleanups, leaving the domain, bridge and guard behind).
	deadline := time.Now().Add(vmTimeout)
	if d, ok := t.Deadline(); ok && d.Add(-2*time.Minute).Before(deadline) {
		deadline = d.Add(-2 * time.Minute)
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	// SIGINT or SIGTERM of the test binary ends the run as its deadline
	// does: the stop's report (describe, console, agent log) and every
	// cleanup (domain, libvirtd, bridge, guard, dnsmasq) still run.
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	// libvirtd only now: a private one holds a machine-wide lock that
	// other libvirt tests wait on, and the image build may take long.
	sock := libvirtSocket(t)

	// The lab network: a bridge with DHCP, guarded.
	ln := newVMNet(t)
	mark("bridge %s %s (dnsmasq pid %d), nft table inet %s", ln.bridge, ln.cidr, ln.dnsmasq.Process.Pid, ln.table)

	// The domain, on the bridge: 2 vCPUs and 2 GiB (kubeadm's preflight
	// wants both for a control plane), an empty 8 GiB disk.
	dir := t.TempDir()
	dom := fmt.Sprintf("kiln-vm-e2e-%d", os.Getpid()%100000)
	disk := filepath.Join(dir, "disk.raw")
	require.NoError(t, os.WriteFile(disk, nil, 0o644))
	require.NoError(t, os.Truncate(disk, 8<<30))
	xml := fmt.Sprintf(domainXML, dom, dir, "<boot dev='hd'/>", "")
	xml = strings.Replace(xml, "<memory unit='MiB'>256</memory>", "<memory unit='MiB'>2048</memory>", 1)
	xml = strings.Replace(xml, "<vcpu>1</vcpu>", "<vcpu>2</vcpu>", 1)
	xml = strings.Replace(xml, "<interface type='user'>\n      <mac address='52:54:00:4b:70:01'/>",
		"<interface type='bridge'>\n      <source bridge='"+ln.bridge+"'/>\n      <mac address='"+vmMAC+"'/>", 1)
	require.Contains(t, xml, ln.bridge)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "domain.xml"), []byte(xml), 0o644))
	virsh := func(args ...string) (string, error) {
		out, err := exec.Command("virsh", append([]string{"-c", "qemu:///system?socket=" + sock}, args...)...).CombinedOutput()
		return strings.TrimSpace(string(out)), err
	}
	out2, err := virsh("define", filepath.Join(dir, "domain.xml"))
	require.NoError(t, err, "virsh define: %s", out2)
	t.Cleanup(func() {
		_, _ = virsh("destroy", dom)
		_, _ = virsh("undefine", dom)
		_ = os.Remove(filepath.Join("/var/log/libvirt/qemu", dom+".log"))
	})
	mark("domain %s defined (bridge %s, MAC %s)", dom, ln.bridge, vmMAC)

	// kilnctl lab bmc in front of it, on loopback.
	const password = "vm-e2e-bmc-pw-0815"
	redfishURL := startLabBMC(t, kilnctl, sock, tmp, dom, password)[3]

	// The controller listens on the bridge's address: the VM reaches its
	// API and boot server there, and it dials the agents on the bridge.
	env := controllertest.Start(t, controllertest.WithBootServer(media, imgDir), controllertest.WithConfig(func(c *controller.Config) {
		c.ListenAddr = ln.gateway + ":0"
		c.BootListenAddr = ln.gateway + ":0"
		c.Lifecycle = true
		c.ControllerURL = "https://" + ln.gateway
		c.ReconcileInterval = time.Second
		c.ExpectedBootTime = 5 * time.Minute
	}))
	require.True(t, strings.HasPrefix(env.BootURL, "http://"+ln.gateway+":"), "boot URL %s", env.BootURL)
	kctl := func(stdin string, args ...string) (string, error) {
		// Its own deadline: the report of a stopped run (ctx done) still
		// describes the host.
		kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		cmd := exec.CommandContext(kctx, kilnctl, args...)
		cmd.Env = append(os.Environ(), "KILNCONFIG="+env.AdminConfigPath, "HOME="+tmp)
		if stdin != "" {
			cmd.Stdin = strings.NewReader(stdin)
		}
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	mustKctl := func(stdin string, args ...string) string {
		t.Helper()
		out, err := kctl(stdin, args...)
		require.NoError(t, err, "kilnctl %s: %s", strings.Join(args, " "), out)
		return out
	}
	mark("controller on %s, boot server %s, lab bmc %s", env.Addr, env.BootURL, redfishURL)

	image, err := golden.ImageResource(man, env.BootURL+"/images/")
	require.NoError(t, err)
	apply := fmt.Sprintf(`apiVersion: kiln.dev/v1
kind: Host
metadata:
  name: %[1]s
  labels:
    vme2e: "true"
spec:
  bmc:
    protocol: redfish
    address: %[2]s
    username: admin
    password: %[3]s
    insecureSkipVerify: true
  bootMac: %[4]s
  rootDiskHint: /dev/vda
  bootMode: legacy
  online: true
---
%[5]s
---
apiVersion: kiln.dev/v1
kind: Cluster
metadata:
  name: vme2e
spec:
  kubernetesVersion: %[6]s
  podCidr: 10.244.0.0/16
  serviceCidr: 10.96.0.0/12
  dnsDomain: cluster.local
---
apiVersion: kiln.dev/v1
kind: ControlPlane
metadata:
  name: vme2e-cp
spec:
  cluster: vme2e
  replicas: 1
  version: %[6]s
  imageSelector: {os: %[7]s, kubernetes: %[6]s}
  hostSelector: {vme2e: "true"}
  rolloutMaxSurge: 0
`, dom, redfishURL, password, vmMAC, strings.TrimSpace(string(image)), man.KubernetesVersion, man.OSVersion)
	mustKctl(apply, "apply", "-f", "-")
	mark("Host, Image, Cluster and ControlPlane applied (kilnctl apply)")

	conn := env.Dial(t, env.AdminConfigPath)
	res := controllerv1.NewResourcesClient(conn)
	serial := func() string {
		b, _ := os.ReadFile(filepath.Join(dir, "serial.log"))
		if len(b) > 8<<10 {
			b = b[len(b)-8<<10:]
		}
		return string(b)
	}
	// One watcher prints every change (host state, step, lay progress,
	// machine phase and conditions) as it happens; the marks below are
	// the must-show points of the timeline.
	type point struct {
		what string
		done func(s *fleet.Snapshot, h *typesv1.Host) bool
	}
	points := []point{
		{"powered on (step WaitBootAgent: the domain runs from the agent ISO)", func(_ *fleet.Snapshot, h *typesv1.Host) bool {
			return stepAtLeast(h, hostlife.StepWaitBootAgent)
		}},
		{"boot agent enrolled and checked in from virtual media (step LayImage)", func(_ *fleet.Snapshot, h *typesv1.Host) bool {
			return stepAtLeast(h, hostlife.StepLayImage)
		}},
		{"image laid (step WriteIdentity)", func(_ *fleet.Snapshot, h *typesv1.Host) bool {
			return stepAtLeast(h, hostlife.StepWriteIdentity)
		}},
		{"rebooting from disk (step WaitInstalledAgent)", func(_ *fleet.Snapshot, h *typesv1.Host) bool {
			return stepAtLeast(h, hostlife.StepWaitInstalled)
		}},
		{"installed agent checked in from disk (host Provisioned)", func(_ *fleet.Snapshot, h *typesv1.Host) bool {
			return h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_PROVISIONED
		}},
		{"kubeadm init done (Machine Bootstrapped)", func(s *fleet.Snapshot, _ *typesv1.Host) bool {
			for _, m := range s.Machines {
				if conditions.IsTrue(m.GetStatus().GetConditions(), clusterplan.MachineBootstrapped) {
					return true
				}
			}
			return false
		}},
		{"node Ready", func(s *fleet.Snapshot, _ *typesv1.Host) bool {
			for _, m := range s.Machines {
				if conditions.IsTrue(m.GetStatus().GetConditions(), clusterplan.MachineNodeReady) {
					return true
				}
			}
			return false
		}},
	}
	next := 0
	w := fleet.Watcher{
		Snapshot: func(ctx context.Context) (*fleet.Snapshot, error) { return fleet.SnapshotOf(ctx, res, "vme2e") },
		Now:      time.Now,
		Wait: func(ctx context.Context) error {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(2 * time.Second):
				return nil
			}
		},
		Say: func(format string, args ...any) { t.Logf(format, args...) },
	}
	_, err = w.Run(ctx, func(s *fleet.Snapshot) bool {
		h := s.Hosts[dom]
		if h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_ERROR {
			return true
		}
		for next < len(points) && points[next].done(s, h) {
			mark("%s", points[next].what)
			next++
		}
		return next == len(points)
	})
	if err != nil || next < len(points) {
		desc, _ := kctl("", "describe", "host", dom)
		t.Fatalf("stopped before %q: %v\nkilnctl describe host:\n%s\nserial console (tail):\n%s\nagent log (tail):\n%s", points[min(next, len(points)-1)].what, err, desc, serial(), agentLog(env, res, dom))
	}
	h, err := res.Get(ctx, &controllerv1.GetRequest{Kind: "Host", Name: dom})
	require.NoError(t, err)
	require.Equal(t, "installed", h.GetHost().GetStatus().GetAgent().GetMode())
	require.Equal(t, "disk", h.GetHost().GetStatus().GetAgent().GetBootSource())
	desc := mustKctl("", "describe", "host", dom)
	require.NotContains(t, desc, password)
	t.Logf("kilnctl describe host %s:\n%s", dom, desc)
}

// loadAvg is this machine's one-minute load average ("?" when unknown):
// TCG timings scale with it.
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if f := strings.Fields(string(b)); err == nil && len(f) > 0 {
		return f[0]
	}
	return "?"
}

// agentLog is the tail of the log of the agent the host runs now (its
// Logs RPC, dialled as the controller dials it), or why there is none:
// the installed agent's journal is not on the serial console.
func agentLog(env *controllertest.Env, res controllerv1.ResourcesClient, host string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := res.Get(ctx, &controllerv1.GetRequest{Kind: "Host", Name: host})
	if err != nil {
		return fmt.Sprintf("(host: %v)", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(env.Controller.TrustedCAs()) {
		return "(no CA)"
	}
	agents := provision.NewAgentPool(func() *x509.CertPool { return pool }, env.Controller.Certificate)
	defer agents.Close()
	a, err := agents.Dial(ctx, r.GetHost())
	if err != nil {
		return fmt.Sprintf("(dial the agent: %v)", err)
	}
	st, err := a.Logs(ctx, &agentv1.LogsRequest{Tail: 300})
	if err != nil {
		return fmt.Sprintf("(logs: %v)", err)
	}
	var b strings.Builder
	for {
		l, err := st.Recv()
		if err != nil {
			if err != io.EOF {
				fmt.Fprintf(&b, "(%v)\n", err)
			}
			return b.String()
		}
		fmt.Fprintf(&b, "%s %s\n", l.GetTime().AsTime().Format(time.TimeOnly), l.GetLine())
	}
}

// stepAtLeast says whether h is provisioning at step s or a later one,
// or is provisioned.
func stepAtLeast(h *typesv1.Host, s hostlife.Step) bool {
	if h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_PROVISIONED {
		return true
	}
	if h.GetStatus().GetState() != typesv1.HostState_HOST_STATE_PROVISIONING {
		return false
	}
	order := []hostlife.Step{hostlife.StepPowerOff, hostlife.StepBootAgentMedia, hostlife.StepPowerOn, hostlife.StepWaitBootAgent,
		hostlife.StepLayImage, hostlife.StepWriteIdentity, hostlife.StepBootDisk, hostlife.StepWaitInstalled}
	cur, want := -1, -1
	for i, st := range order {
		if string(st) == h.GetStatus().GetProvisioningStep() {
			cur = i
		}
		if st == s {
			want = i
		}
	}
	return cur >= 0 && cur >= want
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// vmNet is the test's VM network: a bridge in this network namespace
// with the first address of a /24 no route or address of this machine
// overlaps, dnsmasq serving DHCP (no DNS) on that bridge only, and an nft
// table that drops every packet forwarded from or to the bridge, so the
// VM reaches this machine's addresses and nothing beyond it (the
// network rule of ../shared/LAB.md). All of it is removed on cleanup.
type vmNet struct {
	bridge, cidr, gateway, table string
	dnsmasq                      *exec.Cmd
}

func newVMNet(t *testing.T) *vmNet {
	t.Helper()
	pid := os.Getpid()
	n := &vmNet{bridge: fmt.Sprintf("kvme%d", pid%100000), table: fmt.Sprintf("kiln-vme2e-%d", pid)}
	var prefix string
	for i := range 200 {
		p := fmt.Sprintf("10.253.%d", (pid+i)%200+20)
		if !subnetInUse(t, p+".0/24") {
			prefix = p
			break
		}
	}
	require.NotEmpty(t, prefix, "no free 10.253.X.0/24 on this machine")
	n.cidr, n.gateway = prefix+".0/24", prefix+".1"

	// The guard first, before the bridge exists.
	rules := fmt.Sprintf("table inet %[1]s {\n chain guard {\n  type filter hook forward priority -200; policy accept;\n  iifname %[2]q counter drop\n  oifname %[2]q counter drop\n }\n}\n", n.table, n.bridge)
	cmd := exec.Command("nft", "-f", "-")
	cmd.Stdin = strings.NewReader(rules)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "nft guard: %s", out)
	t.Cleanup(func() {
		if out, err := exec.Command("nft", "delete", "table", "inet", n.table).CombinedOutput(); err != nil {
			t.Errorf("nft delete table inet %s: %v: %s", n.table, err, out)
		}
	})
	ip := func(args ...string) {
		t.Helper()
		out, err := exec.Command("ip", args...).CombinedOutput()
		require.NoError(t, err, "ip %s: %s", strings.Join(args, " "), out)
	}
	ip("link", "add", n.bridge, "address", netns.BridgeMAC(n.bridge), "type", "bridge")
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "link", "del", n.bridge).CombinedOutput(); err != nil {
			t.Errorf("ip link del %s: %v: %s", n.bridge, err, out)
		}
	})
	ip("addr", "add", n.gateway+"/24", "dev", n.bridge)
	ip("link", "set", n.bridge, "up")

	dir := t.TempDir()
	n.dnsmasq = exec.Command("dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--port=0",
		"--interface="+n.bridge, "--bind-interfaces", "--except-interface=lo",
		fmt.Sprintf("--dhcp-range=%s.%d,%s.%d,255.255.255.0,1h", prefix, vmAddrIndex, prefix, vmAddrIndex+20),
		fmt.Sprintf("--dhcp-host=%s,%s.%d", vmMAC, prefix, vmAddrIndex),
		"--dhcp-option=option:router,"+n.gateway, "--dhcp-option=option:dns-server",
		"--dhcp-leasefile="+filepath.Join(dir, "leases"), "--log-dhcp", "--log-facility=-", "--user=root",
		"--pid-file="+filepath.Join(dir, "dnsmasq.pid"))
	logf, err := os.Create(filepath.Join(dir, "dnsmasq.log"))
	require.NoError(t, err)
	n.dnsmasq.Stdout, n.dnsmasq.Stderr = logf, logf
	n.dnsmasq.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(t, n.dnsmasq.Start())
	done := make(chan struct{})
	go func() { _ = n.dnsmasq.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = n.dnsmasq.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = n.dnsmasq.Process.Kill()
			<-done
		}
		logf.Close()
		if b, _ := os.ReadFile(filepath.Join(dir, "dnsmasq.log")); t.Failed() {
			t.Logf("dnsmasq log:\n%s", b)
		}
	})
	select {
	case <-done:
		b, _ := os.ReadFile(filepath.Join(dir, "dnsmasq.log"))
		t.Fatalf("dnsmasq exited: %s", b)
	case <-time.After(500 * time.Millisecond):
	}
	return n
}

// subnetInUse says whether cidr overlaps an address or a route of this
// network namespace.
func subnetInUse(t *testing.T, cidr string) bool {
	t.Helper()
	_, want, err := net.ParseCIDR(cidr)
	require.NoError(t, err)
	out, err := exec.Command("ip", "-4", "-o", "route", "show", "table", "all").CombinedOutput()
	require.NoError(t, err, "ip route: %s", out)
	addrs, err := exec.Command("ip", "-4", "-o", "addr", "show").CombinedOutput()
	require.NoError(t, err, "ip addr: %s", addrs)
	var nets []string
	for _, l := range strings.Split(string(out), "\n") {
		f := strings.Fields(l)
		if len(f) > 0 && (f[0] == "local" || f[0] == "broadcast" || f[0] == "unicast") && len(f) > 1 {
			f = f[1:]
		}
		if len(f) > 0 && f[0] != "default" {
			nets = append(nets, f[0])
		}
	}
	for _, l := range strings.Split(string(addrs), "\n") {
		if f := strings.Fields(l); len(f) >= 4 {
			nets = append(nets, f[3])
		}
	}
	for _, s := range nets {
		if !strings.Contains(s, "/") {
			s += "/32"
		}
		_, n, err := net.ParseCIDR(s)
		if err != nil {
			continue
		}
		if n.Contains(want.IP) || want.Contains(n.IP) {
			return true
		}
	}
	return false
}

func TestStepAtLeast(t *testing.T) {
	host := func(st typesv1.HostState, step hostlife.Step) *typesv1.Host {
		return &typesv1.Host{Status: &typesv1.HostStatus{State: st, ProvisioningStep: string(step)}}
	}
	const prov = typesv1.HostState_HOST_STATE_PROVISIONING
	for _, tc := range []struct {
		h    *typesv1.Host
		s    hostlife.Step
		want bool
	}{
		{host(prov, hostlife.StepLayImage), hostlife.StepLayImage, true},
		{host(prov, hostlife.StepWriteIdentity), hostlife.StepLayImage, true},
		{host(prov, hostlife.StepWaitBootAgent), hostlife.StepLayImage, false},
		{host(prov, ""), hostlife.StepPowerOff, false},
		{host(typesv1.HostState_HOST_STATE_AVAILABLE, hostlife.StepWaitInstalled), hostlife.StepLayImage, false},
		{host(typesv1.HostState_HOST_STATE_PROVISIONED, ""), hostlife.StepWaitInstalled, true},
	} {
		require.Equal(t, tc.want, stepAtLeast(tc.h, tc.s), "%v at least %s", tc.h.GetStatus(), tc.s)
	}
}

// TestSubnetInUse checks the VM network's choice of subnet against this
// machine's own addresses and routes (read-only: ip addr, ip route).
func TestSubnetInUse(t *testing.T) {
	if _, err := exec.LookPath("ip"); err != nil {
		testenv.Skip(t, "ip not installed (iproute2)")
	}
	require.True(t, subnetInUse(t, "127.0.0.0/24"), "loopback's 127.0.0.1/8 overlaps 127.0.0.0/24")
	out, err := exec.Command("ip", "-4", "-o", "addr", "show", "scope", "global").CombinedOutput()
	require.NoError(t, err, "%s", out)
	for _, l := range strings.Split(string(out), "\n") {
		if f := strings.Fields(l); len(f) >= 4 {
			ip, _, err := net.ParseCIDR(f[3])
			require.NoError(t, err)
			require.True(t, subnetInUse(t, ip.Mask(net.CIDRMask(24, 32)).String()+"/24"), "address %s", f[3])
		}
	}
	// TEST-NET-3 is never assigned: not in use unless a route covers it.
	require.False(t, subnetInUse(t, "203.0.113.0/24") && !routeCovers(t, "203.0.113.1"))
}

func routeCovers(t *testing.T, ip string) bool {
	out, err := exec.Command("ip", "-4", "-o", "route", "show", "match", ip).CombinedOutput()
	require.NoError(t, err, "%s", out)
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if l != "" && !strings.HasPrefix(l, "default") {
			return true
		}
	}
	return false
}
