package nspawn

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root for cgroups and systemd-nspawn")
	}
}

func needNspawn(t *testing.T) {
	t.Helper()
	needRoot(t)
	for tool, pkg := range map[string]string{"systemd-nspawn": "systemd-container", "nsenter": "util-linux", "ip": "iproute2"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (Debian package %s)", tool, pkg)
		}
	}
}

// debianRoot is the lab's cached Debian root (the one e2e/lab/netns and
// host/systemd/systemdtest boot), built on first use.
func debianRoot(t *testing.T) string {
	t.Helper()
	spec := rootfs.Spec{Packages: []string{"procps"}}
	if _, err := os.Stat(spec.Dir()); err != nil {
		if testing.Short() {
			t.Skip("-short: no cached Debian root and building one takes minutes")
		}
		if _, err := exec.LookPath("debootstrap"); err != nil {
			testenv.Skipf(t, "no cached Debian root (%s) and no debootstrap to build one", spec.Dir())
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	dir, err := rootfs.Build(ctx, spec, io.Discard)
	require.NoError(t, err)
	return dir
}

func testName(what string) string { return fmt.Sprintf("kiln-nt-%s-%d", what, os.Getpid()%100000) }

func nsInode(t *testing.T, path string) uint64 {
	t.Helper()
	var st syscall.Stat_t
	require.NoError(t, syscall.Stat(path, &st), "stat %s", path)
	return st.Ino
}

func gone(pid int) bool { return syscall.Kill(pid, 0) == syscall.ESRCH }

// requireNothingLeft checks what a user would look for after Stop.
func requireNothingLeft(t *testing.T, c *Container, pids ...int) {
	t.Helper()
	for _, d := range c.Cgroups().Dirs {
		if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("cgroup %s after Stop: %v, want gone", d, err)
		}
	}
	if _, err := os.Stat(PropagateDir(c.Name())); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("propagation dir %s after Stop: %v, want gone", PropagateDir(c.Name()), err)
	}
	for _, pid := range pids {
		if !gone(pid) {
			t.Errorf("process %d still runs after Stop", pid)
		}
	}
}

func TestCgroups(t *testing.T) {
	needRoot(t)
	name := testName("cg")
	cg := NewCgroups(name)
	require.NotEmpty(t, cg.Dirs, "no cgroup hierarchy under /sys/fs/cgroup")
	t.Cleanup(func() { cg.Kill(); _ = cg.Remove() })
	procs, err := cg.Create()
	require.NoError(t, err)
	require.Len(t, procs, len(cg.Dirs))
	for _, d := range cg.Dirs {
		if strings.Contains(filepath.Base(filepath.Dir(d)), "cpuset") {
			b, _ := os.ReadFile(filepath.Join(d, "cpuset.cpus"))
			if strings.TrimSpace(string(b)) == "" {
				t.Errorf("%s/cpuset.cpus is empty after Create, want the parent's", d)
			}
		}
	}
	// A nested cgroup, as kubelet and nspawn make below the node's.
	nested := filepath.Join(cg.Dirs[0], "payload", "inner")
	require.NoError(t, os.MkdirAll(nested, 0o755))

	cmd := exec.Command("sh", "-c", JoinScript(procs)+"; exec sleep 600")
	require.NoError(t, cmd.Start())
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }()
	require.Eventually(t, func() bool {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", cmd.Process.Pid))
		return strings.TrimSpace(string(b)) == "sleep"
	}, 10*time.Second, 20*time.Millisecond)
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", cmd.Process.Pid))
	require.NoError(t, err)
	if n := strings.Count(string(b), "/"+name+"\n"); n != len(cg.Dirs) {
		t.Errorf("the process is in %d of the %d cgroups called %s:\n%s", n, len(cg.Dirs), name, b)
	}
	cg.Kill()
	<-waited
	require.NoError(t, cg.Remove())
	for _, d := range cg.Dirs {
		if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("cgroup %s after Remove: %v, want gone", d, err)
		}
	}
	require.NoError(t, cg.Remove(), "Remove() of removed cgroups")
}

func TestStartValidates(t *testing.T) {
	for _, o := range []Options{{Dir: "/r"}, {Name: "x"}} {
		if _, err := Start(o); !errdefs.IsInvalidArgument(err) {
			t.Errorf("Start(%+v) error = %v, want InvalidArgument", o, err)
		}
	}
}

