//go:build !linux

package golden

import (
	"context"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Build needs Linux (debootstrap, mkfs.ext4, debugfs); elsewhere it
// returns NotSupported.
func Build(context.Context, Options) (*Result, error) {
	return nil, errdefs.NotSupported("golden: building an image needs Linux")
}
