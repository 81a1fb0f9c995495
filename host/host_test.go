package host

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kilnhq/kiln/host/netnstest"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestParseOSRelease(t *testing.T) {
	in := "PRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\nNAME=\"Debian GNU/Linux\"\nVERSION_ID=\"12\"\nID=debian\n# comment\n"
	got := ParseOSRelease(in)
	want := OSRelease{ID: "debian", VersionID: "12", PrettyName: "Debian GNU/Linux 12 (bookworm)"}
	if got != want {
		t.Errorf("ParseOSRelease(%q) = %+v, want %+v", in, got, want)
	}
}

func TestParseCPUInfo(t *testing.T) {
	in := "processor\t: 0\nmodel name\t: AMD EPYC 7B13\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 7B13\n"
	model, n := ParseCPUInfo(in)
	if model != "AMD EPYC 7B13" || n != 2 {
		t.Errorf("ParseCPUInfo(%q) = %q, %d, want %q, 2", in, model, n, "AMD EPYC 7B13")
	}
}

func TestParseMemTotal(t *testing.T) {
	tests := []struct {
		in   string
		want uint64
	}{
		{"MemTotal:       24563084 kB\nMemFree: 1 kB\n", 24563084 * 1024},
		{"MemFree: 1 kB\n", 0},
		{"MemTotal: x kB\n", 0},
	}
	for _, tt := range tests {
		if got := ParseMemTotal(tt.in); got != tt.want {
			t.Errorf("ParseMemTotal(%q) = %d, want %d", tt.in, got, tt.want)
		}
	}
}

func TestBootSource(t *testing.T) {
	tests := []struct {
		cmdline, source, mode string
	}{
		{"BOOT_IMAGE=/vmlinuz root=/dev/vda1 ro quiet", BootDisk, ModeInstalled},
		{"console=ttyS0 kiln.boot=pxe kiln.controller=https://10.0.0.1:9443", BootPXE, ModeBoot},
		{"kiln.boot=virtualmedia", BootVirtualMedia, ModeBoot},
		{"kiln.boot=disk", BootDisk, ModeInstalled},
		{"", BootDisk, ModeInstalled},
	}
	for _, tt := range tests {
		s, m := BootSource(tt.cmdline)
		if s != tt.source || m != tt.mode {
			t.Errorf("BootSource(%q) = %q, %q, want %q, %q", tt.cmdline, s, m, tt.source, tt.mode)
		}
	}
}

