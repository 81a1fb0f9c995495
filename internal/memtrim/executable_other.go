//go:build !linux

package memtrim

import (
	"errors"
	"fmt"
)

// ReleaseExecutable drops the mappings of the clean, read-only pages of the
// program's executable on Linux (see its Linux documentation); elsewhere it
// returns an error wrapping errors.ErrUnsupported.
func ReleaseExecutable() (uint64, error) {
	return 0, fmt.Errorf("release executable pages: %w: needs Linux's /proc/self/smaps and madvise", errors.ErrUnsupported)
}
