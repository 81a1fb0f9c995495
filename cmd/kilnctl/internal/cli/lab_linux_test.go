package cli

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/bmc"
	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/e2e/lab/netns"
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
	// Redfish emulator, at the system libvirtd or a private one, its NIC
	// on the lab bridge with its address from the lab's dnsmasq.
	t.Run("backend libvirt", func(t *testing.T) {
		skipWithoutLibvirt(t)
		// Short: a private libvirtd's socket goes in it (108 bytes).
		base, err := os.MkdirTemp("", "kiln-lvcli-")
		require.NoError(t, err)
		t.Cleanup(func() { os.RemoveAll(base) })
		dir := filepath.Join(base, "lab")
		t.Cleanup(func() { _ = exec.Command(kilnctl, "lab", "down", "--state-dir", dir).Run() })
		t0 := time.Now()
		up := run("lab", "up", "--backend", "libvirt", "--name", name, "--hosts", "1", "--state-dir", dir, "--disk-size", "64M")
		t.Logf("lab up --backend libvirt: %s", time.Since(t0).Round(time.Millisecond))
		status := run("lab", "status", "--state-dir", dir)
		rep, err := rack.Status(dir)
		require.NoError(t, err)
		require.Equal(t, rack.BackendLibvirt, rep.Backend)
		require.Len(t, rep.Hosts, 1)
		h := rep.Hosts[0]
		for _, want := range []string{"lab " + name + ": ready", "libvirt: ", " " + name + "-h1 ", " " + h.Address + " ",
			"bridge kbr-" + name + ",", "dhcp: dnsmasq (pid ", ", running) on kbr-" + name} {
			if !strings.Contains(up, want) || !strings.Contains(status, want) {
				t.Errorf("kilnctl lab up --backend libvirt printed:\n%s\nand lab status:\n%s\nwant %q in both", up, status, want)
			}
		}
		if !strings.HasPrefix(h.Address, strings.TrimSuffix(rep.Gateway, "1")) || h.Address == rep.Gateway {
			t.Errorf("host address %s, want one on the lab subnet %s", h.Address, rep.Subnet)
		}

		// The domain is defined on the lab bridge...
		virsh := func(args ...string) (string, error) {
			out, err := exec.Command("virsh", append([]string{"-c", "qemu:///system?socket=" + rep.LibvirtSocket}, args...)...).CombinedOutput()
			return string(out), err
		}
		dom := "kiln-" + name + "-h1"
		xml, err := virsh("dumpxml", dom)
		require.NoError(t, err, "virsh dumpxml %s: %s", dom, xml)
		if !strings.Contains(xml, "<interface type='bridge'>") || !strings.Contains(xml, "<source bridge='kbr-"+name+"'/>") {
			t.Errorf("domain %s is not on bridge kbr-%s:\n%s", dom, name, xml)
		}
		// ...and once powered on by PXE through its BMC, its NIC is a port
		// of the bridge and its firmware's DHCP gets the host's address
		// from the lab's dnsmasq.
		hosts, err := exec.Command(kilnctl, "lab", "hosts", "--state-dir", dir).Output()
		require.NoError(t, err)
		docs, err := validation.LoadManifests(bytes.NewReader(hosts), "-")
		require.NoError(t, err)
		spec := docs[0].Resource.GetHost().GetSpec().GetBmc()
		b, err := bmc.Dial(context.Background(), bmc.EndpointFromSpec(spec), bmc.Options{Name: h.Resource})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		require.NoError(t, b.SetBootDevice(ctx, bmc.BootPXE, false, false))
		t1 := time.Now()
		require.NoError(t, b.PowerOn(ctx))
		port := ""
		leases := filepath.Join(dir, "dnsmasq", "leases")
		require.Eventually(t, func() bool {
			if port == "" {
				port = bridgePortWithMAC("kbr-"+name, "fe"+h.MAC[2:])
			}
			l, _ := os.ReadFile(leases)
			return port != "" && strings.Contains(string(l), h.MAC+" "+h.Address+" ")
		}, 2*time.Minute, 200*time.Millisecond, "the domain's NIC (MAC %s) in bridge kbr-%s (port %q) and a lease of %s in %s", h.MAC, name, port, h.Address, leases)
		t.Logf("domain on the bridge as %s, DHCP lease %s after %s", port, h.Address, time.Since(t1).Round(time.Millisecond))

		var pids []string
		for _, r := range rep.Resources {
			if r.Kind == "pid" {
				pids = append(pids, r.Value)
			}
		}
		require.Contains(t, pids, rep.DHCP, "dnsmasq recorded as a process of the lab")
		t2 := time.Now()
		if down := run("lab", "down", "--state-dir", dir); !strings.Contains(down, "removed") {
			t.Errorf("kilnctl lab down printed %q", down)
		}
		t.Logf("lab down: %s", time.Since(t2).Round(time.Millisecond))
		requireLabGone(t, rep, dir, append(pids, rep.Serve))
	})

	// kill -9 of lab up and its supervisor in the middle of lab up (once
	// the bridge exists; once the domain is recorded): lab down removes
	// whatever was created from the state file.
	for _, point := range []string{"bridge", "domain"} {
		t.Run("backend libvirt killed at "+point, func(t *testing.T) {
			skipWithoutLibvirt(t)
			base, err := os.MkdirTemp("", "kiln-lvcrash-")
			require.NoError(t, err)
			t.Cleanup(func() { os.RemoveAll(base) })
			dir := filepath.Join(base, "lab")
			t.Cleanup(func() { _ = exec.Command(kilnctl, "lab", "down", "--state-dir", dir).Run() })
			up := exec.Command(kilnctl, "lab", "up", "--backend", "libvirt", "--name", name, "--hosts", "1", "--state-dir", dir, "--disk-size", "64M")
			require.NoError(t, up.Start())
			waited := make(chan struct{})
			go func() { _ = up.Wait(); close(waited) }()
			reached := func() bool {
				switch point {
				case "bridge":
					_, err := os.Stat("/sys/class/net/kbr-" + name)
					return err == nil
				default:
					st, err := rack.ReadState(dir)
					return err == nil && slices.ContainsFunc(st.Resources, func(r netns.Resource) bool { return r.Kind == rack.KindDomain })
				}
			}
			require.Eventually(t, reached, 10*time.Minute, 5*time.Millisecond, "lab up never got to the %s", point)
			// lab up first: it would tear the lab down itself when its
			// supervisor dies.
			require.NoError(t, up.Process.Kill())
			<-waited
			st, err := rack.ReadState(dir)
			require.NoError(t, err)
			var pid int
			fmt.Sscanf(st.Serve, "%d:", &pid)
			require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
			for netns.ProcessAlive(st.Serve) {
				time.Sleep(10 * time.Millisecond)
			}
			// What the supervisor recorded up to its death (it may have
			// started more, and recorded it, before the kill landed).
			st, err = rack.ReadState(dir)
			require.NoError(t, err)
			var pids []string
			for _, r := range st.Resources {
				if r.Kind == netns.KindPID {
					pids = append(pids, r.Value)
				}
			}
			t.Logf("killed at the %s; recorded: %v", point, st.Resources)
			t0 := time.Now()
			if down := run("lab", "down", "--state-dir", dir); !strings.Contains(down, "removed") {
				t.Errorf("kilnctl lab down printed %q", down)
			}
			t.Logf("lab down: %s", time.Since(t0).Round(time.Millisecond))
			requireLabGone(t, &rack.Report{State: st}, dir, append(pids, st.Serve))
			if out, err := exec.Command(kilnctl, "lab", "down", "--state-dir", dir).CombinedOutput(); err == nil || !strings.Contains(string(out), "no lab") {
				t.Errorf("a second kilnctl lab down = %v, %s; want no lab", err, out)
			}
		})
	}
}

