package netns

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/e2e/lab/nspawn"
	"github.com/kilnhq/kiln/imagebuilder/disk"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/internal/testenv"
)

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root for network namespaces")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		testenv.Skip(t, "ip not installed (Debian package iproute2)")
	}
}

// testLab is a lab name unique to this test process.
func testLab() string { return fmt.Sprintf("t%d", os.Getpid()%100000) }

// hostState is what a user would look at to see that nothing is left.
type hostState struct {
	netns, links, mounts, cgroups []string
}

func snapshot(t *testing.T) hostState {
	t.Helper()
	var s hostState
	out, err := exec.Command("ip", "netns", "list").Output()
	require.NoError(t, err)
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if f := strings.Fields(l); len(f) > 0 {
			s.netns = append(s.netns, f[0])
		}
	}
	ents, _ := os.ReadDir("/sys/class/net")
	for _, e := range ents {
		s.links = append(s.links, e.Name())
	}
	b, _ := os.ReadFile("/proc/self/mounts")
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 1 {
			s.mounts = append(s.mounts, f[1])
		}
	}
	for _, h := range nspawn.Hierarchies() {
		ents, _ := os.ReadDir(h)
		for _, e := range ents {
			if e.IsDir() && strings.HasPrefix(e.Name(), "kiln-") {
				s.cgroups = append(s.cgroups, filepath.Join(h, e.Name()))
			}
		}
	}
	return s
}

// requireClean fails when anything in after is not in before, or
// anything of this test's lab remains.
func requireClean(t *testing.T, before, after hostState, dir string, hosts ...string) {
	t.Helper()
	for _, c := range []struct {
		what          string
		before, after []string
	}{{"network namespace", before.netns, after.netns}, {"link", before.links, after.links}, {"mount", before.mounts, after.mounts}, {"cgroup", before.cgroups, after.cgroups}} {
		for _, x := range c.after {
			// Other tests may come and go on a shared machine: look at ours.
			ours := strings.Contains(x, testLab()) || strings.HasPrefix(x, dir)
			for _, h := range hosts {
				ours = ours || x == VethName(testLab(), h)
			}
			if !slices.Contains(c.before, x) && ours {
				t.Errorf("%s %s left behind", c.what, x)
			}
		}
	}
}

func nsInode(t *testing.T, path string) uint64 {
	t.Helper()
	var st syscall.Stat_t
	require.NoError(t, syscall.Stat(path, &st), "stat %s", path)
	return st.Ino
}

