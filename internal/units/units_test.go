package units

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/testenv"
)

func TestAgentUnit(t *testing.T) {
	tests := []struct {
		name string
		o    Agent
		want string
	}{
		{"packaged defaults", Agent{}, `ExecStart=/usr/bin/kiln-agent run --data-dir /var/lib/kiln-agent --listen :7441 --reboot-command "systemctl reboot" --poweroff-command "systemctl poweroff" $KILN_AGENT_ARGS`},
		{"root /", Agent{Exec: "/opt/kiln-agent", DataDir: "/srv/a", Listen: "127.0.0.1:1", Root: "/"}, `ExecStart=/opt/kiln-agent run --data-dir /srv/a --listen 127.0.0.1:1 --reboot-command`},
		{"other root", Agent{Root: "/mnt/host"}, `--listen :7441 --root /mnt/host --reboot-command`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			u := string(AgentUnit(tt.o))
			for _, want := range []string{tt.want, "\nType=notify\n", "\nWatchdogSec=" + AgentWatchdog + "\n", "\nEnvironmentFile=-" + AgentEnvFile + "\n"} {
				if !strings.Contains(u, want) {
					t.Errorf("AgentUnit(%+v) =\n%s\nwant %q", tt.o, u, want)
				}
			}
			// kubeadm, run by the agent, makes a cgroup to find the cgroup
			// v2 freezer: cgroupfs stays writable.
			require.NotRegexp(t, `(?m)^ProtectControlGroups=`, u)
		})
	}
}

// TestUnitsSandboxing scores both units with `systemd-analyze security
// --offline=yes` (systemd 252, Debian 12) and fails when a change raises
// their exposure above what docs/security.md records.
func TestUnitsSandboxing(t *testing.T) {
	sa := testenv.RequireTool(t, "systemd-analyze", "systemd")
	if out, _ := exec.Command(sa, "security", "--help").CombinedOutput(); !strings.Contains(string(out), "--offline") {
		testenv.Skipf(t, "systemd-analyze security has no --offline (systemd >= 250 needed)")
	}
	dir := t.TempDir()
	tests := []struct {
		unit    string
		content []byte
		max     float64
	}{
		{AgentName, AgentUnit(Agent{}), 6.1},
		{ControllerName, ControllerUnit(), 2.0},
	}
	re := regexp.MustCompile(`Overall exposure level for \S+: ([0-9.]+)`)
	for _, tt := range tests {
		p := filepath.Join(dir, tt.unit)
		require.NoError(t, os.WriteFile(p, tt.content, 0o644))
		out, _ := exec.Command(sa, "security", "--offline=yes", "--no-pager", p).CombinedOutput()
		m := re.FindSubmatch(out)
		require.NotNil(t, m, "systemd-analyze security %s:\n%s", tt.unit, out)
		score, err := strconv.ParseFloat(string(m[1]), 64)
		require.NoError(t, err)
		t.Logf("%s: exposure %.1f", tt.unit, score)
		if score > tt.max {
			t.Errorf("systemd-analyze security %s = %.1f, want at most %.1f (docs/security.md)", tt.unit, score, tt.max)
		}
	}
}
