package bootmedia

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/filelock"
)

// kernelPackageRE matches Debian's generic amd64 kernel packages of the
// 6.1 series, e.g. linux-image-6.1.0-57-amd64 (not -cloud-, -rt-, or the
// -unsigned variants).
var kernelPackageRE = regexp.MustCompile(`^linux-image-6\.1\.(\d+)-(\d+)-amd64$`)

// NewestKernelPackage returns the newest linux-image-6.1.*-amd64 package
// the configured apt sources have. Equivalent to:
// `apt-cache search --names-only '^linux-image-6\.1\..*-amd64$' | sort -V | tail -1`.
func NewestKernelPackage(ctx context.Context, run Runner) (string, error) {
	out, err := run.Run(ctx, "", "apt-cache", "search", "--names-only", `^linux-image-6\.1\.[0-9]+-[0-9]+-amd64$`)
	if err != nil {
		return "", errdefs.Unavailable("find the kernel package: %v", err)
	}
	best, bestKey := "", [2]int{-1, -1}
	for _, line := range strings.Split(string(out), "\n") {
		name, _, _ := strings.Cut(line, " ")
		m := kernelPackageRE.FindStringSubmatch(name)
		if m == nil {
			continue
		}
		a, _ := strconv.Atoi(m[1])
		b, _ := strconv.Atoi(m[2])
		if k := [2]int{a, b}; k[0] > bestKey[0] || (k[0] == bestKey[0] && k[1] > bestKey[1]) {
			best, bestKey = name, k
		}
	}
	if best == "" {
		return "", errdefs.NotFound("no linux-image-6.1.*-amd64 package in the apt sources (run apt-get update?)")
	}
	return best, nil
}

// Kernel is an unpacked Debian kernel package in the cache.
type Kernel struct {
	// Package and Version are the Debian package name and version.
	Package string `json:"package"`
	Version string `json:"version"`
	// Release is the kernel release (uname -r), e.g. 6.1.0-57-amd64.
	Release string `json:"release"`
	// Root is the unpacked package (boot/, lib/modules/).
	Root string `json:"-"`
}

// Vmlinuz is the path of the kernel image.
func (k *Kernel) Vmlinuz() string { return filepath.Join(k.Root, "boot", "vmlinuz-"+k.Release) }

// ModulesDir is the kernel's lib/modules/<release> directory.
func (k *Kernel) ModulesDir() string { return filepath.Join(k.Root, "lib", "modules", k.Release) }

