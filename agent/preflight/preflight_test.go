package preflight

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kilnhq/kiln/agent/prep"
	"github.com/kilnhq/kiln/host/command"
	"github.com/kilnhq/kiln/host/containerd"
	"github.com/kilnhq/kiln/host/containerd/containerdtest"
	"github.com/kilnhq/kiln/host/kmod"
	"github.com/kilnhq/kiln/host/netcheck"
	"github.com/kilnhq/kiln/host/netnstest"
	"github.com/kilnhq/kiln/host/sysctl"
	"github.com/kilnhq/kiln/host/systemd"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

const pinned = "v1.34.4"

func write(t testing.TB, path, content string, mode os.FileMode) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	require.NoError(t, os.WriteFile(path, []byte(content), mode))
}

func logger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, nil))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(b)))
	return len(b), nil
}

// installKube puts kubeadm and kubelet scripts that print their versions
// under root/usr/bin (no real kubeadm binary is built on these machines).
func installKube(t testing.TB, root, kubeadm, kubelet string) {
	write(t, filepath.Join(root, "usr/bin/kubeadm"), "#!/bin/sh\n[ \"$1 $2 $3\" = \"version -o short\" ] || exit 2\necho "+kubeadm+"\n", 0o755)
	write(t, filepath.Join(root, "usr/bin/kubelet"), "#!/bin/sh\n[ \"$1\" = \"--version\" ] || exit 2\necho Kubernetes "+kubelet+"\n", 0o755)
}

func cluster() *agentv1.ClusterConfig {
	return &agentv1.ClusterConfig{
		Name:              "lab",
		KubernetesVersion: pinned,
		PodCidr:           "10.244.0.0/16",
		ServiceCidr:       "10.96.0.0/12",
		CgroupDriver:      "systemd",
		Role:              "control-plane",
	}
}

func byName(r *agentv1.PreflightReport) map[string]*agentv1.Check {
	m := map[string]*agentv1.Check{}
	for _, c := range r.GetChecks() {
		m[c.Name] = c
	}
	return m
}

// requireModules skips when a module Prepare needs is not already in the
// kernel: tests do not load modules into the machine's kernel.
func requireModules(t testing.TB) {
	release, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	for _, m := range []string{"br_netfilter", "overlay"} {
		if st, _ := kmod.Status("/", strings.TrimSpace(string(release)), m); !st.Available() {
			testenv.Skipf(t, "kernel module %s is not loaded on this machine; these tests do not load modules", m)
		}
	}
}

// labUnits restarts the test's containerd the way systemd would.
type labUnits struct{ d *containerdtest.Daemon }

func (l labUnits) Enable(context.Context, string) (bool, error) { return false, nil }
func (l labUnits) Restart(context.Context, string) error        { l.d.Restart(); return nil }
func (l labUnits) Close() error                                 { return nil }

// preparedHost is a fresh network namespace and a root (the running
// kernel's /proc and /sys, a temporary /etc, /usr/bin and /run) with a
// real containerd running under it, that kiln Prepare has made ready, with
// the pinned kubeadm and kubelet installed.
func preparedHost(t *testing.T) (*netnstest.NS, string, *containerdtest.Daemon) {
	d := containerdtest.New(t)
	ns := netnstest.New(t)
	requireModules(t)
	root := d.Root
	require.NoError(t, os.Symlink("/proc", filepath.Join(root, "proc")))
	require.NoError(t, os.Symlink("/sys", filepath.Join(root, "sys")))
	installKube(t, root, pinned, pinned)
	d.Start()
	var err error
	ns.Do(t, func() {
		p := prep.New(root, &command.Recorder{}, logger(t), prep.WithUnits(func(context.Context, string) (prep.Units, error) { return labUnits{d}, nil }))
		_, err = p.Prepare(context.Background(), &agentv1.PrepareRequest{CgroupDriver: "systemd"}, nil)
	})
	require.NoError(t, err)
	return ns, root, d
}

