package nspawn

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Hierarchies are the mounted cgroup hierarchies below /sys/fs/cgroup:
// each v1 controller mount once (however many names link to it), and
// the v2 one; just /sys/fs/cgroup where it is the unified hierarchy.
func Hierarchies() []string {
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.procs"); err == nil {
		return []string{"/sys/fs/cgroup"}
	}
	entries, err := os.ReadDir("/sys/fs/cgroup")
	if err != nil {
		return nil
	}
	var hs []string
	seen := map[string]bool{}
	for _, e := range entries {
		real, err := filepath.EvalSymlinks(filepath.Join("/sys/fs/cgroup", e.Name()))
		if err != nil || seen[real] {
			continue
		}
		if _, err := os.Stat(filepath.Join(real, "cgroup.procs")); err != nil {
			continue
		}
		seen[real] = true
		hs = append(hs, real)
	}
	return hs
}

// Cgroups is a cgroup of one name in every hierarchy: nspawn puts its
// payload and supervisor cgroups below the cgroup it starts in, so a
// container started in these goes away with them.
type Cgroups struct {
	// Dirs are the cgroup directories, one per hierarchy.
	Dirs []string
}

// NewCgroups returns the cgroups called name, one in each of
// Hierarchies(). It creates nothing, so that a caller can record the
// directories before Create makes them.
func NewCgroups(name string) Cgroups {
	var c Cgroups
	for _, h := range Hierarchies() {
		c.Dirs = append(c.Dirs, filepath.Join(h, name))
	}
	return c
}

// Create makes the cgroups (an existing one is kept), copying
// cpuset.cpus and cpuset.mems into the cpuset one (a new v1 cpuset
// cgroup has none and takes no process), and returns their cgroup.procs
// files. Equivalent to: `mkdir /sys/fs/cgroup/*/NAME; cat
// cpuset/cpuset.cpus > cpuset/NAME/cpuset.cpus` (and mems).
func (c Cgroups) Create() ([]string, error) {
	var procs []string
	for _, d := range c.Dirs {
		if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return nil, fmt.Errorf("cgroup: %w", err)
		}
		if parent := filepath.Dir(d); strings.Contains(filepath.Base(parent), "cpuset") {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				b, err := os.ReadFile(filepath.Join(parent, f))
				if err != nil {
					continue
				}
				if cur, _ := os.ReadFile(filepath.Join(d, f)); strings.TrimSpace(string(cur)) != "" {
					continue
				}
				if err := os.WriteFile(filepath.Join(d, f), b, 0o644); err != nil {
					return nil, fmt.Errorf("cgroup %s: %s: %w", d, f, err)
				}
			}
		}
		procs = append(procs, filepath.Join(d, "cgroup.procs"))
	}
	return procs, nil
}

// Kill sends SIGKILL to every process in the cgroups and below, until
// none is left (at most 5 s per cgroup). It blocks.
func (c Cgroups) Kill() {
	for _, d := range c.Dirs {
		KillCgroup(d)
	}
}

// Remove removes the cgroups and everything below them (kubelet's
// kubepods trees, nspawn's payload), deepest first; a cgroup that is
// already gone is not an error. It retries for up to 2 s while a cgroup
// is still busy, and returns the last error of each that stays.
func (c Cgroups) Remove() error {
	var errs []error
	for _, d := range c.Dirs {
		errs = append(errs, RemoveCgroup(d))
	}
	return errors.Join(errs...)
}

// cgroupTree lists dir and its descendants, deepest first.
func cgroupTree(dir string) []string {
	var sub []string
	_ = filepath.WalkDir(dir, func(p string, e os.DirEntry, err error) error {
		if err == nil && e.IsDir() {
			sub = append(sub, p)
		}
		return nil
	})
	slices.Reverse(sub)
	return sub
}

// KillCgroup sends SIGKILL to every process in the cgroup dir and below,
// until none is left (at most 5 s). It blocks.
func KillCgroup(dir string) {
	for range 50 {
		n := 0
		for _, d := range cgroupTree(dir) {
			b, _ := os.ReadFile(filepath.Join(d, "cgroup.procs"))
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil && pid > 1 {
					_ = syscall.Kill(pid, syscall.SIGKILL)
					n++
				}
			}
		}
		if n == 0 {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// RemoveCgroup removes the cgroup dir and everything below it, deepest
// first; a missing cgroup is not an error. Equivalent to `find DIR
// -depth -type d -exec rmdir {} \;`, retried for up to 2 s while busy.
func RemoveCgroup(dir string) error {
	var err error
	for range 20 {
		err = nil
		for _, d := range cgroupTree(dir) {
			if e := syscall.Rmdir(d); e != nil && !errors.Is(e, syscall.ENOENT) {
				err = fmt.Errorf("remove cgroup %s: %w", d, e)
			}
		}
		if err == nil {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return err
}

// LeaderOf returns the PID of the container's init: the child of the
// systemd-nspawn process pid that runs in a PID namespace of its own
// (nspawn's short-lived helper children run in the caller's), or 0 when
// there is none (yet, or any more).
func LeaderOf(pid int) int {
	if pid <= 0 {
		return 0
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, pid))
	if err != nil {
		return 0
	}
	own, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", pid))
	if err != nil {
		return 0
	}
	for _, f := range strings.Fields(string(b)) {
		c, err := strconv.Atoi(f)
		if err != nil {
			continue
		}
		if ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", c)); err == nil && ns != own {
			return c
		}
	}
	return 0
}
