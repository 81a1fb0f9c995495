// Package kmod makes sure kernel modules are available, loaded or built
// in, and persists them in ROOT/etc/modules-load.d/kiln.conf.
//
// Some kernels have no loadable modules at all (no /proc/modules); their
// features are built in. A module counts as built in when
// ROOT/lib/modules/$(uname -r)/modules.builtin lists it, when
// ROOT/sys/module/NAME exists without a /proc/modules entry, or when the
// kernel shows what it provides (br_netfilter: the
// /proc/sys/net/bridge/bridge-nf-call-iptables file; overlay: "overlay" in
// /proc/filesystems). The last matters in containers, whose /sys may have
// no /sys/module at all.
package kmod

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/kilnhq/kiln/internal/atomicfile"
)

// PersistFile is where Persist writes, relative to the root.
const PersistFile = "etc/modules-load.d/kiln.conf"

// State is whether a module is available.
type State string

// The states of a module.
const (
	Loaded  State = "loaded"
	BuiltIn State = "built-in"
	Missing State = "missing"
)

// Available reports whether s means the module's feature is there.
func (s State) Available() bool { return s == Loaded || s == BuiltIn }

// Runner runs a host command (command.Exec in production).
type Runner interface {
	Run(ctx context.Context, name string, args ...string) ([]byte, error)
}

// evidence tells whether a module's feature is in the running kernel
// even when /sys/module has no entry for it (built-in br_netfilter) or
// /sys/module is not visible (containers such as systemd-nspawn machines).
var evidence = map[string]func(root string) bool{
	"br_netfilter": func(root string) bool {
		_, err := os.Stat(filepath.Join(root, "proc/sys/net/bridge/bridge-nf-call-iptables"))
		return err == nil
	},
	"overlay": func(root string) bool { return hasFilesystem(root, "overlay") },
}

// hasFilesystem reports whether ROOT/proc/filesystems lists fs.
func hasFilesystem(root, fs string) bool {
	b, err := os.ReadFile(filepath.Join(root, "proc/filesystems"))
	if err != nil {
		return false
	}
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) > 0 && f[len(f)-1] == fs {
			return true
		}
	}
	return false
}

// Status reports whether module name is loaded, built in or missing from
// the kernel running under root. kernelRelease is `uname -r`; it may be
// empty, in which case modules.builtin is not consulted.
func Status(root, kernelRelease, name string) (State, error) {
	name = strings.ReplaceAll(name, "-", "_")
	mods, err := os.ReadFile(filepath.Join(root, "proc/modules"))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("module %s: %w", name, err)
	}
	for line := range strings.Lines(string(mods)) {
		if f := strings.Fields(line); len(f) > 0 && f[0] == name {
			return Loaded, nil
		}
	}
	if kernelRelease != "" {
		b, err := os.ReadFile(filepath.Join(root, "lib/modules", kernelRelease, "modules.builtin"))
		if err == nil {
			for line := range strings.Lines(string(b)) {
				base := strings.TrimSuffix(filepath.Base(strings.TrimSpace(line)), ".ko")
				if strings.ReplaceAll(base, "-", "_") == name {
					return BuiltIn, nil
				}
			}
		}
	}
	if _, err := os.Stat(filepath.Join(root, "sys/module", name)); err == nil {
		// Present in sysfs but not in /proc/modules: built in.
		return BuiltIn, nil
	}
	if has, ok := evidence[name]; ok && has(root) {
		return BuiltIn, nil
	}
	return Missing, nil
}

// Ensure makes module name available: nothing to do when it is loaded or
// built in, otherwise it is loaded with modprobe through run. It returns
// the state before and after.
//
// Equivalent to: `modprobe br_netfilter`.
//
// It returns an error naming the module when modprobe fails or the module
// is still missing afterwards.
func Ensure(ctx context.Context, root, kernelRelease string, run Runner, name string) (before, after State, err error) {
	before, err = Status(root, kernelRelease, name)
	if err != nil || before.Available() {
		return before, before, err
	}
	if _, err := run.Run(ctx, "modprobe", name); err != nil {
		return before, Missing, fmt.Errorf("load module %s: %w", name, err)
	}
	after, err = Status(root, kernelRelease, name)
	if err != nil {
		return before, after, err
	}
	if !after.Available() {
		return before, after, fmt.Errorf("load module %s: modprobe succeeded but the module is not loaded", name)
	}
	return before, after, nil
}

// Persist adds names to ROOT/etc/modules-load.d/kiln.conf (names already
// there are kept) and reports whether the file changed.
//
// Equivalent to: `echo br_netfilter >> /etc/modules-load.d/kiln.conf`.
func Persist(root string, names []string) (changed bool, err error) {
	path := filepath.Join(root, PersistFile)
	old, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return false, fmt.Errorf("read %s: %w", PersistFile, err)
	}
	all := slices.Clone(names)
	for line := range strings.Lines(string(old)) {
		line = strings.TrimSpace(line)
		if line != "" && line[0] != '#' && line[0] != ';' {
			all = append(all, line)
		}
	}
	slices.Sort(all)
	all = slices.Compact(all)
	var b bytes.Buffer
	b.WriteString("# Written by kiln-agent (Prepare): modules Kubernetes needs.\n")
	for _, n := range all {
		b.WriteString(n + "\n")
	}
	if bytes.Equal(old, b.Bytes()) {
		return false, nil
	}
	return true, atomicfile.Write(path, b.Bytes(), 0o644, atomicfile.MkdirAll(0o755))
}