func run(t *testing.T, ns *netnstest.NS, root string, cfg *agentv1.ClusterConfig) *agentv1.PreflightReport {
	var r *agentv1.PreflightReport
	var err error
	ns.Do(t, func() {
		r, err = New(root, command.Exec{}, logger(t)).Run(context.Background(), cfg)
	})
	require.NoError(t, err)
	for _, c := range r.Checks {
		t.Logf("%-24s passed=%-5v %-16s %s | fix: %s", c.Name, c.Passed, c.Severity, c.Message, c.Fix)
	}
	return r
}

func TestPreflightPreparedHostPasses(t *testing.T) {
	ns, root, _ := preparedHost(t)
	r := run(t, ns, root, cluster())
	for _, c := range r.Checks {
		if !c.Passed {
			t.Errorf("Run() check %s failed on a prepared host: %s", c.Name, c.Message)
		}
	}
	if !r.Passed {
		t.Errorf("Run() passed = false on a prepared host, want true")
	}
	if len(r.Checks) != 12 {
		t.Errorf("Run() ran %d checks, want 12", len(r.Checks))
	}
}

// TestPreflightFindsProblems breaks one thing at a time on a prepared host
// and expects exactly that check to fail, naming the problem and the fix.
func TestPreflightFindsProblems(t *testing.T) {
	tests := []struct {
		name     string
		breakIt  func(t *testing.T, ns *netnstest.NS, root string, d *containerdtest.Daemon)
		check    string
		message  []string
		fix      string
		severity agentv1.Severity
	}{
		{
			name: "ip_forward off",
			breakIt: func(t *testing.T, ns *netnstest.NS, root string, _ *containerdtest.Daemon) {
				ns.Do(t, func() { require.NoError(t, sysctl.Set("/", "net.ipv4.ip_forward", "0")) })
			},
			check:   CheckIPForward,
			message: []string{"net.ipv4.ip_forward is 0, want 1"},
			fix:     "sysctl -w net.ipv4.ip_forward=1",
		},
		{
			name: "bridge-nf-call-iptables off",
			breakIt: func(t *testing.T, ns *netnstest.NS, root string, _ *containerdtest.Daemon) {
				ns.Do(t, func() { require.NoError(t, sysctl.Set("/", "net.bridge.bridge-nf-call-iptables", "0")) })
			},
			check:   CheckBridgeNF,
			message: []string{"is 0, want 1", "kubeadm no longer checks this", "Flannel crash-loops"},
			fix:     "bridge-nf-call-iptables=1",
		},
		{
			name: "pod CIDR over a host route",
			breakIt: func(t *testing.T, ns *netnstest.NS, root string, _ *containerdtest.Daemon) {
				br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "kiln0"}}
				require.NoError(t, ns.Netlink.LinkAdd(br))
				link, err := ns.Netlink.LinkByName("kiln0")
				require.NoError(t, err)
				require.NoError(t, ns.Netlink.LinkSetUp(link))
				_, dst, _ := net.ParseCIDR("10.244.0.0/16")
				require.NoError(t, ns.Netlink.RouteAdd(&netlink.Route{LinkIndex: link.Attrs().Index, Dst: dst}))
			},
			check:   CheckPodCIDR,
			message: []string{"pod CIDR 10.244.0.0/16 overlaps host route 10.244.0.0/16 dev kiln0"},
			fix:     "choose a pod CIDR",
		},
		{
			name: "service CIDR over a host address",
			breakIt: func(t *testing.T, ns *netnstest.NS, root string, _ *containerdtest.Daemon) {
				lo, err := ns.Netlink.LinkByName("lo")
				require.NoError(t, err)
				addr, _ := netlink.ParseAddr("10.100.0.1/32")
				require.NoError(t, ns.Netlink.AddrAdd(lo, addr))
			},
			check:   CheckServiceCIDR,
			message: []string{"service CIDR 10.96.0.0/12 overlaps host address 10.100.0.1/32 dev lo"},
			fix:     "choose a service CIDR",
		},
		{
			name: "containerd on cgroupfs, kubelet on systemd",
			breakIt: func(t *testing.T, _ *netnstest.NS, root string, d *containerdtest.Daemon) {
				_, _, err := containerd.WriteSystemdCgroup(d.Config, false)
				require.NoError(t, err)
				d.Restart()
			},
			check:   CheckCgroupDriver,
			message: []string{"containerd uses the cgroupfs cgroup driver (the running containerd)", "the kubelet uses systemd"},
			fix:     "SystemdCgroup = true",
		},
		{
			name: "containerd not restarted after its config changed",
			breakIt: func(t *testing.T, _ *netnstest.NS, root string, d *containerdtest.Daemon) {
				write(t, filepath.Join(root, KubeletConfig), "cgroupDriver: cgroupfs\n", 0o644)
				_, _, err := containerd.WriteSystemdCgroup(d.Config, false)
				require.NoError(t, err)
			},
			check:   CheckCgroupDriver,
			message: []string{"containerd uses the systemd cgroup driver (the running containerd)", "its config file says cgroupfs but containerd was not restarted"},
			fix:     "systemctl restart containerd",
		},
		{
			name: "kubelet config says cgroupfs, containerd systemd",
			breakIt: func(t *testing.T, _ *netnstest.NS, root string, _ *containerdtest.Daemon) {
				write(t, filepath.Join(root, KubeletConfig), "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\ncgroupDriver: cgroupfs\n", 0o644)
			},
			check:   CheckCgroupDriver,
			message: []string{"containerd uses the systemd cgroup driver", "kubelet uses cgroupfs (/var/lib/kubelet/config.yaml)"},
			fix:     "SystemdCgroup = false",
		},
		{
			name: "runtime socket silent",
			breakIt: func(t *testing.T, _ *netnstest.NS, root string, d *containerdtest.Daemon) {
				d.Stop()
			},
			check:   CheckRuntimeSocket,
			message: []string{"run/containerd/containerd.sock does not answer"},
			fix:     "start containerd",
		},
		{
			name: "API server port taken",
			breakIt: func(t *testing.T, ns *netnstest.NS, root string, _ *containerdtest.Daemon) {
				ns.Do(t, func() {
					l, err := net.Listen("tcp", "127.0.0.1:6443")
					require.NoError(t, err)
					t.Cleanup(func() { l.Close() })
				})
			},
			check:   CheckPorts,
			message: []string{"ports in use: 6443"},
			fix:     "kubeadm reset",
		},
		{
			name: "kubeadm not the pinned version",
			breakIt: func(t *testing.T, _ *netnstest.NS, root string, _ *containerdtest.Daemon) {
				installKube(t, root, "v1.34.3", pinned)
			},
			check:   CheckKubeadmVersion,
			message: []string{"kubeadm is v1.34.3, the cluster pins v1.34.4"},
			fix:     "install kubeadm v1.34.4",
		},
		{
			name: "kubelet newer than the control plane",
			breakIt: func(t *testing.T, _ *netnstest.NS, root string, _ *containerdtest.Daemon) {
				installKube(t, root, pinned, "v1.35.0")
			},
			check:   CheckKubeletVersion,
			message: []string{"kubelet v1.35.0 is newer than the control plane v1.34.4"},
			fix:     "install kubelet v1.34.4",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ns, root, d := preparedHost(t)
			tt.breakIt(t, ns, root, d)
			r := run(t, ns, root, cluster())
			if r.Passed {
				t.Errorf("Run() passed = true, want false")
			}
			for _, c := range r.Checks {
				if c.Name != tt.check && !c.Passed {
					t.Errorf("Run() check %s failed (%s), want only %s to fail", c.Name, c.Message, tt.check)
				}
			}
			c := byName(r)[tt.check]
			require.NotNil(t, c, "check %s in report", tt.check)
			if c.Passed || c.Severity != agentv1.Severity_SEVERITY_ERROR {
				t.Errorf("Run() check %s = passed %v severity %v, want failed ERROR", tt.check, c.Passed, c.Severity)
			}
			for _, m := range tt.message {
				if !strings.Contains(c.Message, m) {
					t.Errorf("Run() check %s message = %q, want it to say %q", tt.check, c.Message, m)
				}
			}
			if !strings.Contains(c.Fix, tt.fix) {
				t.Errorf("Run() check %s fix = %q, want it to say %q", tt.check, c.Fix, tt.fix)
			}
		})
	}
}

