package bootserver_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/bootserver"
	"github.com/kilnhq/kiln/internal/testenv"
)

func TestDnsmasqConfig(t *testing.T) {
	o := bootserver.DnsmasqOptions{
		Interface:  "kilnbr0",
		RangeStart: "10.77.0.100", RangeEnd: "10.77.0.200",
		BootServer: "http://10.77.0.1:8080/",
		Hosts: []bootserver.DnsmasqHost{
			{MAC: "52:54:00:77:00:11", IP: "10.77.0.11", Name: "vm2"},
			{MAC: "52:54:00:77:00:10", IP: "10.77.0.10", Name: "rack1.vm1"},
		},
		EnableRA:  true,
		TFTPRoot:  "/srv/tftp",
		LeaseFile: "/run/kiln/leases",
	}
	conf := bootserver.DnsmasqConfig(o)
	lines := strings.Split(conf, "\n")
	for _, want := range []string{
		"port=0", "interface=kilnbr0", "bind-interfaces", "except-interface=lo",
		"dhcp-range=10.77.0.100,10.77.0.200,255.255.255.0,1h",
		"dhcp-option=option:router",
		"enable-ra", "dhcp-range=::,constructor:kilnbr0,ra-only",
		"dhcp-userclass=set:ipxe,iPXE",
		"dhcp-host=52:54:00:77:00:10,set:kiln-rack1-vm1,10.77.0.10,rack1.vm1",
		"dhcp-boot=tag:ipxe,tag:kiln-rack1-vm1,http://10.77.0.1:8080/boot/ipxe/rack1.vm1",
		"dhcp-host=52:54:00:77:00:11,set:kiln-vm2,10.77.0.11,vm2",
		"enable-tftp", "tftp-root=/srv/tftp", "dhcp-boot=tag:!ipxe,tag:!efi64,undionly.kpxe",
		"dhcp-leasefile=/run/kiln/leases",
	} {
		found := false
		for _, l := range lines {
			if l == want {
				found = true
			}
		}
		if !found {
			t.Errorf("DnsmasqConfig() lacks the line %q:\n%s", want, conf)
		}
	}
	if strings.Index(conf, "rack1.vm1") > strings.Index(conf, ",vm2") {
		t.Errorf("hosts are not sorted by name:\n%s", conf)
	}

	// dnsmasq itself accepts the file.
	if _, err := exec.LookPath("dnsmasq"); err != nil {
		testenv.Skip(t, "dnsmasq not installed (apt-get install dnsmasq-base)")
	}
	f := filepath.Join(t.TempDir(), "dnsmasq.conf")
	require.NoError(t, os.WriteFile(f, []byte(conf), 0o644))
	out, err := exec.Command("dnsmasq", "--test", "--conf-file="+f).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "syntax check OK") {
		t.Errorf("dnsmasq --test = %v: %s", err, out)
	}
}
