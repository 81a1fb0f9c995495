package manifest

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// dataExtents lists the data extents of f with SEEK_DATA/SEEK_HOLE.
// Equivalent to: the lseek(SEEK_DATA)/lseek(SEEK_HOLE) walk of `cp --sparse=auto`.
// Filesystems without hole support report the whole file as data.
func dataExtents(f *os.File, size int64) ([]extent, error) {
	fd := int(f.Fd())
	var out []extent
	for off := int64(0); off < size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole remains
		}
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.EOPNOTSUPP) {
			return []extent{{0, size}}, nil
		}
		if err != nil {
			return nil, fmt.Errorf("seek data at %d: %w", off, err)
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return nil, fmt.Errorf("seek hole at %d: %w", data, err)
		}
		hole = min(hole, size)
		out = append(out, extent{data, hole})
		off = hole
	}
	return out, nil
}
