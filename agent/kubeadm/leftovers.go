package kubeadm

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/kilnhq/kiln/host/ports"
	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// Leftover is a process still listening on one of the control plane's
// ports after `kubeadm reset`.
type Leftover struct {
	Port int
	PID  int
	// Comm is the process's name as the kernel keeps it
	// (/proc/PID/comm: at most 15 bytes, "kube-controller").
	Comm string
	// ByName is true when the process was not seen holding the socket
	// (its /proc/PID/fd cannot be read: the agent's unit drops
	// CAP_SYS_PTRACE) but is the component that listens on Port and runs
	// in this network namespace.
	ByName bool
}

func (l Leftover) String() string { return fmt.Sprintf("%s (pid %d)", l.Comm, l.PID) }

// ControlPlanePorts are the ports a reset leaves free, each with the
// component that listens on it: what kubeadm's preflight checks before
// init (and, for 10250, before join). It is ports.Component: one list.
var ControlPlanePorts = ports.Component

// components are the processes kubeadm's static pods and the kubelet run:
// the only ones the leftover check stops. Anything else on a control
// plane port (a load balancer, a stray test server) is named in the error
// and left running.
var components = []string{
	"kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd", "kubelet", "kube-proxy",
}

// isComponent reports whether comm is one of components.
func isComponent(comm string) bool {
	return slices.ContainsFunc(components, func(c string) bool { return isNamed(comm, c) })
}

// isNamed reports whether a process named comm runs name, allowing for
// the kernel's 15-byte truncation of process names.
func isNamed(comm, name string) bool {
	return comm == name || (len(comm) == 15 && strings.HasPrefix(name, comm))
}

// Default waits of the leftover check.
const (
	defaultStopGrace = 15 * time.Second // SIGTERM to SIGKILL
	killWait         = 5 * time.Second  // SIGKILL to giving up
)

// freePorts makes sure nothing listens on k.ports after `kubeadm reset`.
// Under TCG, reset stops the kubelet and then fails (or gives up) removing
// the static pods' containers, so the controller manager and scheduler
// keep their ports and every retried init is refused by kubeadm's
// preflight ("ports in use: 10257, 10259"). freePorts finds what listens
// on a busy port (/proc/net/tcp{,6} socket inode to /proc/PID/fd; where
// the fds cannot be read, the port's component by name among the
// processes of this network namespace), stops the Kubernetes components
// among them (SIGTERM, then SIGKILL after k.stopGrace), and checks again.
//
// It returns nil when the ports are free, and a FailedPrecondition error
// naming each port still in use and its process (name and PID) otherwise.
// Unless strict, only a Kubernetes component that could not be stopped is
// an error: a port held by anything else (not a component, or no process
// found) is reported as a progress event. A reset that precedes a wipe
// must not be held up by a process the wipe ends anyway; the undo of a
// failed init is strict, since the retry would be refused on that port.
// It blocks for up to k.stopGrace plus a few seconds.
//
// Equivalent to: `ss -Htlnp 'sport = :10257'; kill PID; sleep 15; kill -9 PID`.
func (k *Kubeadm) freePorts(ctx context.Context, emit Emit, strict bool) error {
	busy, err := ports.Busy(k.portList())
	if err != nil {
		return fmt.Errorf("check the control plane's ports: %w", err)
	}
	if len(busy) == 0 {
		return nil
	}
	found, err := listeners(k.proc, busy, k.ports)
	if err != nil {
		msg := fmt.Sprintf("ports still in use after kubeadm reset: %s (cannot tell by what: %v)", joinInts(busy), err)
		if !strict {
			emit(&agentv1.OperationEvent{Message: msg})
			return nil
		}
		return errdefs.FailedPrecondition("%s", msg)
	}
	var stop []int
	for _, l := range found {
		if !isComponent(l.Comm) || l.PID == os.Getpid() || l.PID <= 1 {
			continue
		}
		msg := fmt.Sprintf("port %d still in use after kubeadm reset by %s: stopping it", l.Port, l)
		if l.ByName {
			msg = fmt.Sprintf("port %d still in use after kubeadm reset, and %s still runs in this host's network: stopping it", l.Port, l)
		}
		emit(&agentv1.OperationEvent{Message: msg})
		k.log.Warn("leftover after kubeadm reset", "port", l.Port, "pid", l.PID, "comm", l.Comm, "by_name", l.ByName)
		if !slices.Contains(stop, l.PID) {
			stop = append(stop, l.PID)
		}
	}
	if len(stop) > 0 {
		if err := stopProcesses(ctx, k.proc, stop, k.stopGrace, emit); err != nil {
			return fmt.Errorf("stop what kubeadm reset left: %w", err)
		}
	}
	busy, err = ports.Busy(k.portList())
	if err != nil {
		return fmt.Errorf("check the control plane's ports: %w", err)
	}
	if len(busy) == 0 {
		emit(&agentv1.OperationEvent{Message: "the control plane's ports are free"})
		return nil
	}
	found, _ = listeners(k.proc, busy, k.ports)
	var (
		parts     []string
		survivors bool
	)
	for _, p := range busy {
		var by []string
		for _, l := range found {
			if l.Port != p {
				continue
			}
			switch {
			case slices.Contains(stop, l.PID):
				by = append(by, l.String()+", which survived SIGTERM and SIGKILL")
				survivors = true
			case isComponent(l.Comm):
				by = append(by, l.String())
				survivors = true
			default:
				by = append(by, l.String()+", not a Kubernetes component: left running")
			}
		}
		if len(by) == 0 {
			by = append(by, "no process of this host found holding it (nor a "+k.ports[p]+" in this network namespace)")
		}
		parts = append(parts, fmt.Sprintf("%d held by %s", p, strings.Join(by, " and ")))
	}
	msg := fmt.Sprintf("ports still in use after kubeadm reset (kubeadm init/join will refuse them): %s", strings.Join(parts, "; "))
	if !strict && !survivors {
		emit(&agentv1.OperationEvent{Message: msg})
		k.log.Warn("ports still in use after kubeadm reset", "ports", joinInts(busy))
		return nil
	}
	return errdefs.FailedPrecondition("%s", msg)
}

