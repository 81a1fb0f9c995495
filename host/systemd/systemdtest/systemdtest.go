//go:build linux

// Package systemdtest boots a real systemd for a test: a Debian root
// ($KILN_SYSTEMD_ROOT, else the lab's cached Debian root from
// imagebuilder/rootfs, built on first use) under systemd-nspawn, read-only with a
// volatile overlay, in its own network namespace and cgroups, with test
// units bound in. Tests skip when the root, systemd-nspawn or root
// privileges are missing. The machine is powered off, and its cgroups and
// nspawn's leftovers removed, when the test ends.
package systemdtest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/host/systemd"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
)

// RootEnv names a Debian root with systemd and dbus to use instead of the
// cached lab root, e.g. one made with:
//
//	debootstrap --variant=minbase --include=systemd,systemd-sysv,dbus bookworm DIR http://deb.debian.org/debian
const RootEnv = "KILN_SYSTEMD_ROOT"

// Machine is a booted systemd.
type Machine struct {
	// Root is the machine's root as seen from outside (/proc/LEADER/root):
	// its system bus is Root/run/dbus/system_bus_socket.
	Root string
	// Leader is the PID of the machine's init; its network namespace is
	// /proc/LEADER/ns/net.
	Leader int
}

// Boot boots a machine with units (file name → content) placed in
// /etc/systemd/system, and waits until multi-user.target is active.
// /proc/sys/net is writable inside, as on a lab node.
func Boot(t testing.TB, units map[string]string) *Machine {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to run systemd-nspawn")
	}
	nspawn, err := exec.LookPath("systemd-nspawn")
	if err != nil {
		t.Skip("systemd-nspawn not installed (Debian package systemd-container)")
	}
	image := os.Getenv(RootEnv)
	if image == "" {
		if _, err := exec.LookPath("debootstrap"); err != nil {
			t.Skipf("no Debian root: set %s, or install debootstrap to build the lab's cached root", RootEnv)
		}
		// The same spec as the lab's netns hosts, so one cached root serves both.
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
		defer cancel()
		image, err = rootfs.Build(ctx, rootfs.Spec{Packages: []string{"procps"}}, nil)
		require.NoError(t, err, "building the cached Debian root for a real systemd")
	}
	name := fmt.Sprintf("kiln-sd-%d-%d", os.Getpid(), time.Now().UnixNano()%100000)
	args := []string{"-D", image, "-M", name, "-b", "--register=no", "--keep-unit", "--private-network",
		"--volatile=overlay", "--resolv-conf=off", "--timezone=off", "--link-journal=no", "--console=read-only"}
	dir := t.TempDir()
	for unit, content := range units {
		p := filepath.Join(dir, unit)
		require.NoError(t, os.WriteFile(p, []byte(content), 0o644))
		args = append(args, "--bind-ro="+p+":/etc/systemd/system/"+unit)
	}

	// nspawn makes payload/supervisor cgroups under its own: give it one
	// of ours in every hierarchy, so that they go away with it.
	procs := cgroupsFor(t, name)
	script := `for p in ` + strings.Join(procs, " ") + `; do echo $$ > "$p"; done; exec "$0" "$@"`
	cmd := exec.Command("sh", append([]string{"-c", script, nspawn}, args...)...)
	cmd.Env = append(os.Environ(), "SYSTEMD_NSPAWN_API_VFS_WRITABLE=network")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	log, err := os.Create(filepath.Join(dir, "console.log"))
	require.NoError(t, err)
	cmd.Stdout, cmd.Stderr = log, log
	require.NoError(t, cmd.Start())
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done); log.Close() }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM) // nspawn powers the machine off
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		os.RemoveAll("/run/systemd/nspawn/propagate/" + name)
	})

	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-done:
			b, _ := os.ReadFile(filepath.Join(dir, "console.log"))
			t.Fatalf("systemd-nspawn exited:\n%s", b)
		default:
		}
		if leader := child(cmd.Process.Pid); leader != 0 {
			root := fmt.Sprintf("/proc/%d/root", leader)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			m, err := systemd.Dial(ctx, root)
			if err == nil {
				st, err := m.State(ctx, "multi-user.target")
				m.Close()
				cancel()
				if err == nil && st.Active == "active" {
					return &Machine{Root: root, Leader: leader}
				}
			} else {
				cancel()
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("systemd did not reach multi-user.target in 60 s")
	return nil
}

// cgroupsFor makes a cgroup called name in every v1 hierarchy (and the v2
// one), removed with everything below it at cleanup, and returns their
// cgroup.procs files.
func cgroupsFor(t testing.TB, name string) []string {
	entries, err := os.ReadDir("/sys/fs/cgroup")
	require.NoError(t, err)
	var dirs, procs []string
	seen := map[string]bool{}
	for _, e := range entries {
		real, err := filepath.EvalSymlinks(filepath.Join("/sys/fs/cgroup", e.Name()))
		if err != nil || seen[real] {
			continue
		}
		if _, err := os.Stat(filepath.Join(real, "cgroup.procs")); err != nil {
			continue
		}
		seen[real] = true
		d := filepath.Join(real, name)
		if err := os.Mkdir(d, 0o755); err != nil {
			continue
		}
		dirs = append(dirs, d)
		if strings.Contains(filepath.Base(real), "cpuset") {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				b, _ := os.ReadFile(filepath.Join(real, f))
				_ = os.WriteFile(filepath.Join(d, f), b, 0o644)
			}
		}
		procs = append(procs, filepath.Join(d, "cgroup.procs"))
	}
	t.Cleanup(func() {
		for _, d := range dirs {
			var sub []string
			_ = filepath.WalkDir(d, func(p string, e os.DirEntry, err error) error {
				if err == nil && e.IsDir() {
					sub = append(sub, p)
				}
				return nil
			})
			slices.Reverse(sub) // deepest first
			for _, s := range sub {
				if err := syscall.Rmdir(s); err != nil {
					t.Logf("remove cgroup %s: %v", s, err)
				}
			}
		}
	})
	return procs
}

// child returns the first child of pid, or 0.
func child(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, pid))
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	n, _ := strconv.Atoi(f[0])
	return n
}