func waitFor(t *testing.T, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not after %s", what, timeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestBootAgentInHostNamespace powers a host on from virtual media and
// from PXE: the boot agent runs in the host's network namespace (not the
// test's) and sees the boot media's kernel command line; power off stops
// it and closing the host leaves nothing behind.
func TestBootAgentInHostNamespace(t *testing.T) {
	needRoot(t)
	before := snapshot(t)
	ctx := context.Background()
	dir := t.TempDir()
	out := filepath.Join(dir, "agent.out")
	m, err := New(ctx, Options{
		Name: "boot1", Lab: testLab(), StateDir: filepath.Join(dir, "boot1"),
		Address: "10.252.7.2/24",
		Agent: Agent{
			Command: []string{"sh", "-c", `{ cat /proc/cmdline; readlink /proc/self/ns/net; } > "$0.tmp" && mv "$0.tmp" "$0"; exec sleep infinity`, out},
			Cmdline: "kiln.controller=10.252.7.1:7443 kiln.ca_hash=sha256:00",
			Scratch: filepath.Join(dir, "scratch"),
		},
		GracePeriod: 10 * time.Second,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close(context.Background()) })
	hostNS := nsInode(t, m.NetnsPath())

	tests := []struct {
		dev, media string
		want       []string
	}{
		{machine.BootCD, "http://10.252.7.1/agent.iso", []string{"kiln.boot=virtualmedia", "kiln.media=http://10.252.7.1/agent.iso", "kiln.controller=10.252.7.1:7443"}},
		{machine.BootPXE, "", []string{"kiln.boot=pxe", "kiln.controller=10.252.7.1:7443", "kiln.lab_disk=" + m.DiskPath()}},
	}
	for _, tt := range tests {
		t.Run(tt.dev, func(t *testing.T) {
			_ = os.Remove(out)
			leftover := filepath.Join(dir, "scratch", "identity")
			require.NoError(t, os.MkdirAll(filepath.Dir(leftover), 0o700))
			require.NoError(t, os.WriteFile(leftover, []byte("from the last boot"), 0o600))
			require.NoError(t, m.InsertMedia(tt.media))
			require.NoError(t, m.PowerOn(ctx, tt.dev))
			if !m.State() || m.BootSource() != tt.dev {
				t.Errorf("after PowerOn(%q): State() = %v, BootSource() = %q", tt.dev, m.State(), m.BootSource())
			}
			pid := m.PID()
			require.NotZero(t, pid, "no boot agent running: %s", m.LastBootError())
			// The output proves the agent has entered the namespaces.
			waitFor(t, "boot agent output", 30*time.Second, func() bool { _, err := os.Stat(out); return err == nil })
			b, err := os.ReadFile(out)
			require.NoError(t, err)
			if want := fmt.Sprintf("net:[%d]", hostNS); !strings.Contains(string(b), want) {
				t.Errorf("boot agent's own netns = %q, want %s", b, want)
			}
			if got := nsInode(t, fmt.Sprintf("/proc/%d/ns/net", pid)); got != hostNS {
				t.Errorf("boot agent netns inode = %d, want the host's %d", got, hostNS)
			}
			if got, self := nsInode(t, fmt.Sprintf("/proc/%d/ns/net", pid)), nsInode(t, "/proc/self/ns/net"); got == self {
				t.Errorf("boot agent runs in the test's network namespace (%d)", self)
			}
			for _, w := range tt.want {
				if !strings.Contains(string(b), w+" ") && !strings.Contains(string(b), w+"\n") {
					t.Errorf("PowerOn(%q): agent's /proc/cmdline = %q, want %q in it", tt.dev, b, w)
				}
			}
			if _, err := os.Stat(leftover); err == nil {
				t.Errorf("PowerOn(%q): the agent's scratch dir kept %s from the last boot", tt.dev, leftover)
			}
			if own, _ := os.ReadFile("/proc/cmdline"); bytes.Contains(own, []byte("kiln.boot=")) {
				t.Errorf("the test's own /proc/cmdline changed: %q", own)
			}
			id := ProcessID(pid)
			require.NoError(t, m.PowerOff(ctx, true))
			if m.State() || ProcessAlive(id) {
				t.Errorf("after PowerOff: State() = %v, agent alive = %v", m.State(), ProcessAlive(id))
			}
		})
	}

	t.Run("reset", func(t *testing.T) {
		require.NoError(t, m.PowerOn(ctx, machine.BootPXE))
		pid := ProcessID(m.PID())
		require.NoError(t, m.Reset(ctx))
		if ProcessAlive(pid) || m.PID() == 0 || !m.State() || m.BootSource() != machine.BootPXE {
			t.Errorf("after Reset: old agent alive = %v, PID() = %d, State() = %v, BootSource() = %q; want a new agent from pxe",
				ProcessAlive(pid), m.PID(), m.State(), m.BootSource())
		}
		require.NoError(t, m.PowerOff(ctx, false))
		if err := m.Reset(ctx); err == nil {
			t.Errorf("Reset of a powered-off machine = nil, want FailedPrecondition")
		}
	})

	t.Run("cd without media", func(t *testing.T) {
		require.NoError(t, m.InsertMedia(""))
		require.NoError(t, m.PowerOn(ctx, machine.BootCD))
		if !m.State() || m.PID() != 0 || m.LastBootError() == "" {
			t.Errorf("PowerOn(cd) with no media: State() = %v, PID() = %d, LastBootError() = %q; want on, nothing running, a reason", m.State(), m.PID(), m.LastBootError())
		}
		require.NoError(t, m.PowerOff(ctx, false))
	})

	t.Run("agent exits", func(t *testing.T) {
		m2, err := New(ctx, Options{Name: "boot2", Lab: testLab(), StateDir: filepath.Join(dir, "boot2"), Agent: Agent{Command: []string{"true"}}})
		require.NoError(t, err)
		defer m2.Close(ctx)
		require.NoError(t, m2.PowerOn(ctx, machine.BootPXE))
		waitFor(t, "machine off after its agent exited", 30*time.Second, func() bool { return !m2.State() })
	})

	t.Run("OS reboot and power off", func(t *testing.T) {
		// The agent gets --reboot-command and --poweroff-command; this
		// one counts its boots in a file, reboots on the first and powers
		// off on the second. The reboot boots what the BMC picks.
		boots := filepath.Join(dir, "boots")
		script := `n=$(cat "$0" 2>/dev/null || echo 0); n=$((n+1)); echo $n > "$0"
while [ $# -gt 0 ]; do case "$1" in --reboot-command) r=$2; shift;; --poweroff-command) p=$2; shift;; esac; shift; done
if [ $n = 1 ]; then $r; else $p; fi; exec sleep infinity`
		m3, err := New(ctx, Options{Name: "boot3", Lab: testLab(), StateDir: filepath.Join(dir, "boot3"),
			Agent: Agent{Command: []string{"sh", "-c", script, boots}, OSPower: true}})
		require.NoError(t, err)
		defer m3.Close(ctx)
		var asked []string
		var mu sync.Mutex
		m3.SetNextBoot(func() string { mu.Lock(); defer mu.Unlock(); asked = append(asked, "pxe"); return machine.BootPXE })
		require.NoError(t, m3.InsertMedia("http://10.252.7.1/agent.iso"))
		require.NoError(t, m3.PowerOn(ctx, machine.BootCD))
		waitFor(t, "machine off after its second boot powered it off", 30*time.Second, func() bool { return !m3.State() })
		b, _ := os.ReadFile(boots)
		mu.Lock()
		defer mu.Unlock()
		if strings.TrimSpace(string(b)) != "2" || len(asked) != 1 || m3.BootSource() != machine.BootPXE || m3.Launches() != 2 {
			t.Errorf("after an OS reboot then power off: boots = %q, BMC asked %d times, BootSource() = %q, Launches() = %d; want 2 boots, 1 ask, pxe, 2 launches",
				b, len(asked), m3.BootSource(), m3.Launches())
		}
	})

	require.NoError(t, m.Close(ctx))
	requireClean(t, before, snapshot(t), dir, "boot1", "boot2", "boot3")
}

// syncBuffer is a log sink for a test's slog handler.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// TestDiskBoot builds a small Debian root (cached) and a GPT disk from
// it, boots the disk under systemd-nspawn to a running systemd, reboots
// it from inside (the backend boots it again), powers it off gracefully,
// and checks that a blank disk boots nothing.
func TestDiskBoot(t *testing.T) {
	needRoot(t)
	if testing.Short() {
		t.Skip("-short: builds a Debian root (minutes the first time)")
	}
	for tool, pkg := range map[string]string{"systemd-nspawn": "systemd-container", "systemd-dissect": "systemd-container", "busctl": "systemd", "debootstrap": "debootstrap", "mkfs.ext4": "e2fsprogs", "sfdisk": "fdisk", "mkfs.fat": "dosfstools", "mcopy": "mtools"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (Debian package %s)", tool, pkg)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	root, err := rootfs.Build(ctx, rootfs.Spec{Packages: []string{"procps"}}, testWriter{t})
	require.NoError(t, err)

	before := snapshot(t)
	dir := t.TempDir()
	state := filepath.Join(dir, "disk1")
	require.NoError(t, os.MkdirAll(state, 0o700))
	_, err = disk.Build(ctx, disk.Spec{RootDir: root, Output: filepath.Join(state, "disk.raw"), Seed: "netns-test"}, nil)
	require.NoError(t, err)

	logs := &syncBuffer{}
	var tracked []Resource
	var trackMu sync.Mutex
	m, err := New(ctx, Options{
		Name: "disk1", Lab: testLab(), StateDir: state, GracePeriod: 60 * time.Second,
		Logger: slog.New(slog.NewTextHandler(logs, nil)),
		Track: func(r Resource) {
			trackMu.Lock()
			defer trackMu.Unlock()
			tracked = append(tracked, r)
		},
	})
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = m.Close(context.Background())
		t.Logf("backend log:\n%s", logs.String())
		if t.Failed() {
			b, _ := os.ReadFile(m.ConsoleLog())
			t.Logf("console:\n%s", b)
		}
	})

	running := func() bool {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		s, err := m.SystemState(cctx)
		return err == nil && (s == "running" || s == "degraded")
	}

	require.NoError(t, m.PowerOn(ctx, machine.BootDisk))
	require.True(t, m.State())
	require.Empty(t, m.LastBootError())
	waitFor(t, "systemd running in the disk's system", 120*time.Second, running)
	leader := m.Leader()
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/root/etc/os-release", leader)); err != nil || !strings.Contains(string(b), "bookworm") {
		t.Errorf("booted system's /etc/os-release = %q, %v: want the disk's Debian", b, err)
	}
	if Mounted(m.RootDir()) {
		t.Errorf("disk root %s is mounted in the host's mount table: other namespaces would copy it", m.RootDir())
	}
	if got, want := nsInode(t, fmt.Sprintf("/proc/%d/ns/net", leader)), nsInode(t, m.NetnsPath()); got != want {
		t.Errorf("booted system's netns inode = %d, want the host's %d", got, want)
	}

	// A reboot inside ends nspawn; the backend boots the disk again.
	out, err := exec.Command("busctl", "--address="+m.BusAddress(), "call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
		"org.freedesktop.systemd1.Manager", "StartUnit", "ss", "reboot.target", "replace-irreversibly").CombinedOutput()
	require.NoError(t, err, "systemctl reboot over D-Bus: %s", out)
	waitFor(t, "a second launch after the reboot", 120*time.Second, func() bool { return m.Launches() >= 2 })
	waitFor(t, "systemd running after the reboot", 120*time.Second, running)
	if !m.State() || m.Leader() == leader {
		t.Errorf("after reboot: State() = %v, leader %d (was %d): want on with a new init", m.State(), m.Leader(), leader)
	}

	// Graceful power off: the system shuts itself down.
	nspawnPID := ProcessID(m.PID())
	require.NoError(t, m.PowerOff(ctx, true))
	if m.State() || ProcessAlive(nspawnPID) {
		t.Errorf("after PowerOff(graceful): State() = %v, nspawn alive = %v", m.State(), ProcessAlive(nspawnPID))
	}
	if strings.Contains(logs.String(), "graceful power off timed out") {
		t.Errorf("PowerOff(graceful) had to force: the system did not power off over D-Bus")
	}
	if Mounted(m.RootDir()) {
		t.Errorf("disk root still mounted after power off")
	}
	if _, err := os.Stat("/run/systemd/nspawn/propagate/" + m.MachineName()); err == nil {
		t.Errorf("nspawn propagation dir left behind")
	}
	if loops := loopsOf(m.DiskPath()); len(loops) > 0 {
		t.Errorf("loop devices %v still attached to the disk after power off", loops)
	}
	trackMu.Lock()
	for _, r := range tracked {
		if r.Kind == KindPID && ProcessAlive(r.Value) {
			t.Errorf("process %s still running after power off", r.Value)
		}
	}
	trackMu.Unlock()

	// Hard power off of a booted system.
	require.NoError(t, m.PowerOn(ctx, machine.BootDisk))
	waitFor(t, "systemd running", 120*time.Second, running)
	require.NoError(t, m.PowerOff(ctx, false))
	if m.State() || Mounted(m.RootDir()) {
		t.Errorf("after PowerOff(hard): State() = %v, mounted = %v", m.State(), Mounted(m.RootDir()))
	}

	// A blank disk boots nothing, and the machine still reports on.
	blank, err := New(ctx, Options{Name: "blank1", Lab: testLab(), StateDir: filepath.Join(dir, "blank1"), DiskSize: 64 << 20})
	require.NoError(t, err)
	require.NoError(t, blank.PowerOn(ctx, machine.BootDisk))
	if !blank.State() || blank.PID() != 0 || !strings.Contains(blank.LastBootError(), "not bootable") || Mounted(blank.RootDir()) {
		t.Errorf("blank disk PowerOn: State() = %v, PID() = %d, LastBootError() = %q, mounted = %v; want on, nothing running, not bootable",
			blank.State(), blank.PID(), blank.LastBootError(), Mounted(blank.RootDir()))
	}
	require.NoError(t, blank.PowerOff(ctx, true))
	require.NoError(t, blank.Close(ctx))

	// A disk with a partition table but a corrupt root file system boots
	// nothing either (found once the mount fails, after PowerOn returned).
	cstate := filepath.Join(dir, "corrupt1")
	require.NoError(t, os.MkdirAll(filepath.Join(cstate, "tree/etc"), 0o755))
	l, err := disk.Build(ctx, disk.Spec{RootDir: filepath.Join(cstate, "tree"), Output: filepath.Join(cstate, "disk.raw")}, nil)
	require.NoError(t, err)
	f, err := os.OpenFile(l.Path, os.O_WRONLY, 0)
	require.NoError(t, err)
	_, err = f.WriteAt(make([]byte, 1<<20), l.Partitions[1].Offset) // the ext4 superblock
	require.NoError(t, err)
	require.NoError(t, f.Close())
	corrupt, err := New(ctx, Options{Name: "corrupt1", Lab: testLab(), StateDir: cstate})
	require.NoError(t, err)
	require.NoError(t, corrupt.PowerOn(ctx, machine.BootDisk))
	waitFor(t, "corrupt disk found not bootable", 60*time.Second, func() bool { return corrupt.LastBootError() != "" })
	if !corrupt.State() || corrupt.PID() != 0 || !strings.Contains(corrupt.LastBootError(), "not bootable") {
		t.Errorf("corrupt disk PowerOn: State() = %v, PID() = %d, LastBootError() = %q; want on, nothing running, not bootable",
			corrupt.State(), corrupt.PID(), corrupt.LastBootError())
	}
	require.NoError(t, corrupt.PowerOff(ctx, false))
	require.NoError(t, corrupt.Close(ctx))

	require.NoError(t, m.Close(ctx))
	requireClean(t, before, snapshot(t), dir, "disk1", "blank1", "corrupt1")
}