// stopProcesses sends SIGTERM to pids, waits up to grace for them to
// exit, then sends SIGKILL to those left and waits a few seconds more. It
// returns an error only when ctx is done.
//
// Each process is known by its PID and its start time (proc/PID/stat):
// a PID whose start time changed belongs to another process (the
// component exited and its PID was reused during the wait) and counts as
// gone, so the root agent never sends SIGKILL to a process it did not
// vet.
func stopProcesses(ctx context.Context, proc string, pids []int, grace time.Duration, emit Emit) error {
	started := map[int]uint64{}
	for _, pid := range pids {
		st, ok := startTime(proc, pid)
		if !ok {
			continue // gone already: nothing to do
		}
		started[pid] = st
		_ = kill(pid, sigTerm)
	}
	left, err := waitGone(ctx, proc, started, grace)
	if err != nil || len(left) == 0 {
		return err
	}
	killed := map[int]uint64{}
	for _, pid := range left {
		if st, ok := startTime(proc, pid); !ok || st != started[pid] {
			continue // exited, and the PID is another process's now
		}
		emit(&agentv1.OperationEvent{Message: fmt.Sprintf("pid %d did not exit %s after SIGTERM: SIGKILL", pid, grace)})
		_ = kill(pid, sigKill)
		killed[pid] = started[pid]
	}
	_, err = waitGone(ctx, proc, killed, killWait)
	return err
}

// waitGone polls until every process of started (PID to start time) has
// exited (or is a zombie, or its PID is another process's) or d has
// passed, and returns those still running.
func waitGone(ctx context.Context, proc string, started map[int]uint64, d time.Duration) ([]int, error) {
	deadline := time.NewTimer(d)
	defer deadline.Stop()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	pids := make([]int, 0, len(started))
	for pid := range started {
		pids = append(pids, pid)
	}
	slices.Sort(pids)
	for {
		var left []int
		for _, pid := range pids {
			if runningSince(proc, pid, started[pid]) {
				left = append(left, pid)
			}
		}
		if len(left) == 0 {
			return nil, nil
		}
		select {
		case <-ctx.Done():
			return left, ctx.Err()
		case <-deadline.C:
			return left, nil
		case <-tick.C:
		}
	}
}

// portList returns the ports of k.ports in order.
func (k *Kubeadm) portList() []int {
	ps := make([]int, 0, len(k.ports))
	for p := range k.ports {
		ps = append(ps, p)
	}
	slices.Sort(ps)
	return ps
}

func joinInts(ns []int) string {
	s := make([]string, len(ns))
	for i, n := range ns {
		s[i] = fmt.Sprint(n)
	}
	return strings.Join(s, ", ")
}
