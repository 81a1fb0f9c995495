package controller

import (
	"net"
	"net/netip"
)

// ownNetworks returns the subnets of this machine's interfaces that hold
// the IP addresses of addrs (host:port; unspecified and loopback
// addresses are skipped): the networks hosts reach the controller on,
// which a Cluster's pod and service CIDRs must not shadow.
func ownNetworks(addrs ...string) []netip.Prefix {
	var ips []netip.Addr
	for _, a := range addrs {
		host, _, err := net.SplitHostPort(a)
		if err != nil {
			continue
		}
		ip, err := netip.ParseAddr(host)
		if err != nil || ip.IsUnspecified() || ip.IsLoopback() {
			continue
		}
		ips = append(ips, ip.Unmap())
	}
	if len(ips) == 0 {
		return nil
	}
	ifAddrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil
	}
	var out []netip.Prefix
	for _, ia := range ifAddrs {
		n, ok := ia.(*net.IPNet)
		if !ok {
			continue
		}
		ip, ok := netip.AddrFromSlice(n.IP)
		if !ok {
			continue
		}
		ones, _ := n.Mask.Size()
		p := netip.PrefixFrom(ip.Unmap(), ones).Masked()
		for _, want := range ips {
			if p.Contains(want) {
				out = append(out, p)
				break
			}
		}
	}
	return out
}
