// Package preflight checks a host against a cluster before kubeadm runs,
// without changing anything: kubeadm's own checks that matter for Kiln
// plus those kubeadm no longer makes (br_netfilter present and set, pod
// and service CIDRs clear of the host's networks, containerd and the
// kubelet agreeing on the cgroup driver, the runtime socket answering,
// the pinned Kubernetes version installed).
//
// Every check says what is wrong and how to fix it. The report fails when
// any check of severity ERROR fails; WARNING checks are advice.
package preflight

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/kilnhq/kiln/host"
	"github.com/kilnhq/kiln/host/containerd"
	"github.com/kilnhq/kiln/host/kmod"
	"github.com/kilnhq/kiln/host/netcheck"
	"github.com/kilnhq/kiln/host/ports"
	"github.com/kilnhq/kiln/host/swap"
	"github.com/kilnhq/kiln/host/sysctl"
	"github.com/kilnhq/kiln/host/systemd"
	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// Paths under the root that the checks read.
const (
	RuntimeSocket = "run/containerd/containerd.sock"
	KubeletConfig = "var/lib/kubelet/config.yaml"
)

// Check names, stable for callers that look for one.
const (
	CheckIPForward      = "ip_forward"
	CheckBrNetfilter    = "br_netfilter"
	CheckBridgeNF       = "bridge-nf-call-iptables"
	CheckPodCIDR        = "pod-cidr"
	CheckServiceCIDR    = "service-cidr"
	CheckCgroupDriver   = "cgroup-driver"
	CheckRuntimeSocket  = "runtime-socket"
	CheckPorts          = "ports"
	CheckSwap           = "swap"
	CheckKubeadmVersion = "kubeadm-version"
	CheckKubeletVersion = "kubelet-version"
	CheckOfflineImages  = "offline-images"
)

// OfflineImagesDir holds a golden image's Kubernetes image archives
// (imagebuilder/golden.ImagesDir); its unit OfflineImagesUnit imports
// them into containerd at first boot, retrying on failure, and then
// writes OfflineImagesMarker there. It logs its progress and its errors
// to OfflineImagesLog there (imagebuilder/golden.ImportLog).
const (
	OfflineImagesDir    = "var/lib/kiln/images"
	OfflineImagesMarker = ".imported"
	OfflineImagesLog    = ".import.log"
	OfflineImagesUnit   = "kiln-import-images.service"
)

// Runner runs a host command (command.Exec in production).
type Runner interface {
	Run(ctx context.Context, name string, args ...string) ([]byte, error)
}

// Checker runs the checks on the host under a root.
type Checker struct {
	root     string
	run      Runner
	log      *slog.Logger
	networks func() (addrs, routes []netcheck.Network, err error)
	busy     func([]int) ([]int, error)
	query    func(ctx context.Context, socket string) (containerd.Running, error)
	// unit reads a systemd unit's state (the import's, while its marker
	// is missing).
	unit func(ctx context.Context, name string) (systemd.UnitState, error)
	// timeout bounds each probe that may hang (the runtime socket);
	// versionTimeout each `kubeadm version` and `kubelet --version`: a
	// first exec of an 80 MB Go binary while a first boot imports its
	// images took over 5 s in a TCG VM, every time for minutes.
	timeout, versionTimeout time.Duration
}

// VersionTimeout bounds each binary version query of Run. Both queries
// and the runtime's fit in the controller's Preflight call (one minute).
const VersionTimeout = 20 * time.Second

// New returns a Checker for the host whose filesystem is at root ("/" in
// production). Network checks (addresses, routes, ports, sysctls under
// net/) see the calling thread's network namespace.
func New(root string, run Runner, log *slog.Logger) *Checker {
	return &Checker{
		root:     root,
		run:      run,
		log:      log.With("component", "preflight"),
		networks: netcheck.HostNetworks,
		busy:     ports.Busy,
		query:    containerd.Query,
		unit:     unitState(root),
		timeout:  5 * time.Second,

		versionTimeout: VersionTimeout,
	}
}

