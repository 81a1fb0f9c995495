//go:build linux

// Package systemdtest boots a real systemd for a test: a Debian root
// ($KILN_SYSTEMD_ROOT, else the lab's cached Debian root from
// imagebuilder/rootfs, built on first use) under systemd-nspawn
// (e2e/lab/nspawn), read-only with a volatile overlay, in its own network
// namespace and cgroups, with test units bound in. Tests skip when the
// root, systemd-nspawn or root privileges are missing. The machine is
// powered off, and its cgroups and nspawn's leftovers removed, when the
// test ends.
package systemdtest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/e2e/lab/nspawn"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/internal/testenv"
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
// /etc/systemd/system, and waits until its systemd reports the system
// running (multi-user.target reached; "degraded" counts, as a unit of the
// test may fail). /proc/sys/net is writable inside, as on a lab node.
func Boot(t testing.TB, units map[string]string) *Machine {
	t.Helper()
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root to run systemd-nspawn")
	}
	if _, err := exec.LookPath("systemd-nspawn"); err != nil {
		testenv.Skip(t, "systemd-nspawn not installed (Debian package systemd-container)")
	}
	image := os.Getenv(RootEnv)
	if image == "" {
		if _, err := exec.LookPath("debootstrap"); err != nil {
			testenv.Skipf(t, "no Debian root: set %s, or install debootstrap to build the lab's cached root", RootEnv)
		}
		// The same spec as the lab's netns hosts, so one cached root serves both.
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
		defer cancel()
		var err error
		image, err = rootfs.Build(ctx, rootfs.Spec{Packages: []string{"procps"}}, nil)
		require.NoError(t, err, "building the cached Debian root for a real systemd")
	}
	dir := t.TempDir()
	var binds []string
	for unit, content := range units {
		p := filepath.Join(dir, unit)
		require.NoError(t, os.WriteFile(p, []byte(content), 0o644))
		binds = append(binds, "--bind-ro="+p+":/etc/systemd/system/"+unit)
	}
	c, err := nspawn.Start(nspawn.Options{
		Name: fmt.Sprintf("kiln-sd-%d-%d", os.Getpid(), time.Now().UnixNano()%100000), Dir: image,
		Binds: binds, Extra: []string{"--volatile=overlay"},
		Console: filepath.Join(dir, "console.log"), StopTimeout: 30 * time.Second,
	})
	require.NoError(t, err)
	t.Cleanup(func() {
		if err := c.Stop(context.Background()); err != nil {
			t.Errorf("stopping the systemd machine: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := c.WaitRunning(ctx); err != nil {
		t.Fatalf("booting a real systemd: %v", err)
	}
	leader := c.Leader()
	return &Machine{Root: fmt.Sprintf("/proc/%d/root", leader), Leader: leader}
}
