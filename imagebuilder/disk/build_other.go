//go:build !linux

package disk

import (
	"context"
	"io"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Build needs Linux tools (sfdisk, mkfs.ext4); elsewhere it returns
// NotSupported.
func Build(context.Context, Spec, io.Writer) (*Layout, error) {
	return nil, errdefs.NotSupported("disk: building disk images needs Linux")
}
