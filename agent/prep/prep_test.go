package prep

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/host/command"
	"github.com/kilnhq/kiln/host/containerd"
	"github.com/kilnhq/kiln/host/containerd/containerdtest"
	"github.com/kilnhq/kiln/host/kmod"
	"github.com/kilnhq/kiln/host/netnstest"
	"github.com/kilnhq/kiln/host/sysctl"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

func write(t testing.TB, path, content string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	require.NoError(t, os.WriteFile(path, []byte(content), 0o644))
}

const debianContainerd = "version = 2\n\n[plugins]\n  [plugins.\"io.containerd.grpc.v1.cri\"]\n    [plugins.\"io.containerd.grpc.v1.cri\".cni]\n      bin_dir = \"/usr/lib/cni\"\n"

const fstab = "UUID=1234 / ext4 errors=remount-ro 0 1\n/swapfile none swap sw 0 0\n"

// liveRoot is a host root whose /proc and /sys are the running kernel's
// (so sysctls hit the calling thread's network namespace) and whose /etc
// is a temporary tree.
func liveRoot(t testing.TB) string {
	root := t.TempDir()
	require.NoError(t, os.Symlink("/proc", filepath.Join(root, "proc")))
	require.NoError(t, os.Symlink("/sys", filepath.Join(root, "sys")))
	write(t, filepath.Join(root, "etc/fstab"), fstab)
	write(t, filepath.Join(root, containerd.DefaultConfig), debianContainerd)
	return root
}

func logger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, nil))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(b)))
	return len(b), nil
}

func items(res *agentv1.PrepareResult) []string {
	var out []string
	for _, c := range res.GetChanges() {
		out = append(out, fmt.Sprintf("%s: %s -> %s", c.Item, c.Before, c.After))
	}
	return out
}

// TestPrepareInNamespace is the real thing in a fresh network namespace:
// the per-namespace sysctls go from 0 to 1 and read back as 1 inside it,
// the config files appear under the root, a second run changes nothing,
// and the host's own values never move.
func TestPrepareInNamespace(t *testing.T) {
	ns := netnstest.New(t)
	root := liveRoot(t)
	ctx := context.Background()
	keys := []string{"net.ipv4.ip_forward", "net.bridge.bridge-nf-call-iptables", "net.bridge.bridge-nf-call-ip6tables"}
	hostBefore := map[string]string{}
	for _, k := range keys {
		v, err := sysctl.Get("/", k)
		if errdefs.IsNotFound(err) {
			testenv.Skipf(t, "kernel has no %s (br_netfilter not available)", k)
		}
		require.NoError(t, err)
		hostBefore[k] = v
	}

	requireModules(t)
	run := &command.Recorder{}
	p := New(root, run, logger(t))
	var first, second *agentv1.PrepareResult
	var progress []string
	var err1, err2 error
	nsValues := map[string]string{}
	ns.Do(t, func() {
		// A fresh namespace starts with ip_forward 0; make the bridge
		// ones 0 as well so that Prepare has to change them.
		for _, k := range keys {
			require.NoError(t, sysctl.Set("/", k, "0"))
		}
		first, err1 = p.Prepare(ctx, &agentv1.PrepareRequest{}, func(s string) { progress = append(progress, s) })
		second, err2 = p.Prepare(ctx, &agentv1.PrepareRequest{}, nil)
		for _, k := range keys {
			v, err := os.ReadFile(sysctl.Path("/", k))
			require.NoError(t, err)
			nsValues[k] = strings.TrimSpace(string(v))
		}
	})
	require.NoError(t, err1)
	require.NoError(t, err2)
	t.Logf("first Prepare changes:\n%s", strings.Join(items(first), "\n"))

	for _, k := range keys {
		if nsValues[k] != "1" {
			t.Errorf("/proc/sys %s in the namespace after Prepare = %q, want 1", k, nsValues[k])
		}
		want := fmt.Sprintf("sysctl %s: 0 -> 1", k)
		if !slices.Contains(items(first), want) {
			t.Errorf("Prepare() changes = %q, want %q", items(first), want)
		}
	}
	if !first.Changed {
		t.Errorf("first Prepare() changed = false, want true")
	}
	if second.Changed || len(second.Changes) != 0 {
		t.Errorf("second Prepare() = changed %v %q, want no change", second.Changed, items(second))
	}

	persisted, err := sysctl.Persisted(root)
	require.NoError(t, err)
	for _, k := range keys {
		if persisted[k] != "1" {
			t.Errorf("%s: %s = %q, want 1", sysctl.PersistFile, k, persisted[k])
		}
	}
	mods, err := os.ReadFile(filepath.Join(root, kmod.PersistFile))
	require.NoError(t, err)
	for _, m := range modules {
		if !strings.Contains(string(mods), m+"\n") {
			t.Errorf("%s = %q, want %s listed", kmod.PersistFile, mods, m)
		}
	}
	b, err := os.ReadFile(filepath.Join(root, "etc/fstab"))
	require.NoError(t, err)
	if want := "UUID=1234 / ext4 errors=remount-ro 0 1\n#/swapfile none swap sw 0 0\n"; string(b) != want {
		t.Errorf("fstab after Prepare = %q, want %q", b, want)
	}
	sc, set, err := containerd.ReadSystemdCgroup(filepath.Join(root, containerd.DefaultConfig))
	require.NoError(t, err)
	if !sc || !set {
		t.Errorf("containerd SystemdCgroup after Prepare = %v (set %v), want true (default driver systemd)", sc, set)
	}
	// The temporary root has no system bus: enabling units is skipped,
	// and said, without failing.
	if !slices.ContainsFunc(progress, func(s string) bool { return strings.Contains(s, "no systemd D-Bus at") }) {
		t.Errorf("Prepare() progress = %q, want a note that units were skipped for lack of systemd D-Bus", progress)
	}
	// modules are built in or loaded here: modprobe never ran; no swap
	// was active, so no swapoff either.
	for _, l := range run.Lines() {
		if strings.HasPrefix(l, "modprobe") {
			t.Errorf("Prepare() ran %q, want no modprobe for available modules", l)
		}
	}

	for _, k := range keys {
		got, err := sysctl.Get("/", k)
		require.NoError(t, err)
		if got != hostBefore[k] {
			t.Errorf("host %s = %q after Prepare in a namespace, want unchanged %q", k, got, hostBefore[k])
		}
	}
}

