// Package netcheck finds collisions between a cluster's pod or service
// CIDR and the networks a host already uses (its addresses and routes).
// A pod CIDR that overlaps a host route sends pod traffic the wrong way,
// and kubeadm does not check it.
package netcheck

import (
	"fmt"
	"net/netip"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Network is a host address ("10.0.0.5/24") or route destination
// ("10.244.0.0/16") and the device it is on.
type Network struct {
	Prefix string
	Device string
}

// Overlap is a host network that collides with a CIDR.
type Overlap struct {
	// Kind is "address" or "route".
	Kind    string
	Network Network
}

func (o Overlap) String() string {
	if o.Network.Device == "" {
		return fmt.Sprintf("%s %s", o.Kind, o.Network.Prefix)
	}
	return fmt.Sprintf("%s %s dev %s", o.Kind, o.Network.Prefix, o.Network.Device)
}

// Overlaps returns the addresses and routes that overlap cidr. An address
// overlaps when its subnet does (10.244.3.1/8 takes 10.0.0.0/8 for the
// host); loopback addresses and default routes are ignored, and networks
// of the other IP family never overlap. Entries that do not parse are
// skipped.
//
// It returns an InvalidArgument error when cidr is not a CIDR.
func Overlaps(cidr string, addrs, routes []Network) ([]Overlap, error) {
	want, err := netip.ParsePrefix(cidr)
	if err != nil {
		return nil, errdefs.InvalidArgument("CIDR %q: %v", cidr, err)
	}
	want = want.Masked()
	var out []Overlap
	for _, a := range addrs {
		p, err := parse(a.Prefix)
		if err != nil || p.Addr().IsLoopback() {
			continue
		}
		if p.Masked().Overlaps(want) {
			out = append(out, Overlap{Kind: "address", Network: a})
		}
	}
	for _, r := range routes {
		p, err := parse(r.Prefix)
		if err != nil || p.Bits() == 0 || p.Addr().IsLoopback() {
			continue
		}
		if p.Masked().Overlaps(want) {
			out = append(out, Overlap{Kind: "route", Network: r})
		}
	}
	return out, nil
}

// CIDRsOverlap reports whether two CIDRs share any address.
//
// It returns an InvalidArgument error when either is not a CIDR.
func CIDRsOverlap(a, b string) (bool, error) {
	pa, err := netip.ParsePrefix(a)
	if err != nil {
		return false, errdefs.InvalidArgument("CIDR %q: %v", a, err)
	}
	pb, err := netip.ParsePrefix(b)
	if err != nil {
		return false, errdefs.InvalidArgument("CIDR %q: %v", b, err)
	}
	return pa.Masked().Overlaps(pb.Masked()), nil
}

// parse accepts a prefix or a bare address (a host route).
func parse(s string) (netip.Prefix, error) {
	if p, err := netip.ParsePrefix(s); err == nil {
		return p, nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, err
	}
	return netip.PrefixFrom(a, a.BitLen()), nil
}