// Run checks the host against cluster and returns the report; it changes
// nothing. A check that cannot read what it needs fails with the reason.
// It blocks until all checks ran.
//
// It returns an InvalidArgument error when cluster is nil.
func (c *Checker) Run(ctx context.Context, cluster *agentv1.ClusterConfig) (*agentv1.PreflightReport, error) {
	if cluster == nil {
		return nil, errdefs.InvalidArgument("preflight: no cluster config")
	}
	kubelet := c.kubeletConfig()
	qctx, cancel := context.WithTimeout(ctx, c.timeout)
	running, qerr := c.query(qctx, filepath.Join(c.root, RuntimeSocket))
	cancel()
	checks := []*agentv1.Check{
		c.ipForward(),
		c.brNetfilter(),
		c.bridgeNF(),
	}
	checks = append(checks, c.cidrs(cluster)...)
	checks = append(checks,
		c.cgroupDriver(cluster, kubelet, running, qerr),
		c.runtimeSocket(running, qerr),
		c.ports(cluster),
		c.swap(kubelet),
	)
	checks = append(checks, c.versions(ctx, cluster)...)
	checks = append(checks, c.offlineImages(ctx))

	r := &agentv1.PreflightReport{Checks: checks, Passed: true}
	for _, ch := range checks {
		if !ch.Passed && ch.Severity == agentv1.Severity_SEVERITY_ERROR {
			r.Passed = false
		}
		if !ch.Passed {
			c.log.WarnContext(ctx, "check failed", "check", ch.Name, "severity", ch.Severity.String(), "message", ch.Message)
		}
	}
	c.log.InfoContext(ctx, "preflight done", "passed", r.Passed, "checks", len(checks))
	return r, nil
}

func pass(name, msg string) *agentv1.Check {
	return &agentv1.Check{Name: name, Passed: true, Severity: agentv1.Severity_SEVERITY_INFO, Message: msg}
}

func fail(name string, sev agentv1.Severity, msg, fix string) *agentv1.Check {
	return &agentv1.Check{Name: name, Passed: false, Severity: sev, Message: msg, Fix: fix}
}

const errorSev = agentv1.Severity_SEVERITY_ERROR

// flannelNote explains why the bridge checks matter even though kubeadm
// passes without them.
const flannelNote = "kubeadm no longer checks this; without it bridged pod traffic bypasses iptables, Service IPs do not work across the bridge and Flannel crash-loops while the node says Ready"

func (c *Checker) ipForward() *agentv1.Check {
	v, err := sysctl.Get(c.root, "net.ipv4.ip_forward")
	fix := "sysctl -w net.ipv4.ip_forward=1 and persist it in /etc/sysctl.d (kiln Prepare does both)"
	switch {
	case err != nil:
		return fail(CheckIPForward, errorSev, fmt.Sprintf("cannot read net.ipv4.ip_forward: %v", err), fix)
	case v != "1":
		return fail(CheckIPForward, errorSev, fmt.Sprintf("net.ipv4.ip_forward is %s, want 1: the node cannot route pod traffic", v), fix)
	}
	return pass(CheckIPForward, "net.ipv4.ip_forward is 1")
}

func (c *Checker) brNetfilter() *agentv1.Check {
	release := readTrim(filepath.Join(c.root, "proc/sys/kernel/osrelease"))
	st, err := kmod.Status(c.root, release, "br_netfilter")
	fix := "modprobe br_netfilter and list it in /etc/modules-load.d (kiln Prepare does both)"
	switch {
	case err != nil:
		return fail(CheckBrNetfilter, errorSev, fmt.Sprintf("cannot tell whether br_netfilter is loaded: %v", err), fix)
	case !st.Available():
		return fail(CheckBrNetfilter, errorSev, "kernel module br_netfilter is not loaded: "+flannelNote, fix)
	}
	return pass(CheckBrNetfilter, "br_netfilter is "+string(st))
}

func (c *Checker) bridgeNF() *agentv1.Check {
	v, err := sysctl.Get(c.root, "net.bridge.bridge-nf-call-iptables")
	fix := "modprobe br_netfilter; sysctl -w net.bridge.bridge-nf-call-iptables=1 and persist it in /etc/sysctl.d (kiln Prepare does both)"
	switch {
	case errdefs.IsNotFound(err):
		return fail(CheckBridgeNF, errorSev, "net.bridge.bridge-nf-call-iptables does not exist (br_netfilter missing): "+flannelNote, fix)
	case err != nil:
		return fail(CheckBridgeNF, errorSev, fmt.Sprintf("cannot read net.bridge.bridge-nf-call-iptables: %v", err), fix)
	case v != "1":
		return fail(CheckBridgeNF, errorSev, fmt.Sprintf("net.bridge.bridge-nf-call-iptables is %s, want 1: %s", v, flannelNote), fix)
	}
	return pass(CheckBridgeNF, "net.bridge.bridge-nf-call-iptables is 1")
}