// fileHost is a root made only of files, with the network checks and the
// containerd query answered by stand-ins that tests may replace to inject
// faults: for checks that need neither root nor a namespace.
func fileHost(t *testing.T, kubeadm, kubelet string) (*Checker, string) {
	root := t.TempDir()
	write(t, filepath.Join(root, "proc/sys/net/ipv4/ip_forward"), "1\n", 0o644)
	write(t, filepath.Join(root, "proc/sys/net/bridge/bridge-nf-call-iptables"), "1\n", 0o644)
	write(t, filepath.Join(root, "proc/swaps"), "Filename\tType\tSize\tUsed\tPriority\n", 0o644)
	write(t, filepath.Join(root, containerd.DefaultConfig), "version = 3\n[plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.runc.options]\nSystemdCgroup = true\n", 0o644)
	if kubeadm != "" {
		installKube(t, root, kubeadm, kubelet)
	}
	c := New(root, command.Exec{}, logger(t))
	c.networks = func() ([]netcheck.Network, []netcheck.Network, error) { return nil, nil, nil }
	c.busy = func([]int) ([]int, error) { return nil, nil }
	c.query = func(context.Context, string) (containerd.Running, error) {
		return containerd.Running{Version: "1.6.20", RuntimeName: "runc", SystemdCgroup: true, RuntimeReady: true}, nil
	}
	return c, root
}

