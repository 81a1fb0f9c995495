//go:build !linux

package qemu

import (
	"context"
	"log/slog"
	"net"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// LabNetOptions describe a lab network (Linux only).
type LabNetOptions struct {
	Name, Bridge, Tap, Address, Address6, Dir string
	Logger                                    *slog.Logger
}

// LabNet is a lab network namespace (Linux only).
type LabNet struct{}

// NewLabNet returns NotSupported: network namespaces are Linux only.
func NewLabNet(context.Context, LabNetOptions) (*LabNet, error) {
	return nil, errdefs.NotSupported("lab network: network namespaces need Linux")
}

func (*LabNet) Name() string   { return "" }
func (*LabNet) Tap() string    { return "" }
func (*LabNet) Bridge() string { return "" }
func (*LabNet) IP() string     { return "" }
func (*LabNet) Listen(string) (net.Listener, error) {
	return nil, errdefs.NotSupported("lab network: Linux only")
}
func (*LabNet) Forward(string, string) error { return errdefs.NotSupported("lab network: Linux only") }
func (*LabNet) StartDnsmasq(context.Context, string) error {
	return errdefs.NotSupported("lab network: Linux only")
}
func (*LabNet) Close() error { return nil }
