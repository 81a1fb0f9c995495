package fleet

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/kilnhq/kiln/e2e/lab/nspawn"
	"github.com/kilnhq/kiln/e2e/lab/rack"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// NodeLeader returns the PID (in this machine's namespace) of the init of
// the system booted from disk on the lab host whose Host resource is
// named host: the process in the host's cgroups that is PID 1 of its own
// PID namespace. It is NotFound when the host runs no disk boot.
func (l *Lab) NodeLeader(host string) (int, error) {
	st, err := rack.ReadState(l.StateDir())
	if err != nil {
		return 0, err
	}
	machine := ""
	for _, h := range st.Hosts {
		if h.Resource == host || h.Name == host {
			machine = h.Machine
		}
	}
	if machine == "" {
		return 0, errdefs.NotFound("lab: no host %s in %s", host, l.StateDir())
	}
	for _, hier := range nspawn.Hierarchies() {
		for _, p := range cgroupProcs(filepath.Join(hier, machine)) {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p))
			if err != nil {
				continue
			}
			for _, line := range strings.Split(string(b), "\n") {
				f := strings.Fields(line)
				if len(f) >= 3 && f[0] == "NSpid:" && f[len(f)-1] == "1" {
					return p, nil
				}
			}
		}
	}
	return 0, errdefs.NotFound("lab: host %s (machine %s) runs no system booted from disk", host, machine)
}

// cgroupProcs lists the processes of a cgroup and its descendants.
func cgroupProcs(dir string) []int {
	var out []int
	_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
			return nil
		}
		b, _ := os.ReadFile(p)
		for _, f := range strings.Fields(string(b)) {
			if n, err := strconv.Atoi(f); err == nil {
				out = append(out, n)
			}
		}
		return nil
	})
	return out
}

// NodeExec runs a command inside the system booted on a lab host (all of
// its namespaces), as an operator at its console would.
//
// Equivalent to: `nsenter -t LEADER -a CMD...`.
func (l *Lab) NodeExec(ctx context.Context, host string, args ...string) (string, error) {
	pid, err := l.NodeLeader(host)
	if err != nil {
		return "", err
	}
	out, err := exec.CommandContext(ctx, "nsenter", append([]string{"-t", strconv.Itoa(pid), "-a"}, args...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("on %s: %s: %w: %s", host, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}