func TestVersionSkew(t *testing.T) {
	tests := []struct {
		kubeadm, kubelet string
		check            string
		passed           bool
		severity         agentv1.Severity
		message          string
	}{
		{pinned, pinned, CheckKubeletVersion, true, agentv1.Severity_SEVERITY_INFO, "kubelet v1.34.4 as pinned"},
		{pinned, "v1.33.7", CheckKubeletVersion, false, agentv1.Severity_SEVERITY_WARNING, "within the supported skew"},
		{pinned, "v1.31.0", CheckKubeletVersion, false, agentv1.Severity_SEVERITY_WARNING, "within the supported skew"},
		{pinned, "v1.30.14", CheckKubeletVersion, false, agentv1.Severity_SEVERITY_ERROR, "more than three minor versions older"},
		{pinned, "v1.34.5", CheckKubeletVersion, false, agentv1.Severity_SEVERITY_ERROR, "newer than the control plane"},
		{"v1.35.0", pinned, CheckKubeadmVersion, false, agentv1.Severity_SEVERITY_ERROR, "kubeadm is v1.35.0, the cluster pins v1.34.4"},
		{"", "", CheckKubeadmVersion, false, agentv1.Severity_SEVERITY_ERROR, "kubeadm is not installed"},
		{"", "", CheckKubeletVersion, false, agentv1.Severity_SEVERITY_ERROR, "kubelet is not installed"},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("kubeadm %s kubelet %s", tt.kubeadm, tt.kubelet), func(t *testing.T) {
			c, _ := fileHost(t, tt.kubeadm, tt.kubelet)
			r, err := c.Run(context.Background(), cluster())
			require.NoError(t, err)
			got := byName(r)[tt.check]
			require.NotNil(t, got)
			if got.Passed != tt.passed || got.Severity != tt.severity || !strings.Contains(got.Message, tt.message) {
				t.Errorf("Run() check %s = %v %v %q, want %v %v containing %q", tt.check, got.Passed, got.Severity, got.Message, tt.passed, tt.severity, tt.message)
			}
			wantPassed := tt.severity != agentv1.Severity_SEVERITY_ERROR
			if r.Passed != wantPassed {
				t.Errorf("Run() report passed = %v, want %v", r.Passed, wantPassed)
			}
		})
	}
}

