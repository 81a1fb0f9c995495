package domainbmc_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"
	"sigs.k8s.io/yaml"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/imagebuilder/bootmedia/bootmediatest"
	"github.com/kilnhq/kiln/internal/manifest"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// lifecycleTimeout bounds the whole run: one TCG boot into the agent on
// a loaded 2-core machine, plus registration and binding.
const lifecycleTimeout = 8 * time.Minute

// TestLabBMCDrivesHostLifecycle is issue 18's must-show: a domain defined
// by hand with `virsh define`, the real `kilnctl lab bmc` binary in front
// of it, a Host applied with `kilnctl apply`, and the controller's own
// lifecycle driving it. The Host registers (CheckBMC through the lab
// BMC) and becomes Available without being powered on; a Cluster and a
// ControlPlane that select it make the controller provision it: power
// off, the agent ISO from its boot server as virtual media with a
// one-time CD boot, power on, and the boot agent enrolls and checks in
// from virtual media. Every step is checked against virsh (domstate, the
// live CD drive, the boot order in the persistent definition) and the
// host against `kilnctl get host -o yaml` and `kilnctl describe host`.
// It prints a timeline. The image is not laid here (it stops at
// LayImage): a VM booted from disk needs the golden image with a kernel
// (issue 18's VM end-to-end test).
func TestLabBMCDrivesHostLifecycle(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds kilnctl and boots a VM")
	}
	sock := libvirtSocket(t)
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("go not installed: the test builds kilnctl")
	}
	// The agent reports its slirp address (10.0.2.15), which exists only
	// inside the VM: the controller's dial of it at LayImage would leave
	// through the default route. Reject it locally, before any traffic.
	outputGuard(t, "10.0.2.0/24")
	t0 := time.Now()
	var timeline []string
	mark := func(format string, args ...any) {
		line := fmt.Sprintf("%6.1fs  %s", time.Since(t0).Seconds(), fmt.Sprintf(format, args...))
		timeline = append(timeline, line)
		t.Log(line)
	}
	t.Cleanup(func() { t.Logf("timeline:\n%s", strings.Join(timeline, "\n")) })

	tmp := t.TempDir()
	kilnctl := filepath.Join(tmp, "kilnctl")
	out, err := exec.Command("go", "build", "-o", kilnctl, "github.com/kilnhq/kiln/cmd/kilnctl").CombinedOutput()
	require.NoError(t, err, "go build kilnctl: %s", out)
	media := t.TempDir()
	bootmediatest.Build(t, media)
	mark("kilnctl and boot media built")

	// 1. The domain, as a CI defines it by hand: a 4 GiB empty disk.
	dir := t.TempDir()
	dom := fmt.Sprintf("kiln-dbmc-life-%d", os.Getpid()%100000)
	disk := filepath.Join(dir, "disk.raw")
	require.NoError(t, os.WriteFile(disk, nil, 0o644))
	require.NoError(t, os.Truncate(disk, 4<<30))
	xml := strings.Replace(fmt.Sprintf(domainXML, dom, dir, "<boot dev='hd'/>", ""), "256", "1024", 1)
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
	domstate := func() string {
		t.Helper()
		s, err := virsh("domstate", dom)
		require.NoError(t, err, s)
		return s
	}
	domain := func(args ...string) *libvirtxml.Domain {
		t.Helper()
		x, err := virsh(append([]string{"dumpxml"}, append(args, dom)...)...)
		require.NoError(t, err, x)
		d := &libvirtxml.Domain{}
		require.NoError(t, d.Unmarshal(x))
		return d
	}
	cdSource := func(d *libvirtxml.Domain) string {
		for _, dk := range d.Devices.Disks {
			if dk.Device == "cdrom" && dk.Source != nil && dk.Source.File != nil {
				return dk.Source.File.File
			}
		}
		return ""
	}
	mark("domain %s defined with virsh define", dom)

	// 2. kilnctl lab bmc in front of it, on loopback, password from a file.
	const password = "life-bmc-pw-4711"
	ctx, cancel := context.WithTimeout(context.Background(), lifecycleTimeout)
	defer cancel()
	f := startLabBMC(t, kilnctl, sock, tmp, dom, password)
	require.Equal(t, "52:54:00:4b:70:01", f[2], "lab bmc's MAC of %s", dom)
	redfishURL := f[3]
	require.True(t, strings.HasPrefix(redfishURL, "https://127.0.0.1:"), "redfish URL %q", redfishURL)
	mark("kilnctl lab bmc serving %s at %s", dom, redfishURL)

	// 3. A real controller with its lifecycle and boot server. The VM is
	// on user-mode networking: it reaches this machine's loopback (the
	// API) as 10.0.2.2; the BMC fetches the ISO from loopback. The
	// controller URL names the API's port, as an operator's
	// --controller-url does (the API listens on a port picked here).
	port := loopbackPort(t)
	env := controllertest.Start(t, controllertest.WithBootServer(media, ""), controllertest.WithConfig(func(c *controller.Config) {
		c.ListenAddr = net.JoinHostPort("127.0.0.1", port)
		c.Lifecycle = true
		c.ControllerURL = "https://" + net.JoinHostPort("10.0.2.2", port)
		c.ReconcileInterval = time.Second
		c.ExpectedBootTime = 3 * time.Minute
	}))
	kctl := func(stdin string, args ...string) (string, error) {
		cmd := exec.CommandContext(ctx, kilnctl, args...)
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
	getHost := func() *typesv1.Host {
		t.Helper()
		out := mustKctl("", "get", "host", dom, "-o", "yaml")
		docs, err := manifest.Decode("get.yaml", []byte(out))
		require.NoError(t, err, "kilnctl get host -o yaml:\n%s", out)
		require.Len(t, docs, 1)
		h := docs[0].Resource.GetHost()
		// Decode reads what apply takes and ignores status: read it too.
		var doc struct {
			Status any `json:"status"`
		}
		require.NoError(t, yaml.Unmarshal([]byte(out), &doc))
		h.Status = &typesv1.HostStatus{}
		if doc.Status == nil {
			return h
		}
		st, err := yaml.Marshal(doc.Status)
		require.NoError(t, err)
		require.NoError(t, manifest.UnmarshalMessage("status", st, h.Status), "status of kilnctl get host -o yaml:\n%s", out)
		return h
	}
	waitHost := func(what string, done func(h *typesv1.Host) bool) *typesv1.Host {
		t.Helper()
		for {
			h := getHost()
			if done(h) {
				return h
			}
			if st := h.GetStatus().GetState(); st == typesv1.HostState_HOST_STATE_ERROR {
				t.Fatalf("host %s in Error while waiting for %s: %s", dom, what, mustKctl("", "describe", "host", dom))
			}
			select {
			case <-ctx.Done():
				serial, _ := os.ReadFile(filepath.Join(dir, "serial.log"))
				t.Fatalf("host %s: no %s within %s; describe:\n%s\nserial console:\n%s", dom, what, lifecycleTimeout,
					mustKctl("", "describe", "host", dom), serial)
			case <-time.After(time.Second):
			}
		}
	}

	// 4. kilnctl apply of the Host, with the credentials of the docs.
	hostYAML := fmt.Sprintf(`apiVersion: kiln.dev/v1
kind: Host
metadata:
  name: %s
  labels:
    vmlab: "true"
spec:
  bmc:
    protocol: redfish
    address: %s
    username: admin
    password: %s
    insecureSkipVerify: true
  bootMac: 52:54:00:4b:70:01
  rootDiskHint: /dev/vda
  bootMode: legacy
  online: true
`, dom, redfishURL, password)
	require.Contains(t, mustKctl(hostYAML, "apply", "-f", "-"), "host/"+dom+" created")
	mark("Host applied (kilnctl apply)")

	waitHost("Available", func(h *typesv1.Host) bool {
		return h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_AVAILABLE
	})
	require.Equal(t, "shut off", domstate(), "registration (CheckBMC) must not power the host on")
	require.Empty(t, cdSource(domain("--inactive")), "no media inserted at registration")
	desc := mustKctl("", "describe", "host", dom)
	require.Contains(t, desc, "BMCReachable", "describe host %s", dom)
	require.NotContains(t, desc, password)
	mark("Host Available after CheckBMC through lab bmc (virsh domstate: shut off)")

	// A Cluster and a ControlPlane selecting the host: the controller
	// binds it and provisions it. The Image is never laid here.
	clusterYAML := fmt.Sprintf(`apiVersion: kiln.dev/v1
kind: Image
metadata:
  name: debian12-k8s1.34.4-20261202
  labels: {os: debian12, kubernetes: v1.34.4}
spec:
  url: %s/images/debian12-k8s1.34.4-20261202.raw.zst
  sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
  size: 734003200
  format: raw.zst
  kubernetesVersion: v1.34.4
  os: debian12
  patchLevel: "20261202"
  kernel: 6.1.0-28-amd64
  buildDate: "2026-12-02"
---
apiVersion: kiln.dev/v1
kind: Cluster
metadata:
  name: vmlab
spec:
  kubernetesVersion: v1.34.4
  podCidr: 10.244.0.0/16
  serviceCidr: 10.96.0.0/12
  dnsDomain: cluster.local
---
apiVersion: kiln.dev/v1
kind: ControlPlane
metadata:
  name: vmlab-cp
spec:
  cluster: vmlab
  replicas: 1
  version: v1.34.4
  imageSelector: {os: debian12, kubernetes: v1.34.4}
  hostSelector: {vmlab: "true"}
  rolloutMaxSurge: 0
`, env.BootURL)
	mustKctl(clusterYAML, "apply", "-f", "-")
	mark("Cluster, ControlPlane and Image applied")

	waitHost("Provisioning", func(h *typesv1.Host) bool {
		return h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_PROVISIONING
	})
	mark("host bound: Provisioning")

	// Power on through Redfish: the domain runs, from the boot server's
	// ISO in its CD drive, with the CD first in its boot order.
	var ranAt time.Time
	h := waitHost("power on", func(h *typesv1.Host) bool {
		if ranAt.IsZero() && domstate() == "running" {
			ranAt = time.Now()
		}
		return !ranAt.IsZero()
	})
	mark("powered on through Redfish (virsh domstate: running; step %s)", h.GetStatus().GetProvisioningStep())
	live := cdSource(domain())
	require.NotEmpty(t, live, "virsh dumpxml: the running domain's CD drive is empty")
	require.FileExists(t, live)
	inactive := domain("--inactive")
	require.NotEmpty(t, inactive.OS.BootDevices)
	require.Equal(t, "cdrom", inactive.OS.BootDevices[0].Dev, "boot order after the controller's one-time CD override")
	mark("virsh: media %s inserted, boot dev cdrom first", filepath.Base(live))

	// The boot agent enrolls, checks in from virtual media, and the
	// lifecycle moves past WaitBootAgent.
	h = waitHost("boot agent check-in", func(h *typesv1.Host) bool {
		if h.GetStatus().GetAgent().GetLastHeartbeat() == nil {
			return false
		}
		return h.GetStatus().GetProvisioningStep() == string(hostlife.StepLayImage) ||
			h.GetStatus().GetProvisioningStep() == string(hostlife.StepWriteIdentity)
	})
	mark("boot agent enrolled and checked in (boot source %s); step %s", h.GetStatus().GetAgent().GetBootSource(), h.GetStatus().GetProvisioningStep())
	require.Equal(t, "virtualmedia", h.GetStatus().GetAgent().GetBootSource())
	serial, _ := os.ReadFile(filepath.Join(dir, "serial.log"))
	require.Contains(t, string(serial), "kiln-init: agent up")
	desc = mustKctl("", "describe", "host", dom)
	for _, want := range []string{"Provisioning", "virtualmedia"} {
		require.Contains(t, desc, want, "describe host %s", dom)
	}
	require.NotContains(t, desc, password)
	t.Logf("kilnctl describe host %s:\n%s", dom, desc)
}

