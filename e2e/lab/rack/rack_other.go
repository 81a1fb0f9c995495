//go:build !linux

package rack

import (
	"context"
	"log/slog"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Up needs Linux; elsewhere it returns NotSupported.
func Up(context.Context, Options) (*Report, error) {
	return nil, errdefs.NotSupported("lab: needs Linux (network namespaces)")
}

// Serve needs Linux; elsewhere it returns NotSupported.
func Serve(context.Context, string, *slog.Logger) error {
	return errdefs.NotSupported("lab: needs Linux (network namespaces)")
}

// Down needs Linux; elsewhere it returns NotSupported.
func Down(context.Context, string, *slog.Logger) error {
	return errdefs.NotSupported("lab: needs Linux (network namespaces)")
}