func (c *Checker) cidrs(cluster *agentv1.ClusterConfig) []*agentv1.Check {
	addrs, routes, nerr := c.networks()
	var out []*agentv1.Check
	for _, x := range []struct{ name, what, cidr, other string }{
		{CheckPodCIDR, "pod CIDR", cluster.GetPodCidr(), cluster.GetServiceCidr()},
		{CheckServiceCIDR, "service CIDR", cluster.GetServiceCidr(), ""},
	} {
		if x.cidr == "" {
			out = append(out, pass(x.name, "no "+x.what+" given"))
			continue
		}
		fix := fmt.Sprintf("choose a %s that no host address or route uses (the cluster's spec), or remove the conflicting route from the host", x.what)
		if nerr != nil {
			out = append(out, fail(x.name, errorSev, fmt.Sprintf("cannot list host addresses and routes: %v", nerr), fix))
			continue
		}
		ov, err := netcheck.Overlaps(x.cidr, addrs, routes)
		if err != nil {
			out = append(out, fail(x.name, errorSev, fmt.Sprintf("%s %q: %v", x.what, x.cidr, err), "give a CIDR such as 10.244.0.0/16"))
			continue
		}
		if len(ov) > 0 {
			var s []string
			for _, o := range ov {
				s = append(s, o.String())
			}
			out = append(out, fail(x.name, errorSev, fmt.Sprintf("%s %s overlaps host %s: pod and service traffic would be routed into the host's network", x.what, x.cidr, strings.Join(s, ", ")), fix))
			continue
		}
		if x.other != "" {
			if both, err := netcheck.CIDRsOverlap(x.cidr, x.other); err == nil && both {
				out = append(out, fail(x.name, errorSev, fmt.Sprintf("pod CIDR %s overlaps service CIDR %s", x.cidr, x.other), "choose disjoint pod and service CIDRs"))
				continue
			}
		}
		out = append(out, pass(x.name, fmt.Sprintf("%s %s is clear of the host's addresses and routes", x.what, x.cidr)))
	}
	return out
}

// kubeletConfiguration is the part of the kubelet's config file read here.
type kubeletConfiguration struct {
	CgroupDriver string `json:"cgroupDriver"`
	FailSwapOn   *bool  `json:"failSwapOn"`
	present      bool
	err          error
}

func (c *Checker) kubeletConfig() kubeletConfiguration {
	b, err := os.ReadFile(filepath.Join(c.root, KubeletConfig))
	if errors.Is(err, fs.ErrNotExist) {
		return kubeletConfiguration{}
	}
	var k kubeletConfiguration
	if err == nil {
		err = yaml.Unmarshal(b, &k)
	}
	k.present, k.err = true, err
	return k
}

func (c *Checker) cgroupDriver(cluster *agentv1.ClusterConfig, k kubeletConfiguration, running containerd.Running, qerr error) *agentv1.Check {
	want, from := cluster.GetCgroupDriver(), "the cluster config"
	if want == "" {
		want, from = containerd.DriverSystemd, "kubeadm's default"
	}
	if k.present {
		if k.err != nil {
			return fail(CheckCgroupDriver, errorSev, fmt.Sprintf("cannot read /%s: %v", KubeletConfig, k.err), "fix or remove the kubelet config")
		}
		// The KubeletConfiguration default is cgroupfs.
		want, from = k.CgroupDriver, "/"+KubeletConfig
		if want == "" {
			want = containerd.DriverCgroupfs
		}
	}
	cfg := filepath.Join(c.root, containerd.DefaultConfig)
	sc, _, err := containerd.ReadSystemdCgroup(cfg)
	file, fileFrom := containerd.Driver(sc), "/"+containerd.DefaultConfig
	switch {
	case errdefs.IsNotFound(err):
		file, fileFrom = containerd.DriverCgroupfs, "containerd's default (no config file)"
	case err != nil:
		return fail(CheckCgroupDriver, errorSev, fmt.Sprintf("cannot read containerd's cgroup driver: %v", err), "fix /"+containerd.DefaultConfig)
	}
	// What counts is what the running containerd uses; the file only
	// when containerd does not answer.
	got, gotFrom := file, fileFrom
	if qerr == nil {
		got, gotFrom = running.Driver(), "the running containerd"
	}
	if got != want {
		msg := fmt.Sprintf("containerd uses the %s cgroup driver (%s) but the kubelet uses %s (%s): pods fail to start or are killed", got, gotFrom, want, from)
		fix := fmt.Sprintf("set SystemdCgroup = %v for the runc runtime in /%s and restart containerd (kiln Prepare with cgroup_driver %q does it)", want == containerd.DriverSystemd, containerd.DefaultConfig, want)
		if file == want {
			msg += fmt.Sprintf("; its config file says %s but containerd was not restarted since", file)
			fix = "restart containerd: systemctl restart containerd"
		}
		return fail(CheckCgroupDriver, errorSev, msg, fix)
	}
	return pass(CheckCgroupDriver, fmt.Sprintf("containerd (%s) and the kubelet both use the %s cgroup driver", gotFrom, want))
}

