//go:build !linux

package systemd

import (
	"context"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Manager talks to systemd; only on Linux.
type Manager struct{}

// Dial returns a NotSupported error: systemd runs only on Linux.
func Dial(context.Context, string) (*Manager, error) {
	return nil, errdefs.NotSupported("systemd: only on Linux")
}

// Close does nothing.
func (*Manager) Close() error { return nil }

// State is not supported.
func (*Manager) State(context.Context, string) (UnitState, error) {
	return UnitState{}, errdefs.NotSupported("systemd: only on Linux")
}

// Enable is not supported.
func (*Manager) Enable(context.Context, string) (bool, error) {
	return false, errdefs.NotSupported("systemd: only on Linux")
}

// Start is not supported.
func (*Manager) Start(context.Context, string) error {
	return errdefs.NotSupported("systemd: only on Linux")
}

// Restart is not supported.
func (*Manager) Restart(context.Context, string) error {
	return errdefs.NotSupported("systemd: only on Linux")
}
