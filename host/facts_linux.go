//go:build linux

package host

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kilnhq/kiln/host/command"
	"github.com/kilnhq/kiln/internal/version"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// kubeVersionTimeout bounds each `kubeadm version`-style call.
const kubeVersionTimeout = 5 * time.Second

// FactsWith is Facts with options. See Facts.
func FactsWith(ctx context.Context, o FactsOptions) (*typesv1.Facts, error) {
	root := o.Root
	if root == "" {
		root = "/"
	}
	run := o.Runner
	if run == nil {
		run = command.Exec{}
	}
	f := &typesv1.Facts{AgentVersion: version.Version}

	osr, err := os.ReadFile(filepath.Join(root, "etc/os-release"))
	if err != nil {
		// os-release(5): /usr/lib/os-release is the fallback.
		if osr, err = os.ReadFile(filepath.Join(root, "usr/lib/os-release")); err != nil {
			return nil, fmt.Errorf("facts: os-release: %w", err)
		}
	}
	rel := ParseOSRelease(string(osr))
	f.OsId, f.OsVersion, f.OsPrettyName = rel.ID, rel.VersionID, rel.PrettyName

	var uts unix.Utsname
	if err := unix.Uname(&uts); err != nil {
		return nil, fmt.Errorf("facts: uname: %w", err)
	}
	f.Kernel = unix.ByteSliceToString(uts.Release[:])
	f.Architecture = unix.ByteSliceToString(uts.Machine[:])
	f.Hostname = unix.ByteSliceToString(uts.Nodename[:])

	cpu, err := os.ReadFile(filepath.Join(root, "proc/cpuinfo"))
	if err != nil {
		return nil, fmt.Errorf("facts: cpuinfo: %w", err)
	}
	f.CpuModel, f.CpuCount = ParseCPUInfo(string(cpu))

	mem, err := os.ReadFile(filepath.Join(root, "proc/meminfo"))
	if err != nil {
		return nil, fmt.Errorf("facts: meminfo: %w", err)
	}
	f.MemoryBytes = ParseMemTotal(string(mem))

	f.MachineId = readTrim(filepath.Join(root, "etc/machine-id"))

	cmdline, err := readOptional(filepath.Join(root, "proc/cmdline"))
	if err != nil {
		return nil, fmt.Errorf("facts: kernel command line: %w", err)
	}
	f.BootSource, f.AgentMode = BootSource(cmdline)

	if f.Disks, err = Disks(filepath.Join(root, "sys/block"), o.VirtualDisks); err != nil && !os.IsNotExist(err) {
		return nil, fmt.Errorf("facts: block devices: %w", err)
	}
	DiskLinks(filepath.Join(root, "dev/disk"), f.Disks)

	if f.Nics, f.Routes, err = network(); err != nil {
		return nil, fmt.Errorf("facts: %w", err)
	}

	f.KubeVersions = kubeVersions(ctx, root, run)
	return f, nil
}

// network lists the NICs (loopback left out) with their addresses, and the
// routes of the main table, in the calling thread's network namespace.
func network() ([]*typesv1.NIC, []*typesv1.Route, error) {
	// Only NETLINK_ROUTE: netlink.NewHandle() with no family also opens
	// XFRM and NETFILTER sockets, which fail ("protocol not supported") on
	// kernels where xfrm_user or nfnetlink are modules not loaded yet, as on
	// the boot media's stock Debian kernel.
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, nil, fmt.Errorf("netlink: %w", err)
	}
	defer h.Close()
	links, err := h.LinkList()
	if err != nil {
		return nil, nil, fmt.Errorf("list links: %w", err)
	}
	names := make(map[int]string, len(links))
	var nics []*typesv1.NIC
	for _, l := range links {
		a := l.Attrs()
		names[a.Index] = a.Name
		if a.Flags&net.FlagLoopback != 0 {
			continue
		}
		nic := &typesv1.NIC{
			Name:   a.Name,
			Mac:    a.HardwareAddr.String(),
			Mtu:    uint32(a.MTU),
			Up:     a.Flags&net.FlagUp != 0,
			Driver: linkDriver(l),
		}
		addrs, err := h.AddrList(l, netlink.FAMILY_ALL)
		if err != nil {
			return nil, nil, fmt.Errorf("addresses of %s: %w", a.Name, err)
		}
		for _, ad := range addrs {
			nic.Addresses = append(nic.Addresses, ad.IPNet.String())
		}
		nics = append(nics, nic)
	}
	rs, err := h.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return nil, nil, fmt.Errorf("list routes: %w", err)
	}
	var routes []*typesv1.Route
	for _, r := range rs {
		rt := &typesv1.Route{Device: names[r.LinkIndex], Destination: routeDst(r)}
		if r.Gw != nil {
			rt.Gateway = r.Gw.String()
		}
		routes = append(routes, rt)
	}
	return nics, routes, nil
}

// routeDst names a route's destination; the default route is "default".
func routeDst(r netlink.Route) string {
	if r.Dst == nil {
		return "default"
	}
	if ones, _ := r.Dst.Mask.Size(); ones == 0 && r.Dst.IP.IsUnspecified() {
		return "default"
	}
	return r.Dst.String()
}

// linkDriver is the kernel driver of a physical NIC from sysfs, or the
// link type of a virtual one (veth, bridge, dummy...).
func linkDriver(l netlink.Link) string {
	if t := l.Type(); t != "device" {
		return t
	}
	if p, err := os.Readlink(filepath.Join("/sys/class/net", l.Attrs().Name, "device/driver")); err == nil {
		return filepath.Base(p)
	}
	return ""
}

// kubeVersions runs each Kubernetes binary found under root for its
// version, each under its own deadline. Failures are left out.
func kubeVersions(ctx context.Context, root string, run Runner) map[string]string {
	vs := map[string]string{}
	for _, name := range kubeBinaries {
		p := FindKubeBinary(root, name)
		if p == "" {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, kubeVersionTimeout)
		out, err := run.Run(cctx, p, kubeVersionArgs(name)...)
		cancel()
		if v := KubeVersion(string(out)); err == nil && v != "" {
			vs[name] = strings.TrimSpace(v)
		}
	}
	if len(vs) == 0 {
		return nil
	}
	return vs
}