func (c *Checker) runtimeSocket(running containerd.Running, qerr error) *agentv1.Check {
	if qerr != nil {
		return fail(CheckRuntimeSocket, errorSev, fmt.Sprintf("container runtime socket /%s does not answer: %v", RuntimeSocket, qerr), "start containerd: systemctl enable --now containerd")
	}
	if !running.RuntimeReady {
		return fail(CheckRuntimeSocket, errorSev, fmt.Sprintf("containerd %s answers on /%s but its runtime is not ready", running.Version, RuntimeSocket), "read containerd's log: journalctl -u containerd")
	}
	return pass(CheckRuntimeSocket, fmt.Sprintf("containerd %s answers CRI on /%s", running.Version, RuntimeSocket))
}

func (c *Checker) ports(cluster *agentv1.ClusterConfig) *agentv1.Check {
	want := ports.ControlPlane
	if cluster.GetRole() == "worker" {
		want = ports.Worker
	}
	busy, err := c.busy(want)
	if err != nil {
		return fail(CheckPorts, errorSev, fmt.Sprintf("cannot check ports: %v", err), "")
	}
	if len(busy) > 0 {
		return fail(CheckPorts, errorSev, fmt.Sprintf("ports in use: %s", joinInts(busy)),
			"stop what listens there (ss -ltnp), or run kubeadm reset if an old cluster still runs on this host")
	}
	return pass(CheckPorts, "ports free: "+joinInts(want))
}

func (c *Checker) swap(k kubeletConfiguration) *agentv1.Check {
	active, err := swap.Active(c.root)
	fix := "swapoff -a and comment out swap in /etc/fstab (kiln Prepare does both)"
	if err != nil {
		return fail(CheckSwap, errorSev, fmt.Sprintf("cannot read /proc/swaps: %v", err), fix)
	}
	if len(active) == 0 {
		return pass(CheckSwap, "swap is off")
	}
	msg := "swap is on (" + strings.Join(active, ", ") + ")"
	if k.present && k.FailSwapOn != nil && !*k.FailSwapOn {
		return fail(CheckSwap, agentv1.Severity_SEVERITY_WARNING, msg+": the kubelet allows it (failSwapOn: false) but memory limits are less predictable", fix)
	}
	return fail(CheckSwap, errorSev, msg+": the kubelet refuses to start with swap on", fix)
}

