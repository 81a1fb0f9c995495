package rootfs

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/filelock"
)

// Build returns the directory of the root spec describes, building it
// first unless the cache has it. Building runs
//
//	debootstrap --variant=minbase --include=systemd,systemd-sysv,dbus,iproute2 SUITE TMP MIRROR
//
// then, when spec.Packages is not empty, inside the new root
//
//	systemd-nspawn -q -D TMP -M NAME --register=no --keep-unit --resolv-conf=copy-host \
//	  sh -c 'apt-get update && apt-get install -y --no-install-recommends PKGS'
//
// (chroot when systemd-nspawn is missing), empties /etc/machine-id and the
// apt lists, and renames TMP to the cache directory: a build that fails
// or is interrupted leaves no entry. Concurrent builds of one spec wait
// for each other (a lock file beside the entry). Command output goes to
// progress (nil discards it).
//
// The returned directory is shared by every caller: do not change it, use
// Overlay for a per-image copy. Build blocks for minutes on a cold cache.
// It returns InvalidArgument for a bad spec, FailedPrecondition when not
// root or debootstrap is missing, and the command's error with the tail
// of its output otherwise.
func Build(ctx context.Context, spec Spec, progress io.Writer) (string, error) {
	if err := spec.Validate(); err != nil {
		return "", err
	}
	spec = spec.withDefaults()
	if progress == nil {
		progress = io.Discard
	}
	dir := spec.Dir()
	if isDir(dir) {
		return dir, nil
	}
	if os.Geteuid() != 0 {
		return "", errdefs.FailedPrecondition("rootfs: building a root needs root privileges")
	}
	debootstrap, err := exec.LookPath("debootstrap")
	if err != nil {
		return "", errdefs.FailedPrecondition("rootfs: debootstrap not found (Debian package debootstrap)")
	}
	if err := os.MkdirAll(spec.CacheDir, 0o755); err != nil {
		return "", fmt.Errorf("rootfs: cache: %w", err)
	}
	unlock, err := filelock.Lock(ctx, filepath.Join(spec.CacheDir, spec.Key()+".lock"))
	if err != nil {
		return "", fmt.Errorf("rootfs: another build of the same spec: %w", err)
	}
	defer unlock()
	if isDir(dir) { // built while we waited
		return dir, nil
	}

	tmp := filepath.Join(spec.CacheDir, fmt.Sprintf(".tmp-%s-%d", spec.Key(), os.Getpid()))
	if err := os.RemoveAll(tmp); err != nil {
		return "", fmt.Errorf("rootfs: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			_ = os.RemoveAll(tmp)
		}
	}()

	fmt.Fprintf(progress, "rootfs: debootstrap %s from %s into %s\n", spec.Suite, spec.Mirror, tmp)
	if err := run(ctx, progress, nil, debootstrap, "--variant=minbase",
		"--include="+strings.Join(BasePackages, ","), spec.Suite, tmp, spec.Mirror); err != nil {
		return "", fmt.Errorf("rootfs: debootstrap: %w", err)
	}
	if len(spec.Packages) > 0 {
		fmt.Fprintf(progress, "rootfs: apt-get install %s\n", strings.Join(spec.Packages, " "))
		if err := install(ctx, progress, tmp, spec.Packages); err != nil {
			return "", fmt.Errorf("rootfs: install packages: %w", err)
		}
	}
	if err := tidy(tmp); err != nil {
		return "", fmt.Errorf("rootfs: %w", err)
	}
	// A directory tree, published whole by rename (internal/atomicfile
	// writes single files).
	if err := os.Rename(tmp, dir); err != nil {
		return "", fmt.Errorf("rootfs: %w", err)
	}
	ok = true
	fmt.Fprintf(progress, "rootfs: built %s\n", dir)
	return dir, nil
}

// install runs apt-get inside root.
func install(ctx context.Context, progress io.Writer, root string, pkgs []string) error {
	script := "apt-get update -q && apt-get install -q -y --no-install-recommends " + strings.Join(pkgs, " ") + " && apt-get clean"
	env := []string{"DEBIAN_FRONTEND=noninteractive", "LC_ALL=C"}
	if nspawn, err := exec.LookPath("systemd-nspawn"); err == nil {
		// nspawn leaves its propagation directory (/run is not a tmpfs on
		// the lab machines) and a lock file beside the tree.
		name := "kiln-rootfs-" + strings.TrimPrefix(filepath.Base(root), ".tmp-")
		defer os.RemoveAll(filepath.Join("/run/systemd/nspawn/propagate", name))
		defer os.Remove(filepath.Join(filepath.Dir(root), ".#"+filepath.Base(root)+".lck"))
		return run(ctx, progress, env, nspawn, "-q", "-D", root, "-M", name, "--register=no", "--keep-unit",
			"--resolv-conf=copy-host", "--timezone=off", "--link-journal=no",
			"--setenv=DEBIAN_FRONTEND=noninteractive", "/bin/sh", "-c", script)
	}
	// chroot needs the host's resolver to reach the mirror.
	if b, err := os.ReadFile("/etc/resolv.conf"); err == nil {
		_ = os.WriteFile(filepath.Join(root, "etc/resolv.conf"), b, 0o644)
		defer os.Remove(filepath.Join(root, "etc/resolv.conf"))
	}
	return run(ctx, progress, env, "chroot", root, "/bin/sh", "-c", script)
}

