package cli

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/bmc"
	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/e2e/lab/rack"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/testenv"
)

// TestLabCommands runs the real kilnctl binary: lab up (its supervisor is
// `kilnctl lab serve`, its IPMI chassis program `kilnctl lab chassis`),
// status, an IPMI power-on through ipmi_sim, and lab down.
func TestLabCommands(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds kilnctl and brings up a lab")
	}
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root for the lab's namespaces, bridge and nftables")
	}
	for tool, pkg := range map[string]string{"go": "golang", "nft": "nftables", "ipmi_sim": "openipmi", "ipmitool": "ipmitool"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (%s)", tool, pkg)
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

	// h1's Redfish emulator has no SessionService and takes basic auth
	// only, like several BMCs in the field.
	up := run("lab", "up", "--name", name, "--hosts", "1", "--redfish-auth", "basic", "--ipmi", "1", "--state-dir", dir, "--disk-size", "64M")
	for _, want := range []string{"lab " + name + ": ready", "redfish", "ipmi", "nft table inet kiln-lab-" + name} {
		if !strings.Contains(up, want) {
			t.Errorf("kilnctl lab up printed:\n%s\nwant %q in it", up, want)
		}
	}
	status := run("lab", "status", "--state-dir", dir)
	if !strings.Contains(status, "h1 ") || !strings.Contains(status, "h2 ") || !strings.Contains(status, " "+name+"-h2 ") ||
		!strings.Contains(status, "redfish (basic auth only)") {
		t.Errorf("kilnctl lab status printed:\n%s\nwant hosts h1 and h2 and their resource names", status)
	}

	// lab hosts prints Host resources kilnctl apply accepts, named LAB-hI.
	hosts, err := exec.Command(kilnctl, "lab", "hosts", "--state-dir", dir).Output()
	require.NoError(t, err)
	docs, err := validation.LoadManifests(bytes.NewReader(hosts), "-")
	require.NoError(t, err, "kilnctl apply would refuse kilnctl lab hosts:\n%s", hosts)
	require.Len(t, docs, 2)
	for i, d := range docs {
		h := d.Resource.GetHost()
		if want := fmt.Sprintf("%s-h%d", name, i+1); h.GetMetadata().GetName() != want || h.GetSpec().GetBmc().GetPassword() == "" {
			t.Errorf("kilnctl lab hosts: host %d = %v, want %s with its BMC password", i, h, want)
		}
	}

	// The Host kilnctl lab hosts prints for h1 (spec.bmc.auth unset: auto)
	// registers as the controller would dial it: auto finds no
	// SessionService and uses basic auth.
	spec := docs[0].Resource.GetHost().GetSpec().GetBmc()
	b, err := bmc.Dial(context.Background(), bmc.EndpointFromSpec(spec), bmc.Options{Name: docs[0].Resource.GetHost().GetMetadata().GetName()})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	inv, err := b.Inventory(ctx)
	require.NoError(t, err, "inventory of the basic-auth-only lab host")
	if state, err := b.PowerState(ctx); err != nil || state != bmc.PowerOff {
		t.Errorf("PowerState() of the basic-auth-only lab host = %q, %v; want off", state, err)
	}
	c := b.Condition()
	t.Logf("%s: %s %s", spec.GetAddress(), c.GetStatus(), c.GetMessage())
	if c.GetStatus() != conditions.True || !strings.Contains(c.GetMessage(), "redfish basic auth (the service root links no SessionService)") || len(inv.MACs) != 1 {
		t.Errorf("basic-auth-only lab host: condition %s %q, inventory %+v; want True naming basic auth, one MAC", c.GetStatus(), c.GetMessage(), inv)
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

	// The same commands with --backend libvirt: one domain behind a
	// Redfish emulator, at the system libvirtd or a private one.
	t.Run("backend libvirt", func(t *testing.T) {
		for tool, pkg := range map[string]string{"libvirtd": "libvirt-daemon-system", "qemu-system-x86_64": "qemu-system-x86", "unshare": "util-linux"} {
			if _, err := exec.LookPath(tool); err != nil {
				testenv.Skipf(t, "%s not installed (%s)", tool, pkg)
			}
		}
		// Short: a private libvirtd's socket goes in it (108 bytes).
		base, err := os.MkdirTemp("", "kiln-lvcli-")
		require.NoError(t, err)
		t.Cleanup(func() { os.RemoveAll(base) })
		dir := filepath.Join(base, "lab")
		t.Cleanup(func() { _ = exec.Command(kilnctl, "lab", "down", "--state-dir", dir).Run() })
		up := run("lab", "up", "--backend", "libvirt", "--name", name, "--hosts", "1", "--state-dir", dir, "--disk-size", "64M")
		status := run("lab", "status", "--state-dir", dir)
		for _, want := range []string{"lab " + name + ": ready", "libvirt: ", " " + name + "-h1 ", "10.0.2.15"} {
			if !strings.Contains(up, want) || !strings.Contains(status, want) {
				t.Errorf("kilnctl lab up --backend libvirt printed:\n%s\nand lab status:\n%s\nwant %q in both", up, status, want)
			}
		}
		rep, err := rack.Status(dir)
		require.NoError(t, err)
		require.Equal(t, rack.BackendLibvirt, rep.Backend)
		var pids []string
		for _, r := range rep.Resources {
			if r.Kind == "pid" {
				pids = append(pids, r.Value)
			}
		}
		if down := run("lab", "down", "--state-dir", dir); !strings.Contains(down, "removed") {
			t.Errorf("kilnctl lab down printed %q", down)
		}
		if _, err := os.Stat(dir); err == nil {
			t.Errorf("state dir %s still there after lab down", dir)
		}
		if _, err := os.Stat("/etc/libvirt/qemu/kiln-" + name + "-h1.xml"); rep.LibvirtPrivate && err == nil {
			t.Errorf("domain kiln-%s-h1 still defined after lab down", name)
		}
		for _, p := range append(pids, rep.Serve) {
			var pid int
			fmt.Sscanf(p, "%d:", &pid)
			if pid > 0 && syscall.Kill(pid, 0) == nil {
				if b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); len(b) > 0 && !strings.Contains(string(b), ") Z ") {
					t.Errorf("process %s of the libvirt lab still runs after lab down", p)
				}
			}
		}
	})
}