func TestKubeVersion(t *testing.T) {
	tests := []struct{ in, want string }{
		{"v1.34.4\n", "v1.34.4"},
		{"Kubernetes v1.34.4\n", "v1.34.4"},
		{"Client Version: v1.34.4\nKustomize Version: v5.7.1\n", "v1.34.4"},
		{"v0.0.0-master+$Format:%H$\n", "v0.0.0-master+$Format"},
		{"command not found", ""},
	}
	for _, tt := range tests {
		if got := KubeVersion(tt.in); got != tt.want {
			t.Errorf("KubeVersion(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func writeFile(t *testing.T, path, content string, mode os.FileMode) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	require.NoError(t, os.WriteFile(path, []byte(content), mode))
}

func TestDisks(t *testing.T) {
	sys := t.TempDir()
	writeFile(t, filepath.Join(sys, "sda/size"), "209715200\n", 0o644)
	writeFile(t, filepath.Join(sys, "sda/queue/rotational"), "1\n", 0o644)
	writeFile(t, filepath.Join(sys, "sda/removable"), "0\n", 0o644)
	writeFile(t, filepath.Join(sys, "sda/device/model"), "ST1000DM003  \n", 0o644)
	writeFile(t, filepath.Join(sys, "sda/device/serial"), "Z1D5K2\n", 0o644)
	writeFile(t, filepath.Join(sys, "sda/device/wwid"), "naa.5000C500A0B1C2D3\n", 0o644)
	writeFile(t, filepath.Join(sys, "nvme0n1/size"), "2048\n", 0o644)
	writeFile(t, filepath.Join(sys, "nvme0n1/queue/rotational"), "0\n", 0o644)
	writeFile(t, filepath.Join(sys, "loop0/size"), "8\n", 0o644)

	disks, err := Disks(sys, false)
	require.NoError(t, err)
	want := []*typesv1.Disk{
		{Name: "nvme0n1", Path: "/dev/nvme0n1", SizeBytes: 2048 * 512},
		{Name: "sda", Path: "/dev/sda", SizeBytes: 209715200 * 512, Rotational: true, Model: "ST1000DM003", Serial: "Z1D5K2", Wwn: "0x5000c500a0b1c2d3"},
	}
	require.Len(t, disks, len(want), "Disks(%q) = %v", sys, disks)
	for i := range want {
		if disks[i].String() != want[i].String() {
			t.Errorf("Disks(%q)[%d] = %v, want %v", sys, i, disks[i], want[i])
		}
	}
	all, err := Disks(sys, true)
	require.NoError(t, err)
	if len(all) != 3 {
		t.Errorf("Disks(%q, virtual) = %d disks, want 3 (with loop0)", sys, len(all))
	}
}

func TestDiskLinks(t *testing.T) {
	dev := t.TempDir()
	for link, dest := range map[string]string{
		"by-path/pci-0000:00:17.0-ata-1":       "../../sda",
		"by-path/pci-0000:00:17.0-ata-1-part1": "../../sda1",
		"by-path/pci-0000:3b:00.0-nvme-1":      "../../nvme0n1",
		"by-id/wwn-0x5002538e40a1b2c3":         "../../sda",
		"by-id/ata-SAMSUNG_MZ7LH480_S45PNA0M":  "/dev/sda",
		"by-id/ata-SAMSUNG_MZ7LH480_S45PN-p1":  "../../sda1",
	} {
		require.NoError(t, os.MkdirAll(filepath.Dir(filepath.Join(dev, link)), 0o755))
		require.NoError(t, os.Symlink(dest, filepath.Join(dev, link)))
	}
	disks := []*typesv1.Disk{{Name: "nvme0n1", Path: "/dev/nvme0n1"}, {Name: "sda", Path: "/dev/sda"}, {Name: "sdb", Path: "/dev/sdb"}}
	DiskLinks(dev, disks)
	want := []*typesv1.Disk{
		{Name: "nvme0n1", Path: "/dev/nvme0n1", ByPath: []string{"/dev/disk/by-path/pci-0000:3b:00.0-nvme-1"}},
		{Name: "sda", Path: "/dev/sda", Wwn: "0x5002538e40a1b2c3", ByPath: []string{"/dev/disk/by-path/pci-0000:00:17.0-ata-1"},
			ById: []string{"/dev/disk/by-id/ata-SAMSUNG_MZ7LH480_S45PNA0M", "/dev/disk/by-id/wwn-0x5002538e40a1b2c3"}},
		{Name: "sdb", Path: "/dev/sdb"},
	}
	for i := range want {
		if disks[i].String() != want[i].String() {
			t.Errorf("DiskLinks(%q)[%d] = %v, want %v", dev, i, disks[i], want[i])
		}
	}
	DiskLinks(filepath.Join(dev, "missing"), disks) // no udev: nothing changes, no panic
}

// fakeRoot builds a host root with the files Facts reads, and kubeadm and
// kubelet scripts that print the given version.
func fakeRoot(t *testing.T, kubeVersion string) string {
	root := t.TempDir()
	writeFile(t, filepath.Join(root, "etc/os-release"), "ID=debian\nVERSION_ID=\"12\"\nPRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\n", 0o644)
	writeFile(t, filepath.Join(root, "etc/machine-id"), "0123456789abcdef0123456789abcdef\n", 0o444)
	writeFile(t, filepath.Join(root, "proc/cpuinfo"), "processor\t: 0\nmodel name\t: Test CPU\nprocessor\t: 1\nmodel name\t: Test CPU\n", 0o444)
	writeFile(t, filepath.Join(root, "proc/meminfo"), "MemTotal: 1024 kB\n", 0o444)
	writeFile(t, filepath.Join(root, "proc/cmdline"), "root=/dev/vda1 kiln.boot=pxe\n", 0o444)
	writeFile(t, filepath.Join(root, "sys/block/vda/size"), "100\n", 0o444)
	if kubeVersion != "" {
		writeFile(t, filepath.Join(root, "usr/bin/kubeadm"), "#!/bin/sh\necho "+kubeVersion+"\n", 0o755)
		writeFile(t, filepath.Join(root, "usr/bin/kubelet"), "#!/bin/sh\necho Kubernetes "+kubeVersion+"\n", 0o755)
		// A kubectl that fails is left out, not an error.
		writeFile(t, filepath.Join(root, "usr/local/bin/kubectl"), "#!/bin/sh\nexit 1\n", 0o755)
	}
	return root
}

func TestFactsFromRoot(t *testing.T) {
	root := fakeRoot(t, "v1.34.4")
	f, err := Facts(context.Background(), root)
	require.NoError(t, err)
	checks := []struct {
		field string
		got   any
		want  any
	}{
		{"OsId", f.OsId, "debian"},
		{"OsVersion", f.OsVersion, "12"},
		{"MachineId", f.MachineId, "0123456789abcdef0123456789abcdef"},
		{"CpuModel", f.CpuModel, "Test CPU"},
		{"CpuCount", f.CpuCount, uint32(2)},
		{"MemoryBytes", f.MemoryBytes, uint64(1024 * 1024)},
		{"BootSource", f.BootSource, BootPXE},
		{"AgentMode", f.AgentMode, ModeBoot},
		{"len(Disks)", len(f.Disks), 1},
		{"KubeVersions[kubeadm]", f.KubeVersions["kubeadm"], "v1.34.4"},
		{"KubeVersions[kubelet]", f.KubeVersions["kubelet"], "v1.34.4"},
		{"KubeVersions[kubectl]", f.KubeVersions["kubectl"], ""},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("Facts(%q).%s = %v, want %v", root, c.field, c.got, c.want)
		}
	}
	if f.Kernel == "" || f.Hostname == "" {
		t.Errorf("Facts(%q) kernel %q hostname %q, want both set", root, f.Kernel, f.Hostname)
	}
}

func TestFactsMissingOSRelease(t *testing.T) {
	root := t.TempDir()
	if _, err := Facts(context.Background(), root); err == nil {
		t.Errorf("Facts(%q) error = nil, want an error naming os-release", root)
	}
}

// TestFactsNetwork makes a namespace with a veth pair, an address and a
// route via a gateway, and checks that Facts reports the NIC, its address
// and both routes.
func TestFactsNetwork(t *testing.T) {
	ns := netnstest.New(t)
	mac, _ := net.ParseMAC("02:00:00:00:4b:01")
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "kiln0", HardwareAddr: mac, MTU: 1400}, PeerName: "kiln1"}
	require.NoError(t, ns.Netlink.LinkAdd(veth))
	link, err := ns.Netlink.LinkByName("kiln0")
	require.NoError(t, err)
	peer, err := ns.Netlink.LinkByName("kiln1")
	require.NoError(t, err)
	addr, err := netlink.ParseAddr("192.0.2.10/24")
	require.NoError(t, err)
	require.NoError(t, ns.Netlink.AddrAdd(link, addr))
	require.NoError(t, ns.Netlink.LinkSetUp(peer))
	require.NoError(t, ns.Netlink.LinkSetUp(link))
	_, gwNet, _ := net.ParseCIDR("198.51.100.0/24")
	require.NoError(t, ns.Netlink.RouteAdd(&netlink.Route{LinkIndex: link.Attrs().Index, Dst: gwNet, Gw: net.ParseIP("192.0.2.1")}))

	var f *typesv1.Facts
	ns.Do(t, func() {
		f, err = Facts(context.Background(), "/")
	})
	require.NoError(t, err)

	i := slices.IndexFunc(f.Nics, func(n *typesv1.NIC) bool { return n.Name == "kiln0" })
	require.GreaterOrEqual(t, i, 0, "Facts().Nics = %v, want kiln0", f.Nics)
	nic := f.Nics[i]
	if nic.Mac != "02:00:00:00:4b:01" || nic.Mtu != 1400 || !nic.Up || nic.Driver != "veth" {
		t.Errorf("Facts() NIC = %v, want mac 02:00:00:00:4b:01 mtu 1400 up driver veth", nic)
	}
	if !slices.Contains(nic.Addresses, "192.0.2.10/24") {
		t.Errorf("Facts() NIC addresses = %v, want 192.0.2.10/24", nic.Addresses)
	}
	if slices.ContainsFunc(f.Nics, func(n *typesv1.NIC) bool { return n.Name == "lo" }) {
		t.Errorf("Facts().Nics = %v, want loopback left out", f.Nics)
	}
	hasRoute := func(dst, gw string) bool {
		return slices.ContainsFunc(f.Routes, func(r *typesv1.Route) bool {
			return r.Destination == dst && r.Gateway == gw && r.Device == "kiln0"
		})
	}
	if !hasRoute("192.0.2.0/24", "") {
		t.Errorf("Facts().Routes = %v, want 192.0.2.0/24 dev kiln0", f.Routes)
	}
	if !hasRoute("198.51.100.0/24", "192.0.2.1") {
		t.Errorf("Facts().Routes = %v, want 198.51.100.0/24 via 192.0.2.1 dev kiln0", f.Routes)
	}
}

// BenchmarkFacts measures one Facts call on this machine, including
// running whichever of kubeadm, kubelet and kubectl are installed for
// their versions (that dominates when any is).
func BenchmarkFacts(b *testing.B) {
	ctx := context.Background()
	for b.Loop() {
		if _, err := Facts(ctx, "/"); err != nil {
			b.Fatal(err)
		}
	}
}
