//go:build !linux

package lay

import (
	"context"
	"fmt"
	"os"
)

const blockOpenFlags = os.O_RDWR

// openDirect: no O_DIRECT writes on this platform.
func openDirect(string) *os.File { return nil }

// discard truncates a file target (its blocks read as zeros afterwards)
// and grows it to rawSize. Block devices are not discarded on this
// platform: every block is written, zeros included.
func (t *target) discard(ctx context.Context, rawSize int64) (zeroed bool, note string, err error) {
	if err := ctx.Err(); err != nil {
		return false, "", err
	}
	if t.block {
		return false, "discard not supported on this platform: writing every block, zeros included", nil
	}
	size := max(t.size, rawSize)
	if err := t.f.Truncate(0); err != nil {
		return false, "", fmt.Errorf("target %q: truncate: %w", t.path, err)
	}
	if err := t.f.Truncate(size); err != nil {
		return false, "", fmt.Errorf("target %q: set size %d: %w", t.path, size, err)
	}
	t.size = size
	return true, "", nil
}

func (t *target) rereadPartitions() {}

// preallocate: block allocation happens as the target is written on this
// platform.
func (t *target) preallocate([][2]int64) {}
