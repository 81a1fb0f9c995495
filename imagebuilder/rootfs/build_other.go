//go:build !linux

package rootfs

import (
	"context"
	"io"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Build needs Linux (debootstrap); elsewhere it returns NotSupported.
func Build(context.Context, Spec, io.Writer) (string, error) {
	return "", errdefs.NotSupported("rootfs: building a Debian root needs Linux")
}

// Overlay needs Linux; elsewhere it returns NotSupported.
func Overlay(context.Context, string, string, []File) error {
	return errdefs.NotSupported("rootfs: overlay needs Linux")
}
