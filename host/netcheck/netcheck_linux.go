//go:build linux

package netcheck

import (
	"fmt"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// HostNetworks returns the addresses of every link and the routes of the
// main table in the calling thread's network namespace.
//
// Equivalent to: `ip -o addr show; ip route show table main`.
func HostNetworks() (addrs, routes []Network, err error) {
	h, err := netlink.NewHandle()
	if err != nil {
		return nil, nil, fmt.Errorf("netlink: %w", err)
	}
	defer h.Close()
	links, err := h.LinkList()
	if err != nil {
		return nil, nil, fmt.Errorf("list links: %w", err)
	}
	names := map[int]string{}
	for _, l := range links {
		names[l.Attrs().Index] = l.Attrs().Name
		as, err := h.AddrList(l, netlink.FAMILY_ALL)
		if err != nil {
			return nil, nil, fmt.Errorf("addresses of %s: %w", l.Attrs().Name, err)
		}
		for _, a := range as {
			addrs = append(addrs, Network{Prefix: a.IPNet.String(), Device: l.Attrs().Name})
		}
	}
	rs, err := h.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return nil, nil, fmt.Errorf("list routes: %w", err)
	}
	for _, r := range rs {
		if r.Dst == nil {
			continue // default route
		}
		routes = append(routes, Network{Prefix: r.Dst.String(), Device: names[r.LinkIndex]})
	}
	return addrs, routes, nil
}
