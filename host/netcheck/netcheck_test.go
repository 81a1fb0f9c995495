package netcheck

import (
	"net"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kilnhq/kiln/host/netnstest"
	"github.com/kilnhq/kiln/internal/errdefs"
)

func TestOverlaps(t *testing.T) {
	addrs := []Network{
		{Prefix: "127.0.0.1/8", Device: "lo"},
		{Prefix: "192.168.1.10/24", Device: "eth0"},
		{Prefix: "10.96.5.5/32", Device: "kube-ipvs0"},
		{Prefix: "fd00::5/64", Device: "eth0"},
		{Prefix: "garbage", Device: "eth0"},
	}
	routes := []Network{
		{Prefix: "0.0.0.0/0", Device: "eth0"},
		{Prefix: "192.168.1.0/24", Device: "eth0"},
		{Prefix: "10.0.0.0/8", Device: "tun0"},
		{Prefix: "172.16.0.0/12", Device: "vpn0"},
	}
	tests := []struct {
		cidr string
		want []string
	}{
		{"10.244.0.0/16", []string{"route 10.0.0.0/8 dev tun0"}},
		{"10.96.0.0/12", []string{"address 10.96.5.5/32 dev kube-ipvs0", "route 10.0.0.0/8 dev tun0"}},
		{"192.168.0.0/16", []string{"address 192.168.1.10/24 dev eth0", "route 192.168.1.0/24 dev eth0"}},
		{"100.64.0.0/10", nil},
		{"127.0.0.0/8", nil},
		{"fd00::/48", []string{"address fd00::5/64 dev eth0"}},
		{"172.20.0.0/16", []string{"route 172.16.0.0/12 dev vpn0"}},
	}
	for _, tt := range tests {
		got, err := Overlaps(tt.cidr, addrs, routes)
		require.NoError(t, err)
		var gs []string
		for _, o := range got {
			gs = append(gs, o.String())
		}
		if !slices.Equal(gs, tt.want) {
			t.Errorf("Overlaps(%q) = %q, want %q", tt.cidr, gs, tt.want)
		}
	}
	if _, err := Overlaps("10.244.0.0", nil, nil); !errdefs.IsInvalidArgument(err) {
		t.Errorf("Overlaps(%q) error = %v, want InvalidArgument", "10.244.0.0", err)
	}
}

func TestCIDRsOverlap(t *testing.T) {
	tests := []struct {
		a, b string
		want bool
	}{
		{"10.244.0.0/16", "10.96.0.0/12", false},
		{"10.0.0.0/8", "10.96.0.0/12", true},
		{"10.96.0.1/12", "10.100.0.0/16", true},
		{"fd00::/8", "10.0.0.0/8", false},
	}
	for _, tt := range tests {
		got, err := CIDRsOverlap(tt.a, tt.b)
		require.NoError(t, err)
		if got != tt.want {
			t.Errorf("CIDRsOverlap(%q, %q) = %v, want %v", tt.a, tt.b, got, tt.want)
		}
	}
}

func TestHostNetworksInNamespace(t *testing.T) {
	ns := netnstest.New(t)
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "kiln0"}}
	require.NoError(t, ns.Netlink.LinkAdd(br))
	link, err := ns.Netlink.LinkByName("kiln0")
	require.NoError(t, err)
	require.NoError(t, ns.Netlink.LinkSetUp(link))
	addr, _ := netlink.ParseAddr("192.0.2.10/24")
	require.NoError(t, ns.Netlink.AddrAdd(link, addr))
	_, dst, _ := net.ParseCIDR("10.244.0.0/16")
	require.NoError(t, ns.Netlink.RouteAdd(&netlink.Route{LinkIndex: link.Attrs().Index, Dst: dst}))

	var addrs, routes []Network
	ns.Do(t, func() { addrs, routes, err = HostNetworks() })
	require.NoError(t, err)
	got, err := Overlaps("10.244.0.0/16", addrs, routes)
	require.NoError(t, err)
	if len(got) != 1 || got[0].String() != "route 10.244.0.0/16 dev kiln0" {
		t.Errorf("Overlaps(10.244.0.0/16, namespace networks %v %v) = %v, want the route on kiln0", addrs, routes, got)
	}
}