func (c *Checker) versions(ctx context.Context, cluster *agentv1.ClusterConfig) []*agentv1.Check {
	pinned := cluster.GetKubernetesVersion()
	if pinned != "" && !strings.HasPrefix(pinned, "v") {
		pinned = "v" + pinned
	}
	pv, perr := parseVersion(pinned)
	var out []*agentv1.Check
	for _, name := range []string{"kubeadm", "kubelet"} {
		check := name + "-version"
		fix := fmt.Sprintf("install %s %s in /usr/bin (the golden image pins it)", name, pinned)
		if perr != nil {
			out = append(out, fail(check, errorSev, fmt.Sprintf("the cluster's kubernetes_version %q is not a pinned version: %v", cluster.GetKubernetesVersion(), perr), "pin an exact version such as v1.34.4"))
			continue
		}
		path := host.FindKubeBinary(c.root, name)
		if path == "" {
			out = append(out, fail(check, errorSev, name+" is not installed", fix))
			continue
		}
		got, qerr := c.binaryVersion(ctx, name, path)
		if got == pinned {
			out = append(out, pass(check, fmt.Sprintf("%s %s as pinned", name, got)))
			continue
		}
		gv, err := parseVersion(got)
		if err != nil {
			msg := fmt.Sprintf("%s at %s reports no usable version (%q)", name, strings.TrimPrefix(path, c.root), got)
			if qerr != nil {
				msg = fmt.Sprintf("%s at %s did not tell its version: %v", name, strings.TrimPrefix(path, c.root), qerr)
			}
			out = append(out, fail(check, errorSev, msg, fix))
			continue
		}
		if name == "kubeadm" {
			out = append(out, fail(check, errorSev, fmt.Sprintf("kubeadm is %s, the cluster pins %s", got, pinned), fix))
			continue
		}
		// The kubelet may lag the control plane by up to three minors and
		// must never be newer.
		switch {
		case gv.newerThan(pv):
			out = append(out, fail(check, errorSev, fmt.Sprintf("kubelet %s is newer than the control plane %s: the version skew policy forbids it", got, pinned), fix))
		case gv.major != pv.major || pv.minor-gv.minor > 3:
			out = append(out, fail(check, errorSev, fmt.Sprintf("kubelet %s is more than three minor versions older than %s", got, pinned), fix))
		default:
			out = append(out, fail(check, agentv1.Severity_SEVERITY_WARNING, fmt.Sprintf("kubelet %s differs from the pinned %s (within the supported skew)", got, pinned), fix))
		}
	}
	return out
}

// offlineImages fails while the image's offline Kubernetes images are
// not in containerd yet: kubeadm (pull policy Never) would refuse with
// "[ERROR ImagePull] ... image not present locally". On a first boot the
// installed agent checks in while kiln-import-images.service still runs
// (minutes on a slow machine), so the controller's first bootstrap
// attempts come too early; it retries a refused preflight. While the
// marker is missing the message says what the import is doing (running
// and at which archive, failed with its last lines and retrying, not
// started), from the unit's state and the import's log.
func (c *Checker) offlineImages(ctx context.Context) *agentv1.Check {
	dir := filepath.Join(c.root, OfflineImagesDir)
	archives, _ := filepath.Glob(filepath.Join(dir, "*.tar"))
	if len(archives) == 0 {
		return pass(CheckOfflineImages, "no offline image archives in /"+OfflineImagesDir)
	}
	if _, err := os.Stat(filepath.Join(dir, OfflineImagesMarker)); err == nil {
		return pass(CheckOfflineImages, fmt.Sprintf("%d offline image archives imported into containerd", len(archives)))
	}
	uctx, cancel := context.WithTimeout(ctx, c.timeout)
	st, uerr := c.unit(uctx, OfflineImagesUnit)
	cancel()
	status, fix, inProgress := importStatus(st, uerr, lastLines(filepath.Join(dir, OfflineImagesLog), importLogLines))
	ch := fail(CheckOfflineImages, errorSev,
		fmt.Sprintf("the %d offline image archives in /%s are not imported into containerd yet (no %s): kubeadm would find no images (pull policy Never); %s", len(archives), OfflineImagesDir, OfflineImagesMarker, status),
		fix)
	ch.InProgress = inProgress
	return ch
}

// importLogLines is how many of the import log's last lines a message
// quotes.
const importLogLines = 4

