//go:build !linux

package netns

import (
	"context"

	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// Machine is a network-namespace host; it needs Linux.
type Machine struct{}

var _ machine.Machine = (*Machine)(nil)

// New returns NotSupported: network-namespace hosts need Linux.
func New(context.Context, Options) (*Machine, error) {
	return nil, errdefs.NotSupported("netns machine: needs Linux")
}

// PowerOn implements machine.Machine.
func (*Machine) PowerOn(context.Context, string) error {
	return errdefs.NotSupported("netns machine: needs Linux")
}

// PowerOff implements machine.Machine.
func (*Machine) PowerOff(context.Context, bool) error {
	return errdefs.NotSupported("netns machine: needs Linux")
}

// Reset implements machine.Machine.
func (*Machine) Reset(context.Context) error {
	return errdefs.NotSupported("netns machine: needs Linux")
}

// State implements machine.Machine.
func (*Machine) State() bool { return false }

// InsertMedia implements machine.Machine.
func (*Machine) InsertMedia(string) error { return errdefs.NotSupported("netns machine: needs Linux") }

// BootSource implements machine.Machine.
func (*Machine) BootSource() string { return "" }

// Close does nothing.
func (*Machine) Close(context.Context) error { return nil }

// Remove returns NotSupported.
func Remove(context.Context, Resource) error { return errdefs.NotSupported("netns: needs Linux") }

// ProcessAlive reports false.
func ProcessAlive(string) bool { return false }