// requireModules skips the test when a module Prepare needs is not
// already available on the host: tests do not load modules into the
// machine's kernel (the QEMU lab tests the modprobe path).
func requireModules(t testing.TB) {
	release, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	for _, m := range modules {
		st, err := kmod.Status("/", strings.TrimSpace(string(release)), m)
		require.NoError(t, err)
		if !st.Available() {
			testenv.Skipf(t, "kernel module %s is not loaded on this machine; this test does not load modules", m)
		}
	}
}

// fakeRoot is a host root made only of files: /proc/sys values, no
// active swap, overlay built in, br_netfilter missing.
func fakeRoot(t testing.TB) string {
	root := t.TempDir()
	write(t, filepath.Join(root, "proc/swaps"), "Filename\tType\tSize\tUsed\tPriority\n/swapfile\tfile\t1048572\t0\t-2\n")
	write(t, filepath.Join(root, "proc/modules"), "")
	write(t, filepath.Join(root, "proc/sys/kernel/osrelease"), "6.1.0-test\n")
	write(t, filepath.Join(root, "sys/module/overlay/refcnt"), "0\n")
	write(t, filepath.Join(root, "proc/sys/net/ipv4/ip_forward"), "0\n")
	write(t, filepath.Join(root, "etc/fstab"), fstab)
	write(t, filepath.Join(root, "etc/containerd/config.toml"), debianContainerd)
	return root
}

