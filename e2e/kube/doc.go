// Package kube proves Kiln's kubeadm path against the real thing: real
// kubeadm, kubelet, containerd and control-plane images (the pinned
// kube-tools cache) on lab nodes that boot a Debian root with systemd as
// PID 1 under systemd-nspawn, each in its own network namespace on a lab
// bridge, driven only through the kiln-agent gRPC API running inside each
// node. See docs/kubeadm.md.
//
// The tests need root, systemd-nspawn, debootstrap (or a cached root) and
// the kube-tools cache; they skip with the reason when one is missing.
package kube
