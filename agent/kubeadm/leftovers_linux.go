package kubeadm

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
)

const (
	sigTerm = syscall.SIGTERM
	sigKill = syscall.SIGKILL
)

// signal sends sig to pid.
//
// Equivalent to: `kill -SIG PID`.
func kill(pid int, sig syscall.Signal) error { return syscall.Kill(pid, sig) }

// startTime returns the start time of process pid (field 22 of
// proc/PID/stat, in clock ticks since boot): with the PID, what tells a
// process from a later one that reuses its PID. ok is false when pid does
// not exist.
func startTime(proc string, pid int) (uint64, bool) {
	st, _, ok := stat(proc, pid)
	return st, ok
}

// stat reads proc/PID/stat once: the process's start time (field 22, in
// clock ticks since boot) and its state (field 3: 'R', 'S', 'Z', ...).
func stat(proc string, pid int) (start uint64, state byte, ok bool) {
	b, err := os.ReadFile(filepath.Join(proc, strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0, 0, false
	}
	// "PID (comm) S PPID ...": fields from the state (3) on follow the
	// last ')' (a comm may hold spaces and parentheses).
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 || len(f[0]) != 1 {
		return 0, 0, false
	}
	st, err := strconv.ParseUint(f[19], 10, 64)
	return st, f[0][0], err == nil
}

// runningSince reports whether the process pid that started at start
// (startTime) still runs: the same process (not a reused PID) and not a
// zombie whose threads have all exited (only then are its sockets
// closed: the leader of a multi-threaded process is a zombie while its
// other threads still exit). One read of proc/PID/stat per call.
func runningSince(proc string, pid int, start uint64) bool {
	st, state, ok := stat(proc, pid)
	if !ok || st != start {
		return false
	}
	if state != 'Z' && state != 'X' {
		return true
	}
	tasks, err := os.ReadDir(filepath.Join(proc, strconv.Itoa(pid), "task"))
	return err == nil && len(tasks) > 1
}

// listeners returns the processes listening on the TCP ports busy in
// this network namespace: the listening sockets' inodes from
// proc/net/tcp and tcp6, matched against the sockets in every
// proc/PID/fd. A process whose fds cannot be read (the agent's unit drops
// CAP_SYS_PTRACE, so the fds of the kubelet and of containers, which keep
// capabilities the agent lacks, cannot be read) is not seen holding a
// socket: for a busy port with no holder found, the processes named as
// its component in owners (port to name) that run in this network
// namespace (their proc/PID/net/tcp lists the port's listening socket)
// are returned with ByName set.
//
// Equivalent to: `ss -Htlnp 'sport = :10257'`, then `pgrep -x
// kube-controller` among the processes of this network namespace.
func listeners(proc string, busy []int, owners map[int]string) ([]Leftover, error) {
	inodes, err := listening(filepath.Join(proc, "net"), busy) // socket inode -> port
	if err != nil {
		return nil, err
	}
	if len(inodes) == 0 {
		return nil, nil
	}
	dirs, err := os.ReadDir(proc)
	if err != nil {
		return nil, err
	}
	var (
		out  []Leftover
		pids []int
		held = map[int]bool{}
	)
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		pids = append(pids, pid)
		fds, err := os.ReadDir(filepath.Join(proc, d.Name(), "fd"))
		if err != nil {
			continue // gone, or not ours to read
		}
		seen := map[int]bool{}
		for _, fd := range fds {
			link, err := os.Readlink(filepath.Join(proc, d.Name(), "fd", fd.Name()))
			if err != nil {
				continue
			}
			port, ok := inodes[link]
			if !ok || seen[port] {
				continue
			}
			seen[port], held[port] = true, true
			out = append(out, Leftover{Port: port, PID: pid, Comm: comm(proc, pid)})
		}
	}
	for _, port := range busy {
		name := owners[port]
		if held[port] || name == "" {
			continue
		}
		for _, pid := range pids {
			c := comm(proc, pid)
			if !isNamed(c, name) {
				continue
			}
			theirs, err := listening(filepath.Join(proc, strconv.Itoa(pid), "net"), []int{port})
			if err != nil {
				continue
			}
			for inode := range theirs {
				if inodes[inode] == port { // the same socket: this network namespace
					out = append(out, Leftover{Port: port, PID: pid, Comm: c, ByName: true})
					break
				}
			}
		}
	}
	slices.SortFunc(out, func(a, b Leftover) int {
		if a.Port != b.Port {
			return a.Port - b.Port
		}
		return a.PID - b.PID
	})
	return out, nil
}

// listening reads the listening TCP sockets on ports from dir/tcp and
// dir/tcp6 (dir: a proc "net" directory) and returns their inodes, as
// the "socket:[N]" links of /proc/PID/fd name them, with their ports.
func listening(dir string, ports []int) (map[string]int, error) {
	inodes := map[string]int{}
	for _, f := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			if os.IsNotExist(err) && f == "tcp6" {
				continue // no IPv6
			}
			return nil, err
		}
		sc := bufio.NewScanner(bytes.NewReader(b))
		sc.Scan() // header
		for sc.Scan() {
			// sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
			fs := strings.Fields(sc.Text())
			if len(fs) < 10 || fs[3] != "0A" { // TCP_LISTEN
				continue
			}
			_, hexPort, ok := strings.Cut(fs[1], ":")
			if !ok {
				continue
			}
			port, err := strconv.ParseUint(hexPort, 16, 16)
			if err != nil || !slices.Contains(ports, int(port)) || fs[9] == "0" {
				continue
			}
			inodes["socket:["+fs[9]+"]"] = int(port)
		}
	}
	return inodes, nil
}

// comm returns the name of process pid ("pid N" when it cannot be read).
func comm(proc string, pid int) string {
	b, _ := os.ReadFile(filepath.Join(proc, strconv.Itoa(pid), "comm"))
	if name := strings.TrimSpace(string(b)); name != "" {
		return name
	}
	return fmt.Sprintf("pid %d", pid)
}