func TestSwapAndConfigErrors(t *testing.T) {
	c, root := fileHost(t, pinned, pinned)
	swaps := "Filename\tType\tSize\tUsed\tPriority\n/swapfile\tfile\t1048572\t0\t-2\n"
	write(t, filepath.Join(root, "proc/swaps"), swaps, 0o644)

	r, err := c.Run(context.Background(), cluster())
	require.NoError(t, err)
	if s := byName(r)[CheckSwap]; s.Passed || s.Severity != agentv1.Severity_SEVERITY_ERROR || !strings.Contains(s.Message, "/swapfile") {
		t.Errorf("Run() swap check with swap on = %v, want a failed ERROR naming /swapfile", s)
	}

	write(t, filepath.Join(root, KubeletConfig), "cgroupDriver: systemd\nfailSwapOn: false\n", 0o644)
	r, err = c.Run(context.Background(), cluster())
	require.NoError(t, err)
	if s := byName(r)[CheckSwap]; s.Passed || s.Severity != agentv1.Severity_SEVERITY_WARNING {
		t.Errorf("Run() swap check with failSwapOn false = %v, want a WARNING", s)
	}

	cfg := cluster()
	cfg.PodCidr = "10.96.0.0/16"
	r, err = c.Run(context.Background(), cfg)
	require.NoError(t, err)
	if p := byName(r)[CheckPodCIDR]; p.Passed || !strings.Contains(p.Message, "overlaps service CIDR") {
		t.Errorf("Run() pod CIDR inside the service CIDR = %v, want a failed check", p)
	}
	cfg.PodCidr = "10.244.0.0"
	r, err = c.Run(context.Background(), cfg)
	require.NoError(t, err)
	if p := byName(r)[CheckPodCIDR]; p.Passed {
		t.Errorf("Run() pod CIDR %q = %v, want a failed check", cfg.PodCidr, p)
	}

	if _, err := c.Run(context.Background(), nil); err == nil {
		t.Errorf("Run(nil) error = nil, want InvalidArgument")
	}
}

// TestOfflineImagesImported: on a golden image's first boot the
// installed agent answers while kiln-import-images.service still imports
// the Kubernetes images (minutes under TCG); preflight refuses until the
// import's marker exists, instead of kubeadm failing on ImagePull.
func TestOfflineImagesImported(t *testing.T) {
	c, root := fileHost(t, pinned, pinned)
	check := func() *agentv1.Check {
		t.Helper()
		r, err := c.Run(context.Background(), cluster())
		require.NoError(t, err)
		got := byName(r)[CheckOfflineImages]
		require.NotNil(t, got)
		require.Equal(t, got.Passed, r.Passed, "report passed with check %v", got)
		return got
	}
	require.True(t, check().Passed, "no archives (an image without offline images)")

	dir := filepath.Join(root, OfflineImagesDir)
	write(t, filepath.Join(dir, "kube-apiserver.tar"), "x", 0o644)
	write(t, filepath.Join(dir, "etcd.tar"), "x", 0o644)
	got := check()
	require.False(t, got.Passed)
	require.Equal(t, agentv1.Severity_SEVERITY_ERROR, got.Severity)
	require.Contains(t, got.Message, "the 2 offline image archives in /var/lib/kiln/images are not imported into containerd yet")
	require.Contains(t, got.Fix, "kiln-import-images")

	write(t, filepath.Join(dir, OfflineImagesMarker), "", 0o644)
	got = check()
	require.True(t, got.Passed, "%v", got)
	require.Contains(t, got.Message, "2 offline image archives imported")
}

