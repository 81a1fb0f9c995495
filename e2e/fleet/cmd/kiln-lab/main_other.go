//go:build !linux

// Command kiln-lab is `make lab`; the lab needs Linux (network namespaces,
// nftables, systemd-nspawn).
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "kiln-lab: the lab needs Linux (network namespaces, nftables, systemd-nspawn)")
	os.Exit(2)
}