// modprobe returns a runner whose modprobe "loads" br_netfilter into the
// fake root (and its sysctls appear), and whose swapoff empties
// /proc/swaps.
func modprobe(t testing.TB, root string) *command.Recorder {
	return &command.Recorder{Fail: func(line string) error {
		switch line {
		case "modprobe br_netfilter":
			write(t, filepath.Join(root, "proc/modules"), "br_netfilter 32768 0 - Live 0x0\n")
			write(t, filepath.Join(root, "proc/sys/net/bridge/bridge-nf-call-iptables"), "0\n")
			write(t, filepath.Join(root, "proc/sys/net/bridge/bridge-nf-call-ip6tables"), "0\n")
		case "swapoff -a":
			write(t, filepath.Join(root, "proc/swaps"), "Filename\tType\tSize\tUsed\tPriority\n")
		default:
			return fmt.Errorf("unexpected command %q", line)
		}
		return nil
	}}
}

// fakeUnits stands in for systemd (which cannot run here) and can fail.
type fakeUnits struct {
	enabled   map[string]bool
	restarts  []string
	enableErr error
	closed    bool
}

func (f *fakeUnits) Enable(_ context.Context, unit string) (bool, error) {
	if f.enableErr != nil {
		return false, f.enableErr
	}
	if f.enabled[unit] {
		return false, nil
	}
	f.enabled[unit] = true
	return true, nil
}

func (f *fakeUnits) Restart(_ context.Context, unit string) error {
	f.restarts = append(f.restarts, unit)
	return nil
}

func (f *fakeUnits) Close() error { f.closed = true; return nil }

func TestPrepareWithSystemd(t *testing.T) {
	ctx := context.Background()
	root := fakeRoot(t)
	units := &fakeUnits{enabled: map[string]bool{}}
	p := New(root, modprobe(t, root), logger(t), WithUnits(func(context.Context, string) (Units, error) { return units, nil }))

	res, err := p.Prepare(ctx, &agentv1.PrepareRequest{CgroupDriver: "cgroupfs"}, nil)
	require.NoError(t, err)
	got := items(res)
	for _, want := range []string{
		"swap: on (/swapfile) -> off",
		"fstab swap entry: /swapfile none swap sw 0 0 -> #/swapfile none swap sw 0 0",
		"module br_netfilter: missing -> loaded",
		"file /etc/modules-load.d/kiln.conf: absent -> br_netfilter; overlay",
		"sysctl net.ipv4.ip_forward: 0 -> 1",
		"sysctl net.bridge.bridge-nf-call-iptables: 0 -> 1",
		"containerd SystemdCgroup: unset -> false",
		"unit containerd.service: disabled -> enabled",
		"unit kubelet.service: disabled -> enabled",
		"unit containerd.service: running with the old config -> restarted",
	} {
		if !slices.Contains(got, want) {
			t.Errorf("Prepare() changes = %q, want %q among them", got, want)
		}
	}
	require.Equal(t, []string{"containerd.service"}, units.restarts, "restarts after the config change")
	require.True(t, units.closed, "units connection closed")

	res, err = p.Prepare(ctx, &agentv1.PrepareRequest{CgroupDriver: "cgroupfs"}, nil)
	require.NoError(t, err)
	if res.Changed || len(res.Changes) != 0 {
		t.Errorf("second Prepare() = changed %v %q, want no change", res.Changed, items(res))
	}
	require.Equal(t, []string{"containerd.service"}, units.restarts, "no restart without a config change")

	// The kubelet's driver changes: containerd follows and restarts.
	res, err = p.Prepare(ctx, &agentv1.PrepareRequest{CgroupDriver: "systemd"}, nil)
	require.NoError(t, err)
	require.Equal(t, []string{"containerd SystemdCgroup: false -> true", "unit containerd.service: running with the old config -> restarted"}, items(res))
}

