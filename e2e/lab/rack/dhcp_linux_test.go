package rack

import (
	"context"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/e2e/lab/netns"
	"github.com/kilnhq/kiln/internal/testenv"
)

// TestDHCPConfig: the lab's dnsmasq gives VM host i the gateway plus i by
// its MAC and nobody else an address, hands out no DNS server, and with
// a boot URL points each host's iPXE at its own script.
func TestDHCPConfig(t *testing.T) {
	pfx := netip.MustParsePrefix("10.251.7.0/24")
	tests := []struct {
		name      string
		opts      Options
		want, not []string
	}{
		{
			name: "addresses only",
			opts: Options{Name: "lv", Backend: BackendLibvirt},
			want: []string{
				"interface=kbr-lv", "bind-interfaces", "port=0",
				"dhcp-range=10.251.7.2,static,255.255.255.0,1h",
				"dhcp-option=option:router,10.251.7.1",
				"dhcp-option=option:dns-server\n",
				"dhcp-host=52:54:00:4b:00:01,set:kiln-lv-h1,10.251.7.2,lv-h1",
				"dhcp-host=52:54:00:4b:00:02,set:kiln-lv-h2,10.251.7.3,lv-h2",
				"dhcp-leasefile=/s/dnsmasq/leases",
			},
			not: []string{"dhcp-boot", "lv-h3", "enable-tftp"},
		},
		{
			name: "PXE into the boot server's scripts",
			opts: Options{Name: "lv", Backend: BackendQEMU, BootURL: "http://{gateway}:8080/boot/ipxe/{host}"},
			want: []string{
				"dhcp-boot=tag:ipxe,tag:kiln-lv-h1,http://10.251.7.1:8080/boot/ipxe/lv-h1",
				"dhcp-boot=tag:ipxe,tag:kiln-lv-h2,http://10.251.7.1:8080/boot/ipxe/lv-h2",
			},
			not: []string{"{gateway}", "{host}"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := dhcpConfig(tt.opts, "kbr-lv", pfx, 2, "/s/dnsmasq")
			for _, w := range tt.want {
				if !strings.Contains(got, w) {
					t.Errorf("dhcpConfig(%+v) =\n%s\nwant %q in it", tt.opts, got, w)
				}
			}
			for _, n := range tt.not {
				if strings.Contains(got, n) {
					t.Errorf("dhcpConfig(%+v) =\n%s\nwant no %q in it", tt.opts, got, n)
				}
			}
		})
	}
}

// TestGuardRules: every lab drops what would leave through the uplinks;
// a VM lab's guard also drops everything forwarded between its bridge
// and any other interface, and keeps bridge-to-bridge traffic (VM to VM).
func TestGuardRules(t *testing.T) {
	got := guardRules("kiln-lab-x", []string{"eth0"}, "")
	if !strings.Contains(got, `oifname "eth0" counter drop`) || strings.Contains(got, "iifname") {
		t.Errorf("guardRules(netns) =\n%s\nwant only the uplink rule", got)
	}
	got = guardRules("kiln-lab-x", []string{"eth0"}, "kbr-x")
	for _, w := range []string{
		"type filter hook forward priority -200; policy accept;",
		`oifname "eth0" counter drop`,
		`iifname "kbr-x" oifname != "kbr-x" counter drop`,
		`oifname "kbr-x" iifname != "kbr-x" counter drop`,
	} {
		if !strings.Contains(got, w) {
			t.Errorf("guardRules(vm) =\n%s\nwant %q in it", got, w)
		}
	}
}

// TestDownKillsUnrecordedDHCP: a supervisor that died after starting the
// lab's dnsmasq but before recording its PID left only the dnsmasq
// configuration (KindDHCP, recorded first) in the state: Down still stops
// that dnsmasq, found by its configuration file, and leaves another
// dnsmasq alone.
func TestDownKillsUnrecordedDHCP(t *testing.T) {
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root: the lab's dnsmasq runs as root (--user=root)")
	}
	if _, err := exec.LookPath("dnsmasq"); err != nil {
		testenv.Skip(t, "dnsmasq not installed (Debian package dnsmasq-base)")
	}
	dir := filepath.Join(t.TempDir(), "lab")
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "dnsmasq"), 0o700))
	start := func(conf string) *exec.Cmd {
		// port=0 and no DHCP range: dnsmasq idles, binding nothing.
		require.NoError(t, os.WriteFile(conf, []byte("port=0\n"), 0o600))
		cmd := exec.Command("dnsmasq", "--keep-in-foreground", "--log-facility=-", "--user=root", dhcpArg(conf))
		require.NoError(t, cmd.Start())
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		return cmd
	}
	conf := filepath.Join(dir, "dnsmasq", "dnsmasq.conf")
	lab := start(conf)
	other := start(filepath.Join(t.TempDir(), "other.conf"))
	exited := make(chan struct{})
	go func() { _ = lab.Wait(); close(exited) }()
	require.NoError(t, writeJSON(filepath.Join(dir, StateFile), &State{Name: "dq", Backend: BackendLibvirt, Phase: PhaseStarting,
		Resources: []netns.Resource{{Kind: KindDHCP, Value: conf}}}, 0o644))

	require.NoError(t, Down(context.Background(), dir, nil))
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		t.Fatalf("Down(%s): the lab's dnsmasq (pid %d) still runs", dir, lab.Process.Pid)
	}
	if !netns.ProcessAlive(netns.ProcessID(other.Process.Pid)) {
		t.Errorf("Down(%s) stopped another dnsmasq (pid %d)", dir, other.Process.Pid)
	}
	if _, err := os.Stat(dir); err == nil {
		t.Errorf("Down(%s): the state directory is still there", dir)
	}
}
