package golden

import (
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

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/e2e/lab/nspawn"
	"github.com/kilnhq/kiln/host/systemd"
	"github.com/kilnhq/kiln/imagebuilder/disk"
	"github.com/kilnhq/kiln/imagebuilder/manifest"
	"github.com/kilnhq/kiln/internal/testenv"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// TestMinimalImageBootsAsLabHost lays the minimal image on a host's disk
// file, writes the host's identity into it as the controller does before
// the reboot into the image (an enrollment with a one-time token), boots
// the disk as a lab host (its root partition mounted from the disk file,
// then systemd-nspawn with the image's own systemd as PID 1), and checks that the installed
// kiln-agent.service is active and that its heartbeats reach the
// controller as that host.
func TestMinimalImageBootsAsLabHost(t *testing.T) {
	if testing.Short() {
		t.Skip("builds an image (about a minute with a warm rootfs cache)")
	}
	needBuilder(t, minimalSpec(t, "/unused"))
	for tool, pkg := range map[string]string{"systemd-nspawn": "systemd-container"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (Debian package %s)", tool, pkg)
		}
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		testenv.Skipf(t, "no loop devices: %v", err)
	}
	res := sharedMinimal(t)

	// Lay the image on the host's disk file.
	dir := t.TempDir()
	diskFile := filepath.Join(dir, "disk.raw")
	out, err := exec.Command("cp", "--sparse=always", res.RawPath, diskFile).CombinedOutput()
	require.NoError(t, err, "%s", out)
	// systemd-dissect --mount also mounts the ESP, and these kernels have
	// no vfat: mount the root partition alone, from its offset.
	var rootPart manifest.Partition
	for _, p := range res.Manifest.Partitions {
		if p.Type == disk.TypeRootX8664 {
			rootPart = p
		}
	}
	require.NotZero(t, rootPart.Size)
	mnt := filepath.Join(dir, "root")
	require.NoError(t, os.Mkdir(mnt, 0o755))
	out, err = exec.Command("mount", "-o", fmt.Sprintf("loop,offset=%d,sizelimit=%d", rootPart.Offset, rootPart.Size), diskFile, mnt).CombinedOutput()
	if err != nil {
		testenv.Skipf(t, "cannot loop-mount the root partition here: %v: %s", err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v: %s", mnt, err, out)
		}
	})

	// The host's identity, written into the laid image.
	env := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) { c.HeartbeatInterval = time.Second }))
	host := fmt.Sprintf("golden-%d", os.Getpid())
	tok := env.Token(t, host, time.Hour)
	out, err = exec.Command(agentBinary(t), "enroll", "--controller", env.Addr, "--token", tok, "--ca-hash", env.CAHash,
		"--host", host, "--data-dir", filepath.Join(mnt, AgentDataDir)).CombinedOutput()
	require.NoError(t, err, "enroll into the image: %s", out)
	enrolled := time.Now()

	// The lab host shares this machine's network namespace (the controller
	// listens on loopback): give its agent a free loopback port.
	port := freePort(t)
	dropIn := fmt.Sprintf("[Service]\nExecStart=\nExecStart=%s run --data-dir %s --listen 127.0.0.1:%d --heartbeat-interval 1s\n", AgentPath, AgentDataDir, port)
	require.NoError(t, os.MkdirAll(filepath.Join(mnt, "etc/systemd/system", AgentUnit+".d"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(mnt, "etc/systemd/system", AgentUnit+".d", "lab.conf"), []byte(dropIn), 0o644))

	leader := bootNspawn(t, mnt, host)
	root := fmt.Sprintf("/proc/%d/root", leader)

	var last systemd.UnitState
	waitUntil(t, 90*time.Second, "kiln-agent.service active in the booted image", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		m, err := systemd.Dial(ctx, root)
		if err != nil {
			return false
		}
		defer m.Close()
		last, err = m.State(ctx, AgentUnit)
		return err == nil && last.Active == "active"
	}, func() string { return fmt.Sprintf("last state %+v", last) })

	// No unit of the image failed (cgroup-rw, sysctls, the agent).
	failed, err := exec.Command("nsenter", "-t", strconv.Itoa(leader), "-a", "systemctl", "--failed", "--no-legend", "--plain").CombinedOutput()
	require.NoError(t, err, "%s", failed)
	if strings.TrimSpace(string(failed)) != "" {
		t.Errorf("failed units in the booted image:\n%s", failed)
	}

	rc := controllerv1.NewResourcesClient(env.Dial(t, env.AdminConfigPath))
	var addr string
	waitUntil(t, 60*time.Second, "a heartbeat from the booted agent", func() bool {
		r, err := rc.Get(context.Background(), &controllerv1.GetRequest{Kind: "Host", Name: host})
		if err != nil {
			return false
		}
		a := r.GetHost().GetStatus().GetAgent()
		addr = a.GetAddress()
		return a.GetLastHeartbeat() != nil && a.GetLastHeartbeat().AsTime().After(enrolled) && strings.HasSuffix(addr, ":"+strconv.Itoa(port))
	}, func() string { return "agent address " + addr })
}

func freePort(t *testing.T) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func waitUntil(t *testing.T, d time.Duration, what string, cond func() bool, detail func() string) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s (%s)", d, what, detail())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// bootNspawn boots dir with systemd as PID 1 under systemd-nspawn in its
// own cgroups, sharing this machine's network namespace, waits until the
// boot is over and returns the PID of its init. The machine is powered
// off and its cgroups and nspawn's leftovers are removed at cleanup.
func bootNspawn(t *testing.T, dir, name string) int {
	t.Helper()
	c, err := nspawn.Start(nspawn.Options{Name: name, Dir: dir, HostNetwork: true,
		Console: filepath.Join(t.TempDir(), "console.log"), StopTimeout: 30 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("console:\n%s", c.ConsoleTail(200))
		}
		if err := c.Stop(context.Background()); err != nil {
			t.Errorf("stopping the booted image: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	require.NoError(t, c.WaitRunning(ctx))
	return c.Leader()
}
