package lay

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"unsafe"

	"github.com/kilnhq/kiln/internal/errdefs"
)

const mib = 1 << 20

// fileTargetsHint says what to do about a target that is not a block
// device.
const fileTargetsHint = "images are laid only onto whole disks; name one in spec.rootDiskHint (a device, by-path or by-id name, or a serial) or spec.rootDeviceHints (files are accepted only by an agent run with --file-targets, as the lab's are)"

// target is an open disk: a block device or, in file-target mode, a
// regular file.
type target struct {
	f     *os.File
	path  string
	block bool
	size  int64
	// direct, where the platform and filesystem allow it, is a second
	// descriptor opened with O_DIRECT for the aligned writes: they go to
	// the disk without a copy into the page cache, which saves a CPU copy
	// per byte, keeps a boot agent's small RAM free of gigabytes of dirty
	// pages, and leaves little for the final fsync to do.
	direct   *os.File
	directOK atomic.Bool // direct is usable; cleared on its first failure
}

// openTarget opens path for writing. Only with files set (the lab's file
// targets) is a regular file accepted, and a missing path created as one
// when create is set too, except under /dev, where a missing device is an
// errdefs.NotFound error (and not a file on a tmpfs). Without files a
// regular file is an errdefs.InvalidArgument error: a hint that named no
// disk must never turn into a new file that "holds" the image. A block
// device is opened exclusively on Linux, so a mounted disk is refused.
func openTarget(path string, create, files bool) (*target, error) {
	fi, err := os.Stat(path)
	if os.IsNotExist(err) {
		if strings.HasPrefix(filepath.Clean(path), "/dev/") {
			return nil, errdefs.NotFound("target %q: no such device", path)
		}
		if !files {
			return nil, errdefs.InvalidArgument("target %q: no such device, and not a block device: %s", path, fileTargetsHint)
		}
		if !create {
			return nil, errdefs.NotFound("target %q: no such device or file", path)
		}
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return nil, fmt.Errorf("target %q: create: %w", path, err)
		}
		t := &target{f: f, path: path}
		t.setDirect(openDirect(path))
		return t, nil
	}
	if err != nil {
		return nil, fmt.Errorf("target %q: %w", path, err)
	}
	if fi.Mode().IsRegular() && !files {
		return nil, errdefs.InvalidArgument("target %q is a regular file, not a block device: %s", path, fileTargetsHint)
	}
	t := &target{path: path}
	mode := fi.Mode()
	flags := os.O_RDWR
	switch {
	case mode.IsRegular():
	case mode&os.ModeDevice != 0 && mode&os.ModeCharDevice == 0:
		t.block = true
		flags = blockOpenFlags
	default:
		return nil, errdefs.InvalidArgument("target %q: not a block device or regular file (%v)", path, mode.Type())
	}
	if t.f, err = os.OpenFile(path, flags, 0); err != nil {
		if os.IsPermission(err) {
			return nil, errdefs.PermissionDenied("target %q: %v", path, err)
		}
		return nil, fmt.Errorf("target %q: open (in use or mounted?): %w", path, err)
	}
	if t.size, err = t.f.Seek(0, io.SeekEnd); err != nil {
		t.f.Close()
		return nil, fmt.Errorf("target %q: size: %w", path, err)
	}
	t.setDirect(openDirect(path))
	return t, nil
}

func (t *target) setDirect(f *os.File) {
	t.direct = f
	t.directOK.Store(f != nil)
}

func (t *target) Close() error {
	if t.direct != nil {
		t.direct.Close()
	}
	return t.f.Close()
}

// sync flushes written data and the disk's write cache with one fsync:
// fsync works on the file (or device), not the descriptor, so it covers
// the writes through the O_DIRECT descriptor too. Equivalent to:
// `sync TARGET`.
func (t *target) sync() error {
	if err := t.f.Sync(); err != nil {
		return fmt.Errorf("target %q: fsync: %w", t.path, err)
	}
	return nil
}

// directAlign is the alignment of O_DIRECT writes: buffer address, offset
// and length. 4096 covers 512-byte and 4Kn disks.
const directAlign = 4096

// writeAt writes b at off, through the O_DIRECT descriptor when b is
// aligned for it.
func (t *target) writeAt(b []byte, off int64) error {
	if t.directOK.Load() && off%directAlign == 0 && len(b)%directAlign == 0 && uintptr(unsafe.Pointer(unsafe.SliceData(b)))%directAlign == 0 {
		if _, err := t.direct.WriteAt(b, off); err == nil {
			return nil
		}
		// A stricter alignment than ours, or a filesystem that refuses
		// direct writes after all: write through the page cache from now on.
		t.directOK.Store(false)
	}
	if _, err := t.f.WriteAt(b, off); err != nil {
		return fmt.Errorf("target %q: write %d bytes at %d: %w", t.path, len(b), off, err)
	}
	return nil
}

// zero writes n zero bytes at off.
func (t *target) zero(ctx context.Context, off, n int64) error {
	buf := make([]byte, min(n, mib))
	for n > 0 {
		if err := ctx.Err(); err != nil {
			return err
		}
		k := min(n, int64(len(buf)))
		if _, err := t.f.WriteAt(buf[:k], off); err != nil {
			return fmt.Errorf("target %q: zero at %d: %w", t.path, off, err)
		}
		off += k
		n -= k
	}
	return nil
}

// invalidate zeroes the first MiB, so that a target whose laying failed
// holds no partition table and does not boot.
func (t *target) invalidate() error {
	size, err := t.f.Seek(0, io.SeekEnd)
	if err != nil {
		return err
	}
	if err := t.zero(context.Background(), 0, min(size, mib)); err != nil {
		return err
	}
	return t.sync()
}

// Offsets of the btrfs superblock mirrors, which lie outside the first and
// last MiB.
var btrfsMirrors = []int64{64 << 20, 256 << 30}

// wipeSignatures zeroes the first and last MiB and the btrfs mirrors, then
// syncs and asks the kernel to re-read the partition table.
func (t *target) wipeSignatures(ctx context.Context) error {
	size, err := t.f.Seek(0, io.SeekEnd)
	if err != nil {
		return fmt.Errorf("target %q: size: %w", t.path, err)
	}
	if err := t.zero(ctx, 0, min(size, mib)); err != nil {
		return err
	}
	if tail := max(size-mib, 0); size > 0 {
		if err := t.zero(ctx, tail, size-tail); err != nil {
			return err
		}
	}
	for _, off := range btrfsMirrors {
		if off+4096 <= size {
			if err := t.zero(ctx, off, 4096); err != nil {
				return err
			}
		}
	}
	if err := t.sync(); err != nil {
		return err
	}
	t.rereadPartitions()
	return nil
}