// tidy leaves no host-specific or cached state in a new root: every host
// made from it gets its own machine ID at first boot and its own name.
func tidy(root string) error {
	if err := os.WriteFile(filepath.Join(root, "etc/machine-id"), nil, 0o444); err != nil {
		return err
	}
	_ = os.Remove(filepath.Join(root, "var/lib/dbus/machine-id"))
	// debootstrap copies the build machine's hostname and resolver: a
	// host gets its name from its boot (nspawn -M, DHCP, the agent) and
	// no nameserver it was not given (the lab's network rule).
	_ = os.Remove(filepath.Join(root, "etc/hostname"))
	if err := os.WriteFile(filepath.Join(root, "etc/resolv.conf"), nil, 0o644); err != nil {
		return err
	}
	lists, _ := filepath.Glob(filepath.Join(root, "var/lib/apt/lists/*_*"))
	bins, _ := filepath.Glob(filepath.Join(root, "var/cache/apt/*.bin"))
	for _, f := range append(lists, bins...) {
		_ = os.Remove(f)
	}
	return nil
}

// run runs a command with its output copied to progress; a failure
// carries the last lines of that output.
func run(ctx context.Context, progress io.Writer, env []string, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	tail := &tailBuffer{max: 4096}
	cmd.Stdout = io.MultiWriter(progress, tail)
	cmd.Stderr = cmd.Stdout
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 10 * time.Second
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s: %w: %s", filepath.Base(name), err, strings.TrimSpace(tail.String()))
	}
	return nil
}

type tailBuffer struct {
	max int
	buf bytes.Buffer
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.buf.Write(p)
	if t.buf.Len() > 2*t.max {
		b := t.buf.Bytes()[t.buf.Len()-t.max:]
		t.buf = *bytes.NewBuffer(append([]byte(nil), b...))
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	b := t.buf.Bytes()
	if len(b) > t.max {
		b = b[len(b)-t.max:]
	}
	return string(b)
}

func isDir(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.IsDir()
}

// Overlay makes dst a copy of the root base with files added, atomically
// (a copy beside dst renamed into place). dst must not exist. Files are
// written through an os.Root, so no path (or symlink in base) can reach
// outside dst. Equivalent to `cp -a --reflink=auto BASE DST` followed by
// writing each file. It returns AlreadyExists when dst exists and
// InvalidArgument for a relative file path.
func Overlay(ctx context.Context, base, dst string, files []File) error {
	if _, err := os.Lstat(dst); err == nil {
		return errdefs.AlreadyExists("rootfs: overlay: %s exists", dst)
	}
	for _, f := range files {
		if !filepath.IsAbs(f.Path) {
			return errdefs.InvalidArgument("rootfs: overlay: file path %q is not absolute", f.Path)
		}
	}
	tmp := dst + ".tmp"
	if err := os.RemoveAll(tmp); err != nil {
		return fmt.Errorf("rootfs: overlay: %w", err)
	}
	if err := run(ctx, io.Discard, nil, "cp", "-a", "--reflink=auto", base, tmp); err != nil {
		_ = os.RemoveAll(tmp)
		return fmt.Errorf("rootfs: overlay: %w", err)
	}
	if err := addFiles(tmp, files); err != nil {
		_ = os.RemoveAll(tmp)
		return fmt.Errorf("rootfs: overlay: %w", err)
	}
	// A directory tree, as above: renamed into place.
	if err := os.Rename(tmp, dst); err != nil {
		_ = os.RemoveAll(tmp)
		return fmt.Errorf("rootfs: overlay: %w", err)
	}
	return nil
}

func addFiles(dir string, files []File) error {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	for _, f := range files {
		rel := strings.TrimPrefix(filepath.Clean(f.Path), "/")
		if err := root.MkdirAll(filepath.Dir(rel), 0o755); err != nil {
			return fmt.Errorf("%s: %w", f.Path, err)
		}
		_ = root.Remove(rel)
		if f.Symlink != "" {
			if err := root.Symlink(f.Symlink, rel); err != nil {
				return fmt.Errorf("%s: %w", f.Path, err)
			}
			continue
		}
		data := f.Data
		if f.Source != "" {
			if data, err = os.ReadFile(f.Source); err != nil {
				return fmt.Errorf("%s: %w", f.Path, err)
			}
		}
		mode := f.Mode
		if mode == 0 {
			mode = 0o644
		}
		w, err := root.OpenFile(rel, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
		if err != nil {
			return fmt.Errorf("%s: %w", f.Path, err)
		}
		if _, err := w.Write(data); err != nil {
			w.Close()
			return fmt.Errorf("%s: %w", f.Path, err)
		}
		if err := w.Close(); err != nil {
			return fmt.Errorf("%s: %w", f.Path, err)
		}
		if err := root.Chmod(rel, mode); err != nil {
			return fmt.Errorf("%s: %w", f.Path, err)
		}
	}
	return nil
}
