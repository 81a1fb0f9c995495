package cli

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

// dnsmasqTest checks conf with dnsmasq itself, when it is installed.
func dnsmasqTest(t *testing.T, conf string) {
	t.Helper()
	if _, err := exec.LookPath("dnsmasq"); err != nil {
		testenv.Skip(t, "dnsmasq not installed (apt-get install dnsmasq-base): cannot check the file with dnsmasq --test")
	}
	f := filepath.Join(t.TempDir(), "kiln.conf")
	require.NoError(t, os.WriteFile(f, []byte(conf), 0o644))
	out, err := exec.Command("dnsmasq", "--test", "-C", f).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "syntax check OK") {
		t.Errorf("dnsmasq --test -C FILE = %v: %s\nFILE:\n%s", err, out, conf)
	}
}

func TestDnsmasqConfig(t *testing.T) {
	base := []string{"dnsmasq-config", "--interface", "br-prov", "--boot-url", "http://10.77.0.1:8080"}
	tests := []struct {
		name string
		args []string
		want []string // lines the output must hold
	}{
		{
			name: "pool and two hosts",
			args: []string{"--range", "10.77.0.100,10.77.0.200", "--router", "10.77.0.1",
				"--host", "52:54:00:00:01:02,10.77.0.12,rack1-02", "--host", "52:54:00:00:01:01,rack1-01"},
			want: []string{
				"interface=br-prov",
				"dhcp-range=10.77.0.100,10.77.0.200,255.255.255.0,1h",
				"dhcp-option=option:router,10.77.0.1",
				"dhcp-host=52:54:00:00:01:01,set:kiln-rack1-01,rack1-01",
				"dhcp-boot=tag:ipxe,tag:kiln-rack1-01,http://10.77.0.1:8080/boot/ipxe/rack1-01",
				"dhcp-host=52:54:00:00:01:02,set:kiln-rack1-02,10.77.0.12,rack1-02",
				"dhcp-boot=tag:ipxe,tag:kiln-rack1-02,http://10.77.0.1:8080/boot/ipxe/rack1-02",
			},
		},
		{
			name: "static range, TFTP chain-load, RA",
			args: []string{"--range", "10.77.0.0", "--lease-time", "12h", "--tftp-root", "/srv/tftp", "--enable-ra",
				"--host", "52:54:00:AA:BB:CC,10.77.0.20,edge-01"},
			want: []string{
				"dhcp-range=10.77.0.0,static,255.255.255.0,12h",
				"dhcp-host=52:54:00:aa:bb:cc,set:kiln-edge-01,10.77.0.20,edge-01",
				"tftp-root=/srv/tftp",
				"dhcp-boot=tag:!ipxe,tag:!efi64,undionly.kpxe",
				"enable-ra",
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, _, err := run(t, nil, append(base, tt.args...)...)
			require.NoError(t, err)
			lines := map[string]bool{}
			for _, l := range strings.Split(out, "\n") {
				lines[l] = true
			}
			for _, w := range tt.want {
				if !lines[w] {
					t.Errorf("kilnctl dnsmasq-config %s: no line %q in\n%s", strings.Join(tt.args, " "), w, out)
				}
			}
			dnsmasqTest(t, out)
		})
	}
}

func TestDnsmasqConfigRefusesBadFlags(t *testing.T) {
	ok := map[string]string{"--interface": "br-prov", "--boot-url": "http://10.77.0.1:8080", "--range": "10.77.0.100,10.77.0.200"}
	tests := []struct {
		name, flag, value string
	}{
		{"no interface", "--interface", ""},
		{"interface injects an option", "--interface", "br0\nport=53"},
		{"no boot url", "--boot-url", ""},
		{"boot url not http", "--boot-url", "tftp://10.77.0.1/x"},
		{"no range", "--range", ""},
		{"range not an address", "--range", "10.77.0.100,ten"},
		{"host without name", "--host", "52:54:00:00:01:01"},
		{"host bad MAC", "--host", "52:54:00:01,rack1-01"},
		{"host bad IP", "--host", "52:54:00:00:01:01,10.77.0.300,rack1-01"},
		{"host bad name", "--host", "52:54:00:00:01:01,Rack_1"},
		{"bad lease time", "--lease-time", "1 hour"},
		{"bad router", "--router", "gw"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			args := []string{"dnsmasq-config"}
			for k, v := range ok {
				if k != tt.flag {
					args = append(args, k, v)
				}
			}
			args = append(args, tt.flag, tt.value)
			out, _, err := run(t, nil, args...)
			if !errdefs.IsInvalidArgument(err) {
				t.Errorf("kilnctl dnsmasq-config %s %q = %v, want InvalidArgument", tt.flag, tt.value, err)
			}
			if out != "" {
				t.Errorf("kilnctl dnsmasq-config %s %q printed a config:\n%s", tt.flag, tt.value, out)
			}
		})
	}
}

// TestDnsmasqConfigFromController adds the controller's Hosts that have a
// boot MAC; a --host of the same name pins its address.
func TestDnsmasqConfigFromController(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	env := controllertest.Start(t)
	admin := env.AdminConfigPath
	mustKilnctl(t, admin, "apply", "-f", filepath.Join(examplesDir, "host-ipmi.yaml"), "-f", filepath.Join(examplesDir, "host-byoh.yaml"))
	out := mustKilnctl(t, admin, "dnsmasq-config", "--interface", "br-prov", "--boot-url", "http://10.77.0.1:8080",
		"--range", "10.77.0.100,10.77.0.200", "--from-controller", "--host", "52:54:00:00:09:09,10.77.0.9,edge-09")
	for _, w := range []string{
		"dhcp-host=52:54:00:00:01:02,set:kiln-rack1-02,rack1-02",
		"dhcp-boot=tag:ipxe,tag:kiln-rack1-02,http://10.77.0.1:8080/boot/ipxe/rack1-02",
		"dhcp-host=52:54:00:00:09:09,set:kiln-edge-09,10.77.0.9,edge-09",
	} {
		if !strings.Contains(out, w+"\n") {
			t.Errorf("kilnctl dnsmasq-config --from-controller: no line %q in\n%s", w, out)
		}
	}
	if strings.Contains(out, "edge-01") {
		t.Errorf("kilnctl dnsmasq-config --from-controller lists the BYOH host edge-01, which has no boot MAC:\n%s", out)
	}
	dnsmasqTest(t, out)
}
