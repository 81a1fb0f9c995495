//go:build !linux

package nspawn

import (
	"context"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Container is a system booted under systemd-nspawn; it needs Linux.
type Container struct{}

// Start returns NotSupported: systemd-nspawn needs Linux.
func Start(Options) (*Container, error) {
	return nil, errdefs.NotSupported("nspawn: needs Linux")
}

// Leader returns 0.
func (*Container) Leader() int { return 0 }

// WaitRunning returns NotSupported.
func (*Container) WaitRunning(context.Context) error {
	return errdefs.NotSupported("nspawn: needs Linux")
}

// Exec returns NotSupported.
func (*Container) Exec(context.Context, string, ...string) (string, error) {
	return "", errdefs.NotSupported("nspawn: needs Linux")
}

// Poweroff returns NotSupported.
func (*Container) Poweroff(context.Context) error { return errdefs.NotSupported("nspawn: needs Linux") }

// Stop does nothing.
func (*Container) Stop(context.Context) error { return nil }

// Cgroups is a cgroup of one name in every hierarchy; none without Linux.
type Cgroups struct {
	Dirs []string
}

// NewCgroups returns no cgroups.
func NewCgroups(string) Cgroups { return Cgroups{} }

// Create returns NotSupported.
func (Cgroups) Create() ([]string, error) { return nil, errdefs.NotSupported("nspawn: needs Linux") }

// Remove does nothing.
func (Cgroups) Remove() error { return nil }

// LeaderOf returns 0.
func LeaderOf(int) int { return 0 }

// Name is the machine name.
func (*Container) Name() string { return "" }

// PID returns 0.
func (*Container) PID() int { return 0 }

// Cgroups returns none.
func (*Container) Cgroups() Cgroups { return Cgroups{} }

// ConsoleLog returns "".
func (*Container) ConsoleLog() string { return "" }

// ConsoleTail returns "".
func (*Container) ConsoleTail(int) string { return "" }

// Done returns a closed channel: nothing runs.
func (*Container) Done() <-chan struct{} {
	ch := make(chan struct{})
	close(ch)
	return ch
}

// Kill does nothing.
func (Cgroups) Kill() {}

// Hierarchies returns none.
func Hierarchies() []string { return nil }

// KillCgroup does nothing.
func KillCgroup(string) {}

// RemoveCgroup returns NotSupported.
func RemoveCgroup(string) error { return errdefs.NotSupported("nspawn: needs Linux") }