func TestPrepareFailures(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name    string
		req     *agentv1.PrepareRequest
		setup   func(t *testing.T, root string) (Runner, DialUnits)
		wantErr string
		class   func(error) bool
	}{
		{
			name:    "unknown cgroup driver",
			req:     &agentv1.PrepareRequest{CgroupDriver: "cgroupv3"},
			setup:   func(t *testing.T, root string) (Runner, DialUnits) { return modprobe(t, root), nil },
			wantErr: `cgroup driver "cgroupv3"`,
			class:   errdefs.IsInvalidArgument,
		},
		{
			name:    "containerd config outside the root",
			req:     &agentv1.PrepareRequest{ContainerdConfig: "../../etc/containerd/config.toml"},
			setup:   func(t *testing.T, root string) (Runner, DialUnits) { return modprobe(t, root), nil },
			wantErr: "outside the host's root",
			class:   errdefs.IsInvalidArgument,
		},
		{
			name: "module cannot be loaded",
			setup: func(t *testing.T, root string) (Runner, DialUnits) {
				return &command.Recorder{Fail: func(line string) error {
					if strings.HasPrefix(line, "modprobe") {
						return errors.New("modprobe: FATAL: Module br_netfilter not found")
					}
					return nil
				}}, nil
			},
			wantErr: "load module br_netfilter",
		},
		{
			name: "broken containerd config",
			setup: func(t *testing.T, root string) (Runner, DialUnits) {
				write(t, filepath.Join(root, "etc/containerd/config.toml"), "version = 2\n[plugins\n")
				return modprobe(t, root), nil
			},
			wantErr: "config.toml",
			class:   errdefs.IsInvalidArgument,
		},
		{
			name: "unit unknown to systemd",
			setup: func(t *testing.T, root string) (Runner, DialUnits) {
				u := &fakeUnits{enabled: map[string]bool{}, enableErr: errdefs.NotFound("unit kubelet.service not found")}
				return modprobe(t, root), func(context.Context, string) (Units, error) { return u, nil }
			},
			wantErr: "kubelet.service not found",
			class:   errdefs.IsNotFound,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := fakeRoot(t)
			run, dial := tt.setup(t, root)
			var opts []Option
			if dial != nil {
				opts = append(opts, WithUnits(dial))
			}
			req := tt.req
			if req == nil {
				req = &agentv1.PrepareRequest{}
			}
			_, err := New(root, run, logger(t), opts...).Prepare(ctx, req, nil)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Prepare() error = %v, want it to name %q", err, tt.wantErr)
			}
			if tt.class != nil && !tt.class(err) {
				t.Errorf("Prepare() error = %v, wrong class", err)
			}
		})
	}
}

// BenchmarkPrepareNoop measures a second Prepare on a prepared host: what
// every agent start and every controller re-run costs. As root it runs in
// a fresh network namespace against the real /proc/sys.
func BenchmarkPrepareNoop(b *testing.B) {
	ctx := context.Background()
	var root string
	var run Runner
	do := func(fn func()) { fn() }
	if os.Geteuid() == 0 {
		ns := netnstest.New(b)
		requireModules(b)
		root = liveRoot(b)
		run = &command.Recorder{}
		do = func(fn func()) { ns.Do(b, fn) }
	} else {
		root = fakeRoot(b)
		run = modprobe(b, root)
	}
	p := New(root, run, slog.New(slog.DiscardHandler))
	do(func() {
		_, err := p.Prepare(ctx, &agentv1.PrepareRequest{}, nil)
		require.NoError(b, err)
		b.ResetTimer()
		for b.Loop() {
			res, err := p.Prepare(ctx, &agentv1.PrepareRequest{}, nil)
			if err != nil || res.Changed {
				b.Fatalf("Prepare() = %v, %v, want no change", res, err)
			}
		}
	})
}

// labUnits restarts a real containerd the way systemd would, for hosts
// whose containerd the test runs; enabling units is recorded.
type labUnits struct {
	d        *containerdtest.Daemon
	restarts int
}

func (l *labUnits) Enable(context.Context, string) (bool, error) { return false, nil }
func (l *labUnits) Restart(_ context.Context, unit string) error {
	if unit != "containerd.service" {
		return fmt.Errorf("unexpected restart of %s", unit)
	}
	l.restarts++
	l.d.Restart()
	return nil
}
func (l *labUnits) Close() error { return nil }

