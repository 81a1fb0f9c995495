package netns

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestBridgeMACSurvivesLowerPort: a lab bridge created with BridgeMAC
// keeps its MAC when a port with a lower MAC joins it, so hosts already
// up keep a valid ARP entry for the gateway; a bridge created without
// one takes the port's MAC (the CI failure: an enrolled agent's dials to
// the gateway timed out after the next hosts joined).
func TestBridgeMACSurvivesLowerPort(t *testing.T) {
	needRoot(t)
	ip := func(args ...string) {
		t.Helper()
		out, err := exec.Command("ip", args...).CombinedOutput()
		require.NoError(t, err, "ip %s: %s", strings.Join(args, " "), out)
	}
	mac := func(link string) string {
		b, err := os.ReadFile("/sys/class/net/" + link + "/address")
		require.NoError(t, err)
		return strings.TrimSpace(string(b))
	}
	id := os.Getpid() % 100000
	for _, fixed := range []bool{true, false} {
		br, port := fmt.Sprintf("kbm%d", id), fmt.Sprintf("kbmp%d", id)
		if !fixed {
			br, port = br+"u", port+"u"
		}
		args := []string{"link", "add", br, "type", "bridge"}
		if fixed {
			args = []string{"link", "add", br, "address", BridgeMAC(br), "type", "bridge"}
		}
		ip(args...)
		t.Cleanup(func() { _ = exec.Command("ip", "link", "del", br).Run() })
		ip("link", "set", br, "up")
		before := mac(br)
		ip("link", "add", port, "address", "02:00:00:00:00:01", "type", "veth", "peer", "name", port+"p")
		t.Cleanup(func() { _ = exec.Command("ip", "link", "del", port).Run() })
		ip("link", "set", port, "master", br, "up")
		if fixed {
			require.Equal(t, BridgeMAC(br), before)
			require.Equal(t, before, mac(br), "the bridge made with BridgeMAC changed its MAC when a port joined")
		} else {
			require.Equal(t, "02:00:00:00:00:01", mac(br), "a bridge without a set MAC kept %s: the kernel no longer follows its ports (the fix is then moot)", before)
		}
	}
	require.NotEqual(t, BridgeMAC("kiln-a"), BridgeMAC("kiln-b"))
}
