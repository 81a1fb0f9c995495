package controller

import (
	"net"
	"net/netip"
	"slices"
	"testing"

	"github.com/kilnhq/kiln/internal/testenv"
)

func TestOwnNetworks(t *testing.T) {
	ifAddrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	var want netip.Prefix
	var ip netip.Addr
	for _, ia := range ifAddrs {
		n, ok := ia.(*net.IPNet)
		if !ok || n.IP.To4() == nil || n.IP.IsLoopback() {
			continue
		}
		ip, _ = netip.AddrFromSlice(n.IP.To4())
		ones, _ := n.Mask.Size()
		want = netip.PrefixFrom(ip, ones).Masked()
		break
	}
	if !ip.IsValid() {
		testenv.Skip(t, "no non-loopback IPv4 address on this machine")
	}
	if got := ownNetworks(net.JoinHostPort(ip.String(), "7443"), "0.0.0.0:8080", "127.0.0.1:1", "not-an-address"); !slices.Contains(got, want) || len(got) != 1 {
		t.Errorf("ownNetworks(%s:7443, 0.0.0.0:8080, 127.0.0.1:1) = %v, want [%v]", ip, got, want)
	}
	if got := ownNetworks("0.0.0.0:7443", "[::]:8080"); len(got) != 0 {
		t.Errorf("ownNetworks(unspecified) = %v, want none", got)
	}
}
