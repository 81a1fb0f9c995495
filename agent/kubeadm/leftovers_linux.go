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

// running reports whether pid exists and is not a zombie (a zombie holds
// no sockets).
func running(proc string, pid int) bool {
	b, err := os.ReadFile(filepath.Join(proc, strconv.Itoa(pid), "stat"))
	if err != nil {
		return false
	}
	// "PID (comm) S ...": the state follows the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return false
	}
	return b[i+2] != 'Z' && b[i+2] != 'X'
}

// listeners returns the processes listening on TCP ports in ps in this
// network namespace: the listening sockets' inodes from proc/net/tcp and
// tcp6, matched against the sockets in every proc/PID/fd. A process whose
// fds cannot be read (another user's, without root) is not found.
//
// Equivalent to: `ss -Htlnp 'sport = :10257'`.
func listeners(proc string, ps []int) ([]Leftover, error) {
	inodes := map[string]int{} // socket inode -> port
	for _, f := range []string{"net/tcp", "net/tcp6"} {
		b, err := os.ReadFile(filepath.Join(proc, f))
		if err != nil {
			if os.IsNotExist(err) && f == "net/tcp6" {
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
			if err != nil || !slices.Contains(ps, int(port)) || fs[9] == "0" {
				continue
			}
			inodes["socket:["+fs[9]+"]"] = int(port)
		}
	}
	if len(inodes) == 0 {
		return nil, nil
	}
	dirs, err := os.ReadDir(proc)
	if err != nil {
		return nil, err
	}
	var out []Leftover
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
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
			seen[port] = true
			comm, _ := os.ReadFile(filepath.Join(proc, d.Name(), "comm"))
			name := strings.TrimSpace(string(comm))
			if name == "" {
				name = fmt.Sprintf("pid %d", pid)
			}
			out = append(out, Leftover{Port: port, PID: pid, Comm: name})
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
