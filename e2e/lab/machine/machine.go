// Package machine is the lab's model of a host's power and boot hardware:
// the small interface every emulated BMC (Redfish emulator, ipmi_sim chassis
// program) drives, and the simplest backends behind it. Other backends
// (network-namespace/nspawn hosts, QEMU, libvirt) implement the same
// interface.
//
// A Machine knows three things a BMC can change: whether it is powered,
// what it booted from, and which virtual media is inserted. Boot devices use
// the lab's canonical names: "pxe", "cd" and "disk".
package machine

import (
	"context"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Boot devices a Machine understands.
const (
	BootPXE  = "pxe"
	BootCD   = "cd"
	BootDisk = "disk"
)

// Machine is what an emulated BMC controls. Implementations are safe for
// concurrent use. PowerOn, hard PowerOff and Reset should return once the
// change is made (a process started or killed), not wait for an OS to
// boot: BMC emulators call them while answering a request, and ipmi_sim is
// single-threaded.
type Machine interface {
	// PowerOn powers the machine on and boots it from bootDevice ("pxe",
	// "cd" or "disk"). Powering on a machine that is on is a no-op.
	PowerOn(ctx context.Context, bootDevice string) error
	// PowerOff powers the machine off: graceful asks the OS to shut down and
	// waits for it (bounded by ctx, then forces), otherwise power is cut.
	// Powering off a machine that is off is a no-op.
	PowerOff(ctx context.Context, graceful bool) error
	// Reset restarts a running machine from the same boot device (a warm
	// reset). On a machine that is off it returns a FailedPrecondition error.
	Reset(ctx context.Context) error
	// State reports whether the machine is powered on.
	State() (on bool)
	// InsertMedia puts url in the virtual CD drive; "" ejects it.
	InsertMedia(url string) error
	// BootSource is the device of the current (or last) power-on, "" if it
	// never ran.
	BootSource() string
}

// ValidBootDevice reports an InvalidArgument error unless dev is one of the
// lab's boot devices.
func ValidBootDevice(dev string) error {
	switch dev {
	case BootPXE, BootCD, BootDisk:
		return nil
	}
	return errdefs.InvalidArgument("boot device %q: want pxe, cd or disk", dev)
}
