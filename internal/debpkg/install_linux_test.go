//go:build linux

package debpkg_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/e2e/lab/nspawn"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/internal/debpkg"
	"github.com/kilnhq/kiln/internal/testenv"
	"github.com/kilnhq/kiln/internal/units"
)

// PackagesEnv names a directory of already built packages (make
// packages writes out/packages) for TestInstallPurge to install instead
// of building them from this tree.
const PackagesEnv = "KILN_PACKAGES_DIR"

// TestInstallPurge installs the three packages with apt-get into a
// pristine Debian 12 root (the lab's cached root: debootstrap minbase with
// systemd, dbus, iproute2 and procps) booted under systemd-nspawn with
// systemd as PID 1 and no network but loopback; checks that the
// controller runs from its package, makes an enrollment token with
// kilnctl, enrolls the agent from its package (enroll --install-unit
// enables and starts the packaged unit, Type=notify with a watchdog), and
// sees the host Available; then purges the packages and checks that no
// unit and no file is left but the documented state directories.
func TestInstallPurge(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a Debian root and builds the binaries; not in -short")
	}
	testenv.RequireRoot(t, "to boot a Debian root with systemd-nspawn")
	testenv.RequireTool(t, "systemd-nspawn", "systemd-container")
	testenv.RequireTool(t, "nsenter", "util-linux")
	start := time.Now()
	step := func(what string) { t.Logf("[%5.1fs] %s", time.Since(start).Seconds(), what) }

	debs, upgrade := packagesForTest(t)
	step("packages ready")

	image := os.Getenv("KILN_SYSTEMD_ROOT")
	if image == "" {
		if _, err := exec.LookPath("debootstrap"); err != nil {
			testenv.Skipf(t, "no Debian root: set KILN_SYSTEMD_ROOT, or install debootstrap to build the lab's cached root")
		}
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
		var err error
		image, err = rootfs.Build(ctx, rootfs.Spec{Packages: []string{"procps"}}, nil)
		cancel()
		require.NoError(t, err, "building the cached Debian root")
	}
	step("Debian root ready: " + image)

	const machine = "kiln-pkg"
	dir := t.TempDir()
	c, err := nspawn.Start(nspawn.Options{
		Name: fmt.Sprintf("%s-%d", machine, os.Getpid()), Dir: image,
		Binds: []string{"--bind-ro=" + filepath.Dir(debs[0]) + ":/mnt/kiln-debs",
			"--bind-ro=" + filepath.Dir(upgrade[0]) + ":/mnt/kiln-debs-up"},
		Extra:   []string{"--volatile=overlay", "--hostname=" + machine},
		Console: filepath.Join(dir, "console.log"), StopTimeout: 30 * time.Second,
	})
	require.NoError(t, err)
	t.Cleanup(func() {
		if err := c.Stop(context.Background()); err != nil {
			t.Errorf("stopping the machine: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	require.NoError(t, c.WaitRunning(ctx))
	step("booted")

	sh := func(script string) string {
		t.Helper()
		out, err := c.Exec(ctx, "sh", "-ec", script)
		require.NoError(t, err, "in the machine: %s", script)
		return out
	}
	// What the pristine root holds with "kiln" in its name, to compare
	// after the purge.
	findKiln := `find / -xdev \( -path /proc -o -path /sys -o -path /dev -o -path /run -o -path /mnt/kiln-debs -o -path /mnt/kiln-debs-up \) -prune -o -name '*kiln*' -print | sort`
	before := sh(findKiln)

	var names []string
	for _, d := range debs {
		names = append(names, "/mnt/kiln-debs/"+filepath.Base(d))
	}
	out := sh("apt-get install -y --no-install-recommends " + strings.Join(names, " "))
	t.Logf("apt-get install:\n%s", lastLines(out, 12))
	step("installed")
	for _, p := range []string{"/usr/bin/kiln-agent", "/usr/bin/kiln-controller", "/usr/bin/kilnctl",
		"/usr/lib/systemd/system/" + units.AgentName, "/usr/lib/systemd/system/" + units.ControllerName,
		units.AgentEnvFile, units.ControllerEnvFile} {
		sh("test -e " + p)
	}
	conffiles := sh("cat /var/lib/dpkg/info/kiln-agent.conffiles /var/lib/dpkg/info/kiln-controller.conffiles")
	for _, f := range []string{units.AgentEnvFile, units.ControllerEnvFile} {
		require.Contains(t, conffiles, f, "conffiles")
	}

	// The controller runs from its package: postinst enabled and started
	// it; Type=notify makes it active only once the API serves.
	waitFor(t, ctx, "kiln-controller.service active", func() (bool, string) {
		out, _ := c.Exec(ctx, "systemctl", "is-active", units.ControllerName)
		return strings.TrimSpace(out) == "active", out
	})
	step("controller active")
	if en := strings.TrimSpace(sh("systemctl is-enabled " + units.ControllerName)); en != "enabled" {
		t.Errorf("systemctl is-enabled %s = %q, want enabled", units.ControllerName, en)
	}
	show := sh("systemctl show " + units.ControllerName + " -p Type -p User -p DynamicUser -p StateDirectory")
	t.Logf("controller unit: %s", strings.Join(strings.Fields(show), " "))
	require.Contains(t, show, "Type=notify")
	require.Contains(t, show, "DynamicUser=yes")
	uid := strings.TrimSpace(sh("ps -o uid= -p $(systemctl show -p MainPID --value " + units.ControllerName + ")"))
	if uid == "0" {
		t.Errorf("kiln-controller runs as uid 0, want a dynamic user")
	}

	const kilncfg = "KILNCONFIG=" + units.ControllerDataDir + "/kilnconfig-admin.yaml"
	// The token stays inside the machine: kilnctl's output goes to a
	// file there, and only the CA hash comes back to the test's log.
	waitFor(t, ctx, "kilnctl token create", func() (bool, string) {
		out, err := c.Exec(ctx, "sh", "-c", kilncfg+" kilnctl token create --ttl 10m > /root/enroll.txt 2>&1")
		return err == nil, out
	})
	sh(`umask 077; sed -n 's/.*--token \([^ ]*\) .*/\1/p' /root/enroll.txt > /root/token; test -s /root/token`)
	caHash := strings.TrimSpace(sh(`grep -o 'sha256:[0-9a-f]\{64\}' /root/enroll.txt | head -n 1`))
	require.Regexp(t, `^sha256:[0-9a-f]{64}$`, caHash, "kilnctl token create printed no CA hash")
	step("token created")

	out = sh("kiln-agent enroll --controller 127.0.0.1:7443 --token-file /root/token --ca-hash " + caHash + " --install-unit")
	t.Logf("kiln-agent enroll:\n%s", out)
	require.Contains(t, out, "using the packaged "+units.AgentName, "enroll --install-unit must use the packaged unit")
	require.Contains(t, out, "enabled and started "+units.AgentName)
	sh("test -s " + units.AgentDataDir + "/agent.crt")
	sh("test ! -e /etc/systemd/system/" + units.AgentName)
	waitFor(t, ctx, "kiln-agent.service active", func() (bool, string) {
		out, _ := c.Exec(ctx, "systemctl", "is-active", units.AgentName)
		return strings.TrimSpace(out) == "active", out
	})
	show = sh("systemctl show " + units.AgentName + " -p Type -p WatchdogUSec -p NRestarts -p UnitFileState")
	t.Logf("agent unit: %s", strings.Join(strings.Fields(show), " "))
	for _, want := range []string{"Type=notify", "WatchdogUSec=1min", "UnitFileState=enabled"} {
		require.Contains(t, show, want)
	}
	step("agent active")

	// The watchdog pings reach the real systemd through the sandbox:
	// with WatchdogSec=2s (a runtime drop-in), systemd's record of the
	// last ping moves on, twice, and the agent is not restarted.
	const dropIn = "/run/systemd/system/" + units.AgentName + ".d"
	sh("mkdir -p " + dropIn + " && printf '[Service]\\nWatchdogSec=2s\\n' > " + dropIn + "/watchdog.conf && systemctl daemon-reload && systemctl restart " + units.AgentName)
	pings := map[string]bool{}
	waitFor(t, ctx, "two watchdog pings of kiln-agent.service", func() (bool, string) {
		ts := strings.TrimSpace(sh("systemctl show -p WatchdogTimestampMonotonic --value " + units.AgentName))
		if ts != "" && ts != "0" {
			pings[ts] = true
		}
		return len(pings) >= 3, ts
	})
	show = sh("systemctl show " + units.AgentName + " -p WatchdogUSec -p NRestarts -p ActiveState")
	require.Contains(t, show, "WatchdogUSec=2s")
	require.Contains(t, show, "NRestarts=0")
	require.Contains(t, show, "ActiveState=active")
	sh("rm -r " + dropIn + " && systemctl daemon-reload && systemctl restart " + units.AgentName)
	step("watchdog pinged")

	// The host: BYOH (no BMC), so it goes Registering -> Inspecting ->
	// Available once its agent heartbeats.
	var state string
	waitFor(t, ctx, "host "+machine+" Available", func() (bool, string) {
		out, err := c.Exec(ctx, "sh", "-c", kilncfg+" kilnctl get host "+machine+" -o json")
		if err != nil {
			return false, out
		}
		var h struct {
			Status struct {
				State string `json:"state"`
			} `json:"status"`
		}
		if err := json.Unmarshal([]byte(out), &h); err != nil {
			return false, out
		}
		state = h.Status.State
		return state == "Available" || state == "HOST_STATE_AVAILABLE", out
	})
	step("host " + state)
	t.Logf("kilnctl get hosts:\n%s", sh(kilncfg+" kilnctl get hosts"))

	// The agent keeps running past its watchdog: no restart after 1.5
	// WatchdogSec would be too slow a test; the watchdog interval is
	// checked above and a missed ping would show as NRestarts > 0 here.
	if n := strings.TrimSpace(sh("systemctl show -p NRestarts --value " + units.AgentName)); n != "0" {
		t.Errorf("kiln-agent.service NRestarts = %s, want 0", n)
	}

	// Upgrade: a site's edit of a conffile stays, both daemons restart
	// on the new version, the host stays Available.
	mainPID := func(unit string) string {
		return strings.TrimSpace(sh("systemctl show -p MainPID --value " + unit))
	}
	agentPID, ctlPID := mainPID(units.AgentName), mainPID(units.ControllerName)
	sh(`echo 'KILN_AGENT_ARGS="--log-level debug"' >> ` + units.AgentEnvFile)
	names = names[:0]
	for _, d := range upgrade {
		names = append(names, "/mnt/kiln-debs-up/"+filepath.Base(d))
	}
	out = sh("apt-get install -y --no-install-recommends " + strings.Join(names, " "))
	t.Logf("apt-get install (upgrade):\n%s", lastLines(out, 6))
	step("upgraded")
	for _, n := range debpkg.Names {
		if v := sh("dpkg-query -W -f '${Version}' " + n); !strings.HasSuffix(v, "+up") {
			t.Errorf("%s version after the upgrade = %q, want the +up one", n, v)
		}
	}
	require.Contains(t, sh("cat "+units.AgentEnvFile), `KILN_AGENT_ARGS="--log-level debug"`, "the site's edit of the conffile survives the upgrade")
	for unit, before := range map[string]string{units.AgentName: agentPID, units.ControllerName: ctlPID} {
		waitFor(t, ctx, unit+" restarted by the upgrade", func() (bool, string) {
			out, _ := c.Exec(ctx, "systemctl", "is-active", unit)
			pid := mainPID(unit)
			return strings.TrimSpace(out) == "active" && pid != before && pid != "0", out + " MainPID " + pid
		})
	}
	require.Contains(t, sh("ps -o args= -p "+mainPID(units.AgentName)), "--log-level debug", "the agent runs with KILN_AGENT_ARGS from the conffile")
	waitFor(t, ctx, "host "+machine+" heartbeating after the upgrade", func() (bool, string) {
		out, err := c.Exec(ctx, "sh", "-c", kilncfg+" kilnctl get host "+machine)
		return err == nil && strings.Contains(out, "Available"), out
	})
	step("checked the upgrade")

	for _, u := range []string{units.AgentName, units.ControllerName} {
		out, _ := c.Exec(ctx, "systemd-analyze", "security", "--no-pager", u)
		t.Logf("systemd-analyze security %s: %s", u, lastLines(out, 1))
	}

	out = sh("apt-get purge -y kiln-agent kiln-controller kilnctl")
	t.Logf("apt-get purge:\n%s", lastLines(out, 8))
	step("purged")
	if out := sh("systemctl list-unit-files --no-legend 'kiln*' || true"); strings.TrimSpace(out) != "" {
		t.Errorf("unit files left after purge:\n%s", out)
	}
	if out := sh("systemctl list-units --all --no-legend 'kiln*' || true"); strings.Contains(out, "kiln") && !strings.Contains(out, "not-found") {
		t.Errorf("units left after purge:\n%s", out)
	}
	after := sh(findKiln)
	documented := []string{units.AgentDataDir, units.ControllerDataDir, "/var/lib/private/kiln-controller"}
	var stray []string
	for _, p := range strings.Fields(after) {
		if strings.Contains(before, p+"\n") {
			continue
		}
		doc := false
		for _, d := range documented {
			if p == d || strings.HasPrefix(p, d+"/") {
				doc = true
			}
		}
		if !doc {
			stray = append(stray, p)
		}
	}
	if len(stray) > 0 {
		t.Errorf("files left after purge besides the documented state (%s):\n%s", strings.Join(documented, ", "), strings.Join(stray, "\n"))
	}
	t.Logf("kept after purge (documented state):\n%s", after)
	sh("test ! -e /etc/kiln")
	if dpkg := sh("dpkg -l 'kiln*' 2>/dev/null | grep '^[a-z][a-z] ' || true"); strings.TrimSpace(dpkg) != "" {
		t.Errorf("dpkg still knows the packages after purge:\n%s", dpkg)
	}
	step("checked the purge")
}

// packagesForTest returns the three .deb files, from $KILN_PACKAGES_DIR
// or else built from this tree (go build of the three binaries, then
// Build), and the same packages at a higher version in another
// directory, to upgrade to.
func packagesForTest(t *testing.T) (debs, upgrade []string) {
	t.Helper()
	testenv.RequireTool(t, "dpkg-deb", "dpkg")
	bin := t.TempDir()
	version := "0~test"
	if d := os.Getenv(PackagesEnv); d != "" {
		for _, n := range debpkg.Names {
			m, _ := filepath.Glob(filepath.Join(d, n+"_*.deb"))
			require.Len(t, m, 1, "%s: want one %s package", d, n)
			debs = append(debs, m[0])
			x := t.TempDir()
			out, err := exec.Command("dpkg-deb", "-x", m[0], x).CombinedOutput()
			require.NoError(t, err, "dpkg-deb -x %s: %s", m[0], out)
			require.NoError(t, os.Rename(filepath.Join(x, "usr/bin", n), filepath.Join(bin, n)))
		}
		out, err := exec.Command("dpkg-deb", "-f", debs[0], "Version").Output()
		require.NoError(t, err)
		version = strings.TrimSpace(string(out))
	} else {
		testenv.RequireTool(t, "go", "golang (or /usr/local/go/bin on PATH)")
		for _, n := range debpkg.Names {
			args := []string{"build", "-trimpath", "-o", filepath.Join(bin, n)}
			if n == debpkg.Agent {
				args = append(args, "-tags", "grpcnotrace")
			}
			cmd := exec.Command("go", append(args, "github.com/kilnhq/kiln/cmd/"+n)...)
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, "go build %s: %s", n, out)
		}
		var err error
		debs, err = debpkg.Build(debpkg.Options{BinDir: bin, OutDir: t.TempDir(), Version: version, MTime: time.Unix(1_700_000_000, 0)})
		require.NoError(t, err)
	}
	upgrade, err := debpkg.Build(debpkg.Options{BinDir: bin, OutDir: t.TempDir(), Version: version + "+up", MTime: time.Unix(1_700_000_000, 0)})
	require.NoError(t, err)
	return debs, upgrade
}

// waitFor polls cond until it holds or ctx ends; the failure names what
// it waited for and cond's last output.
func waitFor(t *testing.T, ctx context.Context, what string, cond func() (bool, string)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	var last string
	for {
		ok, out := cond()
		if ok {
			return
		}
		last = out
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for %s: %v; last: %s", what, ctx.Err(), last)
		case <-time.After(500 * time.Millisecond):
		}
	}
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(l[max(0, len(l)-n):], "\n")
}