// TestContainer boots the cached Debian root in a network namespace of
// the test's own, checks what the lab relies on (its init, the network
// namespace, a writable /proc/sys/net of its own, Exec), and that Stop
// leaves no process, cgroup or propagation directory behind.
func TestContainer(t *testing.T) {
	needNspawn(t)
	root := debianRoot(t)
	ns := testName("ns")
	out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput()
	require.NoError(t, err, "%s", out)
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "netns", "del", ns).CombinedOutput(); err != nil {
			t.Errorf("ip netns del %s: %v: %s", ns, err, out)
		}
	})
	hostForward, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward")
	require.NoError(t, err)

	name := testName("c")
	c, err := Start(Options{Name: name, Dir: root, NetNS: "/run/netns/" + ns,
		Console: filepath.Join(t.TempDir(), "console.log"), Extra: []string{"--volatile=overlay"}})
	require.NoError(t, err)
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = c.Stop(context.Background())
		}
		if t.Failed() {
			t.Logf("console:\n%s", c.ConsoleTail(40))
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	require.NoError(t, c.WaitRunning(ctx))

	leader := c.Leader()
	require.NotZero(t, leader)
	if b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", leader)); strings.TrimSpace(string(b)) != "systemd" {
		t.Errorf("Leader() = %d running %q, want systemd", leader, b)
	}
	if got, want := nsInode(t, fmt.Sprintf("/proc/%d/ns/net", leader)), nsInode(t, "/run/netns/"+ns); got != want {
		t.Errorf("container's network namespace inode = %d, want %s's %d", got, ns, want)
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", leader))
	require.NoError(t, err)
	if !strings.Contains(string(b), "/"+name+"/") {
		t.Errorf("container's init is not below its cgroups %s:\n%s", name, b)
	}

	got, err := c.Exec(ctx, "cat", "/proc/1/comm", "/proc/sys/kernel/hostname")
	require.NoError(t, err)
	if f := strings.Fields(got); len(f) != 2 || f[0] != "systemd" || f[1] != name {
		t.Errorf("Exec(cat /proc/1/comm /proc/sys/kernel/hostname) = %q, want systemd and %s", got, name)
	}
	_, err = c.Exec(ctx, "sysctl", "-w", "net.ipv4.ip_forward=1")
	require.NoError(t, err, "/proc/sys/net must be writable inside")
	if got, _ := c.Exec(ctx, "cat", "/proc/sys/net/ipv4/ip_forward"); strings.TrimSpace(got) != "1" {
		t.Errorf("ip_forward inside = %q after sysctl -w, want 1", got)
	}
	if now, _ := os.ReadFile("/proc/sys/net/ipv4/ip_forward"); string(now) != string(hostForward) {
		t.Errorf("host ip_forward = %q after the container set its own, want unchanged %q", now, hostForward)
	}
	if _, err := c.Exec(ctx, "sh", "-c", "echo oops; exit 3"); err == nil || !strings.Contains(err.Error(), "oops") {
		t.Errorf("Exec(a failing command) error = %v, want one with its output", err)
	}

	nspawnPID := c.PID()
	// A process started inside, outside of systemd's units, goes too.
	_, err = c.Exec(ctx, "sh", "-c", "setsid sleep 600 >/dev/null 2>&1 < /dev/null &")
	require.NoError(t, err)
	require.NoError(t, c.Stop(ctx))
	stopped = true
	requireNothingLeft(t, c, nspawnPID, leader)
	if c.Leader() != 0 {
		t.Errorf("Leader() after Stop = %d, want 0", c.Leader())
	}
	if tail := c.ConsoleTail(40); !strings.Contains(tail, "Powering off.") {
		t.Errorf("console after Stop:\n%s\nwant a graceful power-off (\"Powering off.\")", tail)
	}
	require.NoError(t, c.Stop(ctx), "Stop() again")
	if _, err := c.Exec(ctx, "true"); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("Exec() after Stop error = %v, want FailedPrecondition", err)
	}
}

// TestContainerHostNetwork boots with the caller's network namespace, as
// the golden image's boot test does to reach a controller on loopback:
// the container shares it and cannot change its sysctls.
func TestContainerHostNetwork(t *testing.T) {
	needNspawn(t)
	root := debianRoot(t)
	c, err := Start(Options{Name: testName("h"), Dir: root, HostNetwork: true, Extra: []string{"--volatile=overlay"}})
	require.NoError(t, err)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("console:\n%s", c.ConsoleTail(40))
		}
		require.NoError(t, c.Stop(context.Background()))
		requireNothingLeft(t, c)
		if _, err := os.Stat(c.ConsoleLog()); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("temporary console log %s after Stop: %v, want removed", c.ConsoleLog(), err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	require.NoError(t, c.WaitRunning(ctx))
	if got, want := nsInode(t, fmt.Sprintf("/proc/%d/ns/net", c.Leader())), nsInode(t, "/proc/self/ns/net"); got != want {
		t.Errorf("container's network namespace inode = %d, want the host's %d", got, want)
	}
	if _, err := c.Exec(ctx, "sh", "-c", "cat /proc/sys/net/ipv4/ip_forward > /proc/sys/net/ipv4/ip_forward"); err == nil {
		t.Errorf("writing the host's ip_forward from the container succeeded, want it refused")
	}
}

// TestWaitRunningReportsExit: a root that is no OS makes nspawn exit at
// once; WaitRunning says so with the console's words instead of waiting
// out its context, and Stop still cleans up.
func TestWaitRunningReportsExit(t *testing.T) {
	needNspawn(t)
	c, err := Start(Options{Name: testName("e"), Dir: t.TempDir()})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	err = c.WaitRunning(ctx)
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "exited") {
		t.Errorf("WaitRunning() on a root without an OS = %v, want FailedPrecondition saying nspawn exited", err)
	}
	if ctx.Err() != nil {
		t.Errorf("WaitRunning() waited out its context")
	}
	t.Logf("error: %v", err)
	require.NoError(t, c.Stop(context.Background()))
	requireNothingLeft(t, c, c.PID())
}
