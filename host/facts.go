package host

import (
	"context"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Facts reports what the host under root is: OS, kernel, CPU, memory,
// disks, NICs with their addresses, main-table routes, identity, how it
// booted and the versions of its Kubernetes binaries.
//
// Network facts come from netlink in the calling thread's network
// namespace. Kubernetes binaries are run with a deadline of a few seconds
// each; one that fails or hangs is left out, not an error. Facts blocks
// while it reads; it returns an error when a required file (os-release,
// /proc/cpuinfo, /proc/meminfo) or netlink cannot be read, and a
// NotSupported error on systems other than Linux.
func Facts(ctx context.Context, root string) (*typesv1.Facts, error) {
	return FactsWith(ctx, FactsOptions{Root: root})
}