// TestRealAgentSeesBootMedia boots the real kiln-agent from PXE: its facts
// say it runs from boot media (pxe, mode boot) and list the host's eth0
// with the host's MAC, not the test machine's NICs.
func TestRealAgentSeesBootMedia(t *testing.T) {
	needRoot(t)
	gobin, err := exec.LookPath("go")
	if err != nil {
		testenv.Skip(t, "go toolchain not found: cannot build kiln-agent")
	}
	dir := t.TempDir()
	agent := filepath.Join(dir, "kiln-agent")
	out, err := exec.Command(gobin, "build", "-o", agent, "github.com/kilnhq/kiln/cmd/kiln-agent").CombinedOutput()
	require.NoError(t, err, "go build kiln-agent: %s", out)

	ctx := context.Background()
	m, err := New(ctx, Options{Name: "agent1", Lab: testLab(), StateDir: filepath.Join(dir, "agent1"),
		Address: "10.252.8.2/24", Agent: Agent{Command: []string{agent, "facts"}}})
	require.NoError(t, err)
	defer m.Close(ctx)
	require.NoError(t, m.PowerOn(ctx, machine.BootPXE))
	waitFor(t, "kiln-agent facts to finish (machine off)", 60*time.Second, func() bool { return !m.State() })
	b, err := os.ReadFile(m.ConsoleLog())
	require.NoError(t, err)
	facts := strings.Join(strings.Fields(string(b)), "") // protojson varies its spacing
	for _, want := range []string{`"bootSource":"pxe"`, `"agentMode":"boot"`, `"mac":"` + m.MAC() + `"`, `"10.252.8.2/24"`} {
		if !strings.Contains(facts, want) {
			t.Errorf("kiln-agent facts from PXE: %q missing in:\n%s", want, facts)
		}
	}
}
