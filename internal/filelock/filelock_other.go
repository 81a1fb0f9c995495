//go:build !unix

package filelock

import (
	"context"

	"github.com/kilnhq/kiln/internal/errdefs"
)

func lock(_ context.Context, path string) (func(), error) {
	return nil, errdefs.NotSupported("lock %s: no flock on this system", path)
}
