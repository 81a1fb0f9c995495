package cli

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/e2e/lab/rack"
	"github.com/kilnhq/kiln/internal/manifest"
)

// TestLabCommands runs the real kilnctl binary: lab up (its supervisor is
// `kilnctl lab serve`, its IPMI chassis program `kilnctl lab chassis`),
// status, an IPMI power-on through ipmi_sim, and lab down.
func TestLabCommands(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds kilnctl and brings up a lab")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root for the lab's namespaces, bridge and nftables")
	}
	for tool, pkg := range map[string]string{"go": "golang", "nft": "nftables", "ipmi_sim": "openipmi", "ipmitool": "ipmitool"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed (%s)", tool, pkg)
		}
	}
	tmp := t.TempDir()
	kilnctl := filepath.Join(tmp, "kilnctl")
	out, err := exec.Command("go", "build", "-o", kilnctl, "github.com/kilnhq/kiln/cmd/kilnctl").CombinedOutput()
	require.NoError(t, err, "go build kilnctl: %s", out)

	dir := filepath.Join(tmp, "lab")
	name := fmt.Sprintf("c%d", os.Getpid()%100000)
	run := func(args ...string) string {
		t.Helper()
		out, err := exec.Command(kilnctl, args...).CombinedOutput()
		require.NoError(t, err, "kilnctl %s: %s", strings.Join(args, " "), out)
		return string(out)
	}
	t.Cleanup(func() { _ = exec.Command(kilnctl, "lab", "down", "--state-dir", dir).Run() })

	up := run("lab", "up", "--name", name, "--hosts", "1", "--ipmi", "1", "--state-dir", dir, "--disk-size", "64M")
	for _, want := range []string{"lab " + name + ": ready", "redfish", "ipmi", "nft table inet kiln-lab-" + name} {
		if !strings.Contains(up, want) {
			t.Errorf("kilnctl lab up printed:\n%s\nwant %q in it", up, want)
		}
	}
	status := run("lab", "status", "--state-dir", dir)
	if !strings.Contains(status, "h1 ") || !strings.Contains(status, "h2 ") || !strings.Contains(status, " "+name+"-h2 ") {
		t.Errorf("kilnctl lab status printed:\n%s\nwant hosts h1 and h2 and their resource names", status)
	}

	// lab hosts prints Host resources kilnctl apply accepts, named LAB-hI.
	hosts, err := exec.Command(kilnctl, "lab", "hosts", "--state-dir", dir).Output()
	require.NoError(t, err)
	docs, err := manifest.Load(bytes.NewReader(hosts), "-")
	require.NoError(t, err, "kilnctl apply would refuse kilnctl lab hosts:\n%s", hosts)
	require.Len(t, docs, 2)
	for i, d := range docs {
		h := d.Resource.GetHost()
		if want := fmt.Sprintf("%s-h%d", name, i+1); h.GetMetadata().GetName() != want || h.GetSpec().GetBmc().GetPassword() == "" {
			t.Errorf("kilnctl lab hosts: host %d = %v, want %s with its BMC password", i, h, want)
		}
	}

	rep, err := rack.Status(dir)
	require.NoError(t, err)
	h2 := rep.Hosts[1]
	host, port, _ := strings.Cut(h2.BMC.Address, ":")
	ipmi := exec.Command("ipmitool", "-I", "lanplus", "-C", "3", "-H", host, "-p", port, "-U", rep.Credentials["h2"].Username, "-E", "chassis", "power", "on")
	ipmi.Env = append(os.Environ(), "IPMITOOL_PASSWORD="+rep.Credentials["h2"].Password)
	out, err = ipmi.CombinedOutput()
	require.NoError(t, err, "ipmitool power on: %s", out)
	if !strings.Contains(string(out), "Up/On") {
		t.Errorf("ipmitool chassis power on = %q, want Up/On", out)
	}

	down := run("lab", "down", "--state-dir", dir)
	if !strings.Contains(down, "removed") {
		t.Errorf("kilnctl lab down printed %q", down)
	}
	if _, err := os.Stat(dir); err == nil {
		t.Errorf("state dir %s still there after lab down", dir)
	}
	if out, _ := exec.Command("nft", "list", "tables").Output(); strings.Contains(string(out), "kiln-lab-"+name) {
		t.Errorf("nft table kiln-lab-%s still there after lab down", name)
	}
	if out, _ := exec.Command("ip", "netns", "list").Output(); strings.Contains(string(out), "kiln-"+name+"-") {
		t.Errorf("namespaces of lab %s still there after lab down:\n%s", name, out)
	}
}