// importStatus says what the import unit is doing, from its state and
// its log's last lines (oldest first), and what to do about it;
// inProgress is true while the unit runs or systemd restarts it (the
// check will pass without anyone acting, so the controller retries soon).
func importStatus(st systemd.UnitState, uerr error, lines []string) (status, fix string, inProgress bool) {
	const (
		unit    = OfflineImagesUnit
		journal = "journalctl -u " + unit
	)
	log := "its log is empty"
	failed := false
	if len(lines) > 0 {
		log = "its log: " + strings.Join(lines, " | ")
		for _, l := range lines {
			if strings.Contains(l, "failed:") {
				failed = true
			}
		}
	}
	manual := fmt.Sprintf("or import by hand: for f in /%s/*.tar; do ctr -n k8s.io images import $f; done && touch /%s/%s", OfflineImagesDir, OfflineImagesDir, OfflineImagesMarker)
	switch {
	case uerr != nil:
		return fmt.Sprintf("the state of %s is unknown (%v); %s", unit, uerr, log),
			"see systemctl status " + unit + " and " + journal + ", " + manual, false
	case st.Load == "not-found":
		return fmt.Sprintf("%s does not exist on this host; %s", unit, log),
			"install the unit of the golden image (kiln-imagebuilder), " + manual, false
	case st.Active == "activating" && st.Sub == "auto-restart":
		return fmt.Sprintf("%s failed and systemd restarts it; %s", unit, log),
			"it retries by itself with a growing wait; if it keeps failing, read " + journal + " and fix the cause (containerd running? archives intact?)", true
	case st.Active == "activating" && failed:
		return fmt.Sprintf("%s is retrying after a failure; %s", unit, log),
			"it retries by itself with a growing wait; if it keeps failing, read " + journal + " and fix the cause (containerd running? archives intact?)", true
	case st.Active == "activating":
		return fmt.Sprintf("%s is running; %s", unit, log),
			"wait: the first boot imports the archives once (minutes on a slow machine); the controller retries; progress: " + journal, true
	case st.Active == "failed":
		return fmt.Sprintf("%s failed and is not retried (%s); %s", unit, st.Sub, log),
			"read " + journal + ", fix the cause, then systemctl restart " + unit, false
	case st.Active == "active":
		return fmt.Sprintf("%s finished without writing the marker; %s", unit, log),
			"read " + journal + ", then rm -f /run/kiln/import-images.attempts && systemctl restart " + unit, false
	}
	return fmt.Sprintf("%s has not started (%s, unit file %s); %s", unit, st.Active, st.UnitFile, log),
		"systemctl enable --now " + unit + " (the golden image enables it for multi-user.target), " + manual, false
}

// lastLines returns the last n non-empty lines of a file (none when it
// cannot be read), each cut to 200 bytes.
func lastLines(path string, n int) []string {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	var out []string
	for l := range strings.Lines(string(b)) {
		l = strings.TrimSpace(l)
		if l == "" {
			continue
		}
		if len(l) > 200 {
			l = l[:200] + "..."
		}
		out = append(out, l)
	}
	if len(out) > n {
		out = out[len(out)-n:]
	}
	return out
}

// unitState reads a unit's state from the systemd of root (a NotSupported
// error without one).
func unitState(root string) func(ctx context.Context, name string) (systemd.UnitState, error) {
	return func(ctx context.Context, name string) (systemd.UnitState, error) {
		m, err := systemd.Dial(ctx, root)
		if err != nil {
			return systemd.UnitState{}, err
		}
		defer m.Close()
		return m.State(ctx, name)
	}
}

func (c *Checker) binaryVersion(ctx context.Context, name, path string) (string, error) {
	args := []string{"--version"}
	if name == "kubeadm" {
		args = []string{"version", "-o", "short"}
	}
	qctx, cancel := context.WithTimeout(ctx, c.versionTimeout)
	defer cancel()
	out, err := c.run.Run(qctx, path, args...)
	if err != nil {
		c.log.WarnContext(ctx, "version query failed", "binary", name, "error", err)
		if qctx.Err() != nil && ctx.Err() == nil {
			return "", fmt.Errorf("%s %s did not answer within %s (a slow or loaded host; the controller retries)", name, strings.Join(args, " "), c.versionTimeout)
		}
		return "", fmt.Errorf("%s %s: %w", name, strings.Join(args, " "), err)
	}
	return host.KubeVersion(string(out)), nil
}

type semver struct{ major, minor, patch int }

func (a semver) newerThan(b semver) bool {
	if a.major != b.major {
		return a.major > b.major
	}
	if a.minor != b.minor {
		return a.minor > b.minor
	}
	return a.patch > b.patch
}

// parseVersion parses "v1.34.4" (a pre-release or build suffix is
// ignored).
func parseVersion(v string) (semver, error) {
	s, ok := strings.CutPrefix(v, "v")
	if !ok {
		return semver{}, fmt.Errorf("want vMAJOR.MINOR.PATCH")
	}
	if i := strings.IndexAny(s, "-+"); i >= 0 {
		s = s[:i]
	}
	parts := strings.Split(s, ".")
	if len(parts) != 3 {
		return semver{}, fmt.Errorf("want vMAJOR.MINOR.PATCH")
	}
	var n [3]int
	for i, p := range parts {
		x, err := strconv.Atoi(p)
		if err != nil || x < 0 {
			return semver{}, fmt.Errorf("want vMAJOR.MINOR.PATCH")
		}
		n[i] = x
	}
	return semver{n[0], n[1], n[2]}, nil
}

func joinInts(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, ", ")
}

func readTrim(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}
