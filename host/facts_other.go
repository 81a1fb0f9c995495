//go:build !linux

package host

import (
	"context"

	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// FactsWith is Facts with options. It is only supported on Linux.
func FactsWith(context.Context, FactsOptions) (*typesv1.Facts, error) {
	return nil, errdefs.NotSupported("host facts: only supported on Linux")
}
