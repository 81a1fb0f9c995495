//go:build linux

package prep

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/host/command"
	"github.com/kilnhq/kiln/host/containerd"
	"github.com/kilnhq/kiln/host/netnstest"
	"github.com/kilnhq/kiln/host/sysctl"
	"github.com/kilnhq/kiln/host/systemd"
	"github.com/kilnhq/kiln/host/systemd/systemdtest"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// TestPrepareRealSystemd prepares a machine that runs a real systemd
// (systemd-nspawn, its own network namespace), from outside through its
// root /proc/LEADER/root, as the lab does with its nodes: sysctls change
// in the machine's namespace only, units are enabled through its D-Bus,
// containerd is restarted for its new config, and a second run changes
// nothing.
func TestPrepareRealSystemd(t *testing.T) {
	const unit = "[Unit]\nDescription=stand-in\n[Service]\nExecStart=/bin/sleep infinity\n[Install]\nWantedBy=multi-user.target\n"
	m := systemdtest.Boot(t, map[string]string{"containerd.service": unit, "kubelet.service": unit})
	ns := netnstest.Of(t, m.Leader)
	requireModules(t)
	ctx := context.Background()
	hostForward, err := sysctl.Get("/", "net.ipv4.ip_forward")
	require.NoError(t, err)

	p := New(m.Root, &command.Recorder{}, logger(t))
	var first, second *agentv1.PrepareResult
	var err1, err2 error
	var inside string
	ns.Do(t, func() {
		require.NoError(t, sysctl.Set(m.Root, "net.ipv4.ip_forward", "0"))
		require.NoError(t, sysctl.Set(m.Root, "net.bridge.bridge-nf-call-iptables", "0"))
		first, err1 = p.Prepare(ctx, &agentv1.PrepareRequest{}, nil)
		second, err2 = p.Prepare(ctx, &agentv1.PrepareRequest{}, nil)
		inside, err = sysctl.Get(m.Root, "net.ipv4.ip_forward")
	})
	require.NoError(t, err1)
	require.NoError(t, err2)
	require.NoError(t, err)
	t.Logf("changes: %q", items(first))
	for _, want := range []string{
		"sysctl net.ipv4.ip_forward: 0 -> 1",
		"sysctl net.bridge.bridge-nf-call-iptables: 0 -> 1",
		"containerd SystemdCgroup: absent -> true",
		"unit containerd.service: disabled -> enabled",
		"unit kubelet.service: disabled -> enabled",
		"unit containerd.service: running with the old config -> restarted",
	} {
		if !slices.Contains(items(first), want) {
			t.Errorf("Prepare() changes = %q, want %q", items(first), want)
		}
	}
	if second.Changed {
		t.Errorf("second Prepare() = %q, want no change", items(second))
	}
	if inside != "1" {
		t.Errorf("ip_forward inside the machine = %q, want 1", inside)
	}
	if got, _ := sysctl.Get("/", "net.ipv4.ip_forward"); got != hostForward {
		t.Errorf("host ip_forward = %q after Prepare of the machine, want unchanged %q", got, hostForward)
	}

	sd, err := systemd.Dial(ctx, m.Root)
	require.NoError(t, err)
	defer sd.Close()
	for _, u := range []string{"containerd.service", "kubelet.service"} {
		st, err := sd.State(ctx, u)
		require.NoError(t, err)
		if st.UnitFile != "enabled" {
			t.Errorf("State(%s) = %+v after Prepare, want enabled", u, st)
		}
	}
	if st, _ := sd.State(ctx, "containerd.service"); st.Active != "active" {
		t.Errorf("containerd.service = %+v after Prepare, want active (restarted)", st)
	}
	if _, err := os.Stat(filepath.Join(m.Root, containerd.DefaultConfig)); err != nil {
		t.Errorf("containerd config in the machine: %v", err)
	}
}