// TestOfflineImagesStatus: while the import's marker is missing, the
// check says what kiln-import-images.service is doing (from its state and
// its log) so that `kilnctl describe` names the cause: a run under TCG
// was refused for 21 minutes with only "not imported yet".
func TestOfflineImagesStatus(t *testing.T) {
	const (
		started   = "2026-12-07T02:00:00Z attempt 1: importing 7 archives\n"
		importing = started + "2026-12-07T02:00:01Z importing 3/7 kube-apiserver.tar\n"
		failedLog = importing +
			"2026-12-07T02:03:00Z   ctr: failed to ingest \"blobs/sha256/9f1c\": unexpected EOF\n" +
			"2026-12-07T02:03:00Z failed: importing kube-apiserver.tar: ctr exited 1\n"
		retrying = failedLog + "2026-12-07T02:03:05Z attempt 2: retrying in 10s\n"
	)
	unit := func(active, sub string) func(context.Context, string) (systemd.UnitState, error) {
		return func(_ context.Context, name string) (systemd.UnitState, error) {
			if name != OfflineImagesUnit {
				return systemd.UnitState{}, fmt.Errorf("unit %s: unexpected", name)
			}
			return systemd.UnitState{Load: "loaded", Active: active, Sub: sub, UnitFile: "enabled"}, nil
		}
	}
	tests := []struct {
		name     string
		log      string
		unit     func(context.Context, string) (systemd.UnitState, error)
		wantMsg  []string
		wantFix  string
		notInMsg string
		// wantInProgress: the import runs (or systemd restarts it), so
		// the controller retries soon instead of backing off.
		wantInProgress bool
	}{
		{
			name:           "running: names the archive it is at",
			wantInProgress: true,
			log:            importing,
			unit:           unit("activating", "start"),
			wantMsg:        []string{"kiln-import-images.service is running; its log: ", "importing 3/7 kube-apiserver.tar"},
			wantFix:        "wait: the first boot imports the archives once",
		},
		{
			name:           "failed, waiting to restart: quotes ctr's error",
			wantInProgress: true,
			log:            failedLog,
			unit:           unit("activating", "auto-restart"),
			wantMsg:        []string{"failed and systemd restarts it", `ctr: failed to ingest "blobs/sha256/9f1c": unexpected EOF`, "failed: importing kube-apiserver.tar: ctr exited 1"},
			wantFix:        "it retries by itself",
		},
		{
			name:           "retrying after a failure (waiting its backoff)",
			wantInProgress: true,
			log:            retrying,
			unit:           unit("activating", "start"),
			wantMsg:        []string{"is retrying after a failure", "attempt 2: retrying in 10s", "failed: importing kube-apiserver.tar"},
			wantFix:        "journalctl -u kiln-import-images.service",
			notInMsg:       "attempt 1: importing 7 archives", // only the last lines
		},
		{
			name:    "failed for good",
			log:     failedLog,
			unit:    unit("failed", "failed"),
			wantMsg: []string{"failed and is not retried (failed)", "ctr exited 1"},
			wantFix: "systemctl restart kiln-import-images.service",
		},
		{
			name:    "not started",
			unit:    unit("inactive", "dead"),
			wantMsg: []string{"kiln-import-images.service has not started (inactive, unit file enabled); its log is empty"},
			wantFix: "systemctl enable --now kiln-import-images.service",
		},
		{
			name: "no such unit",
			unit: func(context.Context, string) (systemd.UnitState, error) {
				return systemd.UnitState{Load: "not-found", Active: "inactive", Sub: "dead"}, nil
			},
			wantMsg: []string{"kiln-import-images.service does not exist on this host"},
			wantFix: "ctr -n k8s.io images import",
		},
		{
			name: "no systemd: the log still tells",
			log:  importing,
			unit: func(context.Context, string) (systemd.UnitState, error) {
				return systemd.UnitState{}, errdefs.NotSupported("no systemd D-Bus at /run/dbus/system_bus_socket")
			},
			wantMsg: []string{"the state of kiln-import-images.service is unknown (no systemd D-Bus at /run/dbus/system_bus_socket)", "importing 3/7 kube-apiserver.tar"},
			wantFix: "systemctl status kiln-import-images.service",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, root := fileHost(t, pinned, pinned)
			c.unit = tt.unit
			dir := filepath.Join(root, OfflineImagesDir)
			write(t, filepath.Join(dir, "kube-apiserver.tar"), "x", 0o644)
			if tt.log != "" {
				write(t, filepath.Join(dir, OfflineImagesLog), tt.log, 0o644)
			}
			r, err := c.Run(context.Background(), cluster())
			require.NoError(t, err)
			got := byName(r)[CheckOfflineImages]
			t.Logf("message: %s\nfix: %s", got.Message, got.Fix)
			require.False(t, r.Passed)
			if got.Passed || got.Severity != agentv1.Severity_SEVERITY_ERROR {
				t.Fatalf("offlineImages() = %v, want a failed ERROR check", got)
			}
			require.Contains(t, got.Message, "the 1 offline image archives in /var/lib/kiln/images are not imported into containerd yet")
			for _, w := range tt.wantMsg {
				if !strings.Contains(got.Message, w) {
					t.Errorf("offlineImages() message = %q, want it to contain %q", got.Message, w)
				}
			}
			if tt.notInMsg != "" && strings.Contains(got.Message, tt.notInMsg) {
				t.Errorf("offlineImages() message = %q, want no %q", got.Message, tt.notInMsg)
			}
			if !strings.Contains(got.Fix, tt.wantFix) {
				t.Errorf("offlineImages() fix = %q, want it to contain %q", got.Fix, tt.wantFix)
			}
			if got.InProgress != tt.wantInProgress {
				t.Errorf("offlineImages().InProgress = %v, want %v", got.InProgress, tt.wantInProgress)
			}
		})
	}
}