// TestPrepareVerifiesRunningContainerd runs Debian's containerd on the
// cgroupfs driver and asks Prepare for systemd: Prepare edits the config,
// restarts containerd and reads the new driver back over CRI; the second
// run finds nothing to do. Without systemd, a containerd still running
// the old driver is reported, not hidden.
func TestPrepareVerifiesRunningContainerd(t *testing.T) {
	d := containerdtest.New(t)
	ns := netnstest.New(t)
	requireModules(t)
	ctx := context.Background()
	require.NoError(t, os.Symlink("/proc", filepath.Join(d.Root, "proc")))
	require.NoError(t, os.Symlink("/sys", filepath.Join(d.Root, "sys")))
	_, _, err := containerd.WriteSystemdCgroup(d.Config, false)
	require.NoError(t, err)
	d.Start()

	// No systemd: the file changes, the running daemon does not, and
	// Prepare says so.
	var progress []string
	ns.Do(t, func() {
		_, err = New(d.Root, &command.Recorder{}, logger(t)).Prepare(ctx, &agentv1.PrepareRequest{CgroupDriver: "systemd"}, func(s string) { progress = append(progress, s) })
	})
	require.NoError(t, err)
	want := "containerd: runs with the cgroupfs cgroup driver, its config says systemd: restart containerd to apply"
	if !slices.ContainsFunc(progress, func(s string) bool { return strings.HasPrefix(s, want) }) {
		t.Errorf("Prepare() without systemd progress = %q, want %q", progress, want)
	}

	// With a service manager: the stale daemon is restarted and verified.
	units := &labUnits{d: d}
	p := New(d.Root, &command.Recorder{}, logger(t), WithUnits(func(context.Context, string) (Units, error) { return units, nil }))
	var first, second *agentv1.PrepareResult
	var err2 error
	ns.Do(t, func() {
		first, err = p.Prepare(ctx, &agentv1.PrepareRequest{CgroupDriver: "systemd"}, nil)
		second, err2 = p.Prepare(ctx, &agentv1.PrepareRequest{CgroupDriver: "systemd"}, nil)
	})
	require.NoError(t, err)
	require.NoError(t, err2)
	require.Equal(t, []string{"unit containerd.service: running with the cgroupfs cgroup driver -> restarted"}, items(first))
	if second.Changed || units.restarts != 1 {
		t.Errorf("second Prepare() = changed %v %q after %d restarts, want no change and 1 restart", second.Changed, items(second), units.restarts)
	}
	r, err := containerd.Query(ctx, d.Socket)
	require.NoError(t, err)
	if r.Driver() != containerd.DriverSystemd {
		t.Errorf("running containerd after Prepare = %s, want systemd", r.Driver())
	}

	// The kubelet moves to cgroupfs: config and daemon follow in one run.
	ns.Do(t, func() {
		first, err = p.Prepare(ctx, &agentv1.PrepareRequest{CgroupDriver: "cgroupfs"}, nil)
	})
	require.NoError(t, err)
	require.Equal(t, []string{"containerd SystemdCgroup: true -> false", "unit containerd.service: running with the old config -> restarted"}, items(first))
	r, err = containerd.Query(ctx, d.Socket)
	require.NoError(t, err)
	if r.Driver() != containerd.DriverCgroupfs {
		t.Errorf("running containerd after Prepare(cgroupfs) = %s, want cgroupfs", r.Driver())
	}
}

// BenchmarkPrepareNoopWithContainerd is BenchmarkPrepareNoop on a host
// whose containerd runs (Debian's, under a temporary root): each run also
// asks containerd for its effective cgroup driver over CRI.
func BenchmarkPrepareNoopWithContainerd(b *testing.B) {
	d := containerdtest.New(b)
	ns := netnstest.New(b)
	requireModules(b)
	ctx := context.Background()
	require.NoError(b, os.Symlink("/proc", filepath.Join(d.Root, "proc")))
	require.NoError(b, os.Symlink("/sys", filepath.Join(d.Root, "sys")))
	d.Start()
	p := New(d.Root, &command.Recorder{}, slog.New(slog.DiscardHandler), WithUnits(func(context.Context, string) (Units, error) { return &labUnits{d: d}, nil }))
	ns.Do(b, func() {
		_, err := p.Prepare(ctx, &agentv1.PrepareRequest{}, nil)
		require.NoError(b, err)
		b.ResetTimer()
		for b.Loop() {
			res, err := p.Prepare(ctx, &agentv1.PrepareRequest{}, nil)
			if err != nil || res.Changed {
				b.Fatalf("Prepare() = %v, %v, want no change", res, err)
			}
		}
	})
}