// fetchKernel downloads pkg into cacheDir/<pkg>_<version>/ and unpacks
// it there, unless that directory is already complete. Equivalent to:
// `apt-get download PKG && dpkg-deb -x PKG_VER_amd64.deb kroot && depmod -b kroot RELEASE`.
func fetchKernel(ctx context.Context, run Runner, cacheDir, pkg string, progress func(string, ...any)) (*Kernel, error) {
	out, err := run.Run(ctx, "", "apt-cache", "show", "--no-all-versions", pkg)
	if err != nil {
		return nil, errdefs.NotFound("kernel package %s: %v", pkg, err)
	}
	version := field(string(out), "Version")
	if version == "" {
		return nil, errdefs.NotFound("kernel package %s: apt-cache shows no version", pkg)
	}
	dir := filepath.Join(cacheDir, pkg+"_"+strings.ReplaceAll(version, ":", "%3a"))
	k := &Kernel{Package: pkg, Version: version, Release: strings.TrimPrefix(pkg, "linux-image-"), Root: filepath.Join(dir, "kroot")}
	complete := func() bool { _, err := os.Stat(filepath.Join(dir, "complete")); return err == nil }
	if complete() {
		progress("kernel %s %s from the cache", pkg, version)
		return k, nil
	}
	if err := os.MkdirAll(cacheDir, 0o755); err != nil {
		return nil, fmt.Errorf("kernel cache: %w", err)
	}
	// One fetch per entry at a time, across processes: a second one waits
	// and then uses the first one's entry; none removes an entry another
	// may be reading.
	unlock, err := filelock.Lock(ctx, dir+".lock")
	if err != nil {
		return nil, fmt.Errorf("kernel cache: %w", err)
	}
	defer unlock()
	if complete() { // fetched while we waited
		progress("kernel %s %s from the cache", pkg, version)
		return k, nil
	}
	tmp, err := os.MkdirTemp(cacheDir, ".fetch-"+pkg+"-")
	if err != nil {
		return nil, fmt.Errorf("kernel cache: %w", err)
	}
	defer os.RemoveAll(tmp)
	progress("downloading %s %s", pkg, version)
	if _, err := run.Run(ctx, tmp, "apt-get", "download", pkg+"="+version); err != nil {
		return nil, errdefs.Unavailable("download %s: %v", pkg, err)
	}
	debs, _ := filepath.Glob(filepath.Join(tmp, "*.deb"))
	if len(debs) != 1 {
		return nil, fmt.Errorf("download %s: want one .deb, found %d", pkg, len(debs))
	}
	progress("unpacking %s", filepath.Base(debs[0]))
	if _, err := run.Run(ctx, "", "dpkg-deb", "-x", debs[0], filepath.Join(tmp, "kroot")); err != nil {
		return nil, fmt.Errorf("unpack %s: %w", pkg, err)
	}
	// The package ships no modules.dep: its postinst runs depmod.
	if _, err := run.Run(ctx, "", "depmod", "-b", filepath.Join(tmp, "kroot"), k.Release); err != nil {
		return nil, fmt.Errorf("depmod for %s (apt-get install kmod): %w", pkg, err)
	}
	if err := os.WriteFile(filepath.Join(tmp, "complete"), []byte(version+"\n"), 0o644); err != nil {
		return nil, err
	}
	// Publish by rename, under the lock: the entry appears whole, with
	// "complete" in it, or not at all.
	if err := os.RemoveAll(dir); err != nil { // an incomplete earlier attempt
		return nil, fmt.Errorf("kernel cache: %w", err)
	}
	if err := os.Rename(tmp, dir); err != nil {
		return nil, fmt.Errorf("kernel cache: %w", err)
	}
	if _, err := os.Stat(k.Vmlinuz()); err != nil {
		return nil, fmt.Errorf("kernel package %s has no %s: %w", pkg, filepath.Base(k.Vmlinuz()), err)
	}
	return k, nil
}

// field returns the value of a "Key: value" line of a deb822 paragraph.
func field(text, key string) string {
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), key+": "); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// ResolveModules returns the module files (paths relative to modDir) to
// load for the named modules, dependencies first, read from modDir's
// modules.dep. Modules built into the kernel (modules.builtin) are left out;
// a name in neither file is reported in missing. Names match with - and _
// treated alike, as modprobe does.
func ResolveModules(modDir string, names []string) (order []string, missing []string, err error) {
	dep, err := os.ReadFile(filepath.Join(modDir, "modules.dep"))
	if err != nil {
		return nil, nil, fmt.Errorf("modules.dep: %w", err)
	}
	builtin := map[string]bool{}
	if b, err := os.ReadFile(filepath.Join(modDir, "modules.builtin")); err == nil {
		for _, l := range strings.Fields(string(b)) {
			builtin[modName(l)] = true
		}
	}
	deps := map[string][]string{} // file -> dependency files
	byName := map[string]string{} // module name -> file
	for _, line := range strings.Split(string(dep), "\n") {
		file, rest, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		deps[file] = strings.Fields(rest)
		byName[modName(file)] = file
	}
	seen := map[string]bool{}
	var visit func(f string, stack []string) error
	visit = func(f string, stack []string) error {
		if seen[f] {
			return nil
		}
		if slices.Contains(stack, f) {
			return fmt.Errorf("modules.dep: dependency cycle through %s", f)
		}
		for _, d := range deps[f] {
			if err := visit(d, append(stack, f)); err != nil {
				return err
			}
		}
		seen[f] = true
		order = append(order, f)
		return nil
	}
	for _, n := range names {
		key := strings.ReplaceAll(n, "-", "_")
		f, ok := byName[key]
		if !ok {
			if !builtin[key] {
				missing = append(missing, n)
			}
			continue
		}
		if err := visit(f, nil); err != nil {
			return nil, nil, err
		}
	}
	return order, missing, nil
}

// modName turns kernel/drivers/net/virtio_net.ko(.xz) into virtio_net.
func modName(file string) string {
	b := filepath.Base(file)
	if i := strings.Index(b, ".ko"); i >= 0 {
		b = b[:i]
	}
	return strings.ReplaceAll(b, "-", "_")
}