// TestSlowVersionQuery: a kubeadm that does not answer in time is named
// as such, not as a binary with "no usable version" (what a loaded TCG
// VM showed).
func TestSlowVersionQuery(t *testing.T) {
	c, root := fileHost(t, pinned, pinned)
	write(t, filepath.Join(root, "usr/bin/kubeadm"), "#!/bin/sh\nsleep 5\necho "+pinned+"\n", 0o755)
	c.versionTimeout = 200 * time.Millisecond
	r, err := c.Run(context.Background(), cluster())
	require.NoError(t, err)
	got := byName(r)[CheckKubeadmVersion]
	require.False(t, got.Passed)
	require.Contains(t, got.Message, "kubeadm at /usr/bin/kubeadm did not tell its version: kubeadm version -o short did not answer within 200ms")
	require.True(t, byName(r)[CheckKubeletVersion].Passed)
}

func TestRuntimeFaults(t *testing.T) {
	tests := []struct {
		name        string
		query       func(context.Context, string) (containerd.Running, error)
		wantRuntime string
		wantCgroup  bool
	}{
		{
			name: "containerd down: the cgroup check falls back to the file",
			query: func(context.Context, string) (containerd.Running, error) {
				return containerd.Running{}, errdefs.Unavailable("connection refused")
			},
			wantRuntime: "does not answer: connection refused",
			wantCgroup:  true,
		},
		{
			name: "runtime not ready",
			query: func(context.Context, string) (containerd.Running, error) {
				return containerd.Running{Version: "1.6.20", SystemdCgroup: true}, nil
			},
			wantRuntime: "runtime is not ready",
			wantCgroup:  true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, _ := fileHost(t, pinned, pinned)
			c.query = tt.query
			r, err := c.Run(context.Background(), cluster())
			require.NoError(t, err)
			rt := byName(r)[CheckRuntimeSocket]
			if rt.Passed || !strings.Contains(rt.Message, tt.wantRuntime) {
				t.Errorf("Run() runtime check = %v, want failed with %q", rt, tt.wantRuntime)
			}
			if cg := byName(r)[CheckCgroupDriver]; cg.Passed != tt.wantCgroup {
				t.Errorf("Run() cgroup check = %v, want passed %v", cg, tt.wantCgroup)
			}
			if r.Passed {
				t.Errorf("Run() passed = true with a failed runtime, want false")
			}
		})
	}
}

// BenchmarkPreflight measures a full Preflight on a prepared host with a
// running containerd, in a fresh network namespace; it includes running
// kubeadm and kubelet (shell stand-ins here) for their versions.
func BenchmarkPreflight(b *testing.B) {
	d := containerdtest.New(b)
	ns := netnstest.New(b)
	requireModules(b)
	root := d.Root
	require.NoError(b, os.Symlink("/proc", filepath.Join(root, "proc")))
	require.NoError(b, os.Symlink("/sys", filepath.Join(root, "sys")))
	installKube(b, root, pinned, pinned)
	d.Start()
	ctx := context.Background()
	ns.Do(b, func() {
		p := prep.New(root, &command.Recorder{}, slog.New(slog.DiscardHandler), prep.WithUnits(func(context.Context, string) (prep.Units, error) { return labUnits{d}, nil }))
		_, err := p.Prepare(ctx, &agentv1.PrepareRequest{}, nil)
		require.NoError(b, err)
		c := New(root, command.Exec{}, slog.New(slog.DiscardHandler))
		b.ResetTimer()
		for b.Loop() {
			r, err := c.Run(ctx, cluster())
			if err != nil || !r.Passed {
				b.Fatalf("Run() = %v, %v, want passed", r, err)
			}
		}
	})
}
