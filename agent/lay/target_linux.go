package lay

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// blockOpenFlags opens a block device exclusively: the kernel refuses it
// (EBUSY) while it is mounted or otherwise held.
const blockOpenFlags = os.O_RDWR | unix.O_EXCL

// openDirect opens path for O_DIRECT writes, or returns nil where the
// filesystem does not support them.
func openDirect(path string) *os.File {
	f, err := os.OpenFile(path, os.O_WRONLY|unix.O_DIRECT, 0)
	if err != nil {
		return nil
	}
	return f
}

// discard makes the whole target read as zeros where it can, growing a
// file target to rawSize first. It reports whether the target now reads
// as zeros (so all-zero blocks need not be written) and a note when it
// fell back.
//
// For a file: Equivalent to: `fallocate --punch-hole --keep-size TARGET`.
// For a block device: Equivalent to: `blkdiscard TARGET`.
func (t *target) discard(ctx context.Context, rawSize int64) (zeroed bool, note string, err error) {
	if err := ctx.Err(); err != nil {
		return false, "", err
	}
	fd := int(t.f.Fd())
	if !t.block {
		if t.size > 0 {
			if err := unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, t.size); err != nil {
				// The same effect for a file: drop all its blocks.
				if err := t.f.Truncate(0); err != nil {
					return false, "", fmt.Errorf("target %q: truncate: %w", t.path, err)
				}
				note = fmt.Sprintf("hole punching not supported (%v): truncated the file instead", err)
			}
		}
		if size := max(t.size, rawSize); size > 0 {
			if err := t.f.Truncate(size); err != nil {
				return false, "", fmt.Errorf("target %q: set size %d: %w", t.path, size, err)
			}
			t.size = size
		}
		return true, note, nil
	}
	rng := [2]uint64{0, uint64(t.size)}
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.BLKDISCARD, uintptr(unsafe.Pointer(&rng[0]))); errno != 0 {
		return false, fmt.Sprintf("discard not supported (%v): writing every block, zeros included", errno), nil
	}
	if !t.readsZero() {
		return false, "discarded blocks do not read back as zeros: writing every block, zeros included", nil
	}
	return true, "", nil
}

// preallocate allocates the blocks of a file target's ranges before they
// are written, as unwritten extents (they read as zeros until written):
// one fallocate per range up front instead of block allocation inside
// every O_DIRECT write, which on ext4 serialises the parallel writers on
// the inode's block map. Best effort: a filesystem that cannot fallocate
// allocates as it writes, as before. Block devices need nothing.
// Equivalent to: `fallocate --keep-size -o OFF -l LEN TARGET` per range.
func (t *target) preallocate(ranges [][2]int64) {
	if t.block {
		return
	}
	fd := int(t.f.Fd())
	for _, r := range ranges {
		if err := unix.Fallocate(fd, unix.FALLOC_FL_KEEP_SIZE, r[0], r[1]); err != nil {
			return
		}
	}
}

// readsZero samples the device after a discard: 16 blocks spread over it
// must read as zeros before zero blocks are skipped.
func (t *target) readsZero() bool {
	buf := make([]byte, 4096)
	zero := make([]byte, 4096)
	for i := int64(0); i < 16; i++ {
		off := (t.size - 4096) / 15 * i / 4096 * 4096
		if _, err := t.f.ReadAt(buf, off); err != nil || !bytes.Equal(buf, zero) {
			return false
		}
	}
	return true
}

// rereadPartitions asks the kernel to re-read a block device's partition
// table, best effort. Equivalent to: `blockdev --rereadpt TARGET`.
func (t *target) rereadPartitions() {
	if t.block {
		_ = unix.IoctlSetInt(int(t.f.Fd()), unix.BLKRRPART, 0)
	}
}
