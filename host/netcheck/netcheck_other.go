//go:build !linux

package netcheck

import "github.com/kilnhq/kiln/internal/errdefs"

// HostNetworks is only supported on Linux.
func HostNetworks() (addrs, routes []Network, err error) {
	return nil, nil, errdefs.NotSupported("host networks: only on Linux")
}
