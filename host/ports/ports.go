// Package ports checks that TCP ports are free to listen on, as the
// Kubernetes components need (6443 API server, 10250 kubelet, 10257
// controller manager, 10259 scheduler, 2379/2380 etcd).
package ports

import (
	"errors"
	"fmt"
	"net"
	"syscall"
)

// Control-plane and worker ports, as kubeadm's preflight checks them.
var (
	ControlPlane = []int{6443, 10250, 10257, 10259, 2379, 2380}
	Worker       = []int{10250}
)

// Component names the Kubernetes component that listens on each of
// ControlPlane's ports (agent/kubeadm stops a reset's leftovers by it).
var Component = map[int]string{
	6443:  "kube-apiserver",
	2379:  "etcd",
	2380:  "etcd",
	10250: "kubelet",
	10257: "kube-controller-manager",
	10259: "kube-scheduler",
}

// Busy returns the ports in ports that cannot be listened on because
// something already uses them, in the calling thread's network namespace.
// It opens and closes a listener on every address (IPv4 and IPv6) for
// each port.
//
// Equivalent to: `ss -Htln 'sport = :6443'`.
//
// It returns an error for any failure other than "address in use" (for
// example permission denied on a privileged port).
func Busy(ports []int) ([]int, error) {
	var busy []int
	for _, p := range ports {
		l, err := net.Listen("tcp", fmt.Sprintf(":%d", p))
		if errors.Is(err, syscall.EADDRINUSE) {
			busy = append(busy, p)
			continue
		}
		if err != nil {
			return busy, fmt.Errorf("listen on port %d: %w", p, err)
		}
		l.Close()
	}
	return busy, nil
}