// outputGuard rejects, for the test's duration, every packet this host
// sends to cidr (a VM's user-mode network, which has no route here), so a
// dial of it fails at once without leaving the machine (../shared/LAB.md,
// the network rule). The table is removed on cleanup.
func outputGuard(t *testing.T, cidr string) {
	t.Helper()
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skip("nft not installed (Debian package nftables): needed to keep the controller's dial of the VM's address on this machine")
	}
	table := fmt.Sprintf("kiln-dbmc-guard-%d", os.Getpid())
	rules := fmt.Sprintf("table inet %s {\n chain out {\n  type filter hook output priority -200; policy accept;\n  ip daddr %s counter reject\n }\n}\n", table, cidr)
	cmd := exec.Command("nft", "-f", "-")
	cmd.Stdin = strings.NewReader(rules)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "nft guard: %s", out)
	t.Cleanup(func() {
		if out, err := exec.Command("nft", "delete", "table", "inet", table).CombinedOutput(); err != nil {
			t.Errorf("nft delete table inet %s: %v: %s", table, err, out)
		}
	})
}

// startLabBMC runs `kilnctl lab bmc` in front of domain dom on loopback,
// with password from a file under tmp, until the test ends (then checks
// its log never held the password), and returns the fields of the line
// it prints for dom (name, UUID, MAC, Redfish URL, ...).
func startLabBMC(t *testing.T, kilnctl, sock, tmp, dom, password string) []string {
	t.Helper()
	pwFile := filepath.Join(tmp, "bmc.pw")
	require.NoError(t, os.WriteFile(pwFile, []byte(password+"\n"), 0o600))
	bmcCmd := exec.Command(kilnctl, "lab", "bmc", "--listen", "127.0.0.1:0", "--password-file", pwFile,
		"--libvirt-socket", sock, "--dir", filepath.Join(tmp, "bmc"), dom)
	stdout, err := bmcCmd.StdoutPipe()
	require.NoError(t, err)
	bmcLog := filepath.Join(tmp, "bmc.log")
	logF, err := os.Create(bmcLog)
	require.NoError(t, err)
	bmcCmd.Stderr = logF
	require.NoError(t, bmcCmd.Start())
	t.Cleanup(func() {
		_ = bmcCmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { _ = bmcCmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = bmcCmd.Process.Kill()
			<-done
		}
		logF.Close()
		if b, _ := os.ReadFile(bmcLog); strings.Contains(string(b), password) {
			t.Errorf("kilnctl lab bmc logged the BMC password")
		}
	})
	var fields []string
	sc := bufio.NewScanner(stdout)
	for fields == nil && sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) >= 4 && f[0] == dom {
			fields = f
		}
	}
	go func() { // keep draining
		for sc.Scan() {
		}
	}()
	if fields == nil {
		b, _ := os.ReadFile(bmcLog)
		t.Fatalf("kilnctl lab bmc printed no BMC for %s; log:\n%s", dom, b)
	}
	return fields
}

// loopbackPort is a TCP port free on 127.0.0.1 now (the caller listens on
// it next).
func loopbackPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
}