func skipWithoutLibvirt(t *testing.T) {
	t.Helper()
	for tool, pkg := range map[string]string{"libvirtd": "libvirt-daemon-system", "qemu-system-x86_64": "qemu-system-x86", "unshare": "util-linux",
		"virsh": "libvirt-clients", "dnsmasq": "dnsmasq-base"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (%s)", tool, pkg)
		}
	}
}

// bridgePortWithMAC is the port of bridge whose address is mac, or "".
func bridgePortWithMAC(bridge, mac string) string {
	ports, _ := os.ReadDir(filepath.Join("/sys/class/net", bridge, "brif"))
	for _, p := range ports {
		if b, _ := os.ReadFile(filepath.Join("/sys/class/net", p.Name(), "address")); strings.TrimSpace(string(b)) == mac {
			return p.Name()
		}
	}
	return ""
}

// requireLabGone checks that lab down left nothing of the libvirt lab
// rep: no state directory, bridge, nft table, process (pids: dnsmasq,
// QEMU, a private libvirtd, the supervisor) or domain.
func requireLabGone(t *testing.T, rep *rack.Report, dir string, pids []string) {
	t.Helper()
	if _, err := os.Stat(dir); err == nil {
		t.Errorf("state dir %s still there after lab down", dir)
	}
	if _, err := os.Stat("/sys/class/net/kbr-" + rep.Name); err == nil {
		t.Errorf("bridge kbr-%s still there after lab down", rep.Name)
	}
	if out, _ := exec.Command("nft", "list", "tables").Output(); strings.Contains(string(out), "kiln-lab-"+rep.Name+"\n") {
		t.Errorf("nft table kiln-lab-%s still there after lab down", rep.Name)
	}
	dom := "kiln-" + rep.Name + "-h1"
	if rep.LibvirtSocket != "" && !rep.LibvirtPrivate {
		if out, err := exec.Command("virsh", "-c", "qemu:///system?socket="+rep.LibvirtSocket, "dominfo", dom).CombinedOutput(); err == nil {
			t.Errorf("domain %s still defined after lab down:\n%s", dom, out)
		}
	}
	for _, p := range []string{"/etc/libvirt/qemu/" + dom + ".xml", "/run/libvirt/qemu/" + dom + ".pid"} {
		if _, err := os.Stat(p); rep.LibvirtPrivate && err == nil {
			t.Errorf("%s (domain %s) still there after lab down", p, dom)
		}
	}
	for _, p := range pids {
		if p != "" && netns.ProcessAlive(p) {
			t.Errorf("process %s of the libvirt lab still runs after lab down", p)
		}
	}
}
