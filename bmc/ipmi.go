package bmc

import (
	"context"

	"github.com/bmc-toolbox/bmclib/v2/providers/ipmitool"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// ipmiCipherSuite is passed to ipmitool as -C: without it every call
// stalls about 10 s trying suite 17 first, which ipmi_sim (and many BMCs)
// refuse.
const ipmiCipherSuite = "3"

// ipmiDriver drives an IPMI BMC through bmclib's ipmitool provider only
// (`ipmitool -I lanplus -C 3`, password passed in the environment, never on
// the command line). Its Open is not called: it only reads the power
// state, which every operation does anyway when it needs to.
type ipmiDriver struct {
	conn *ipmitool.Conn
}

var _ driver = (*ipmiDriver)(nil)

func newIPMIDriver(ep Endpoint, opts Options) (*ipmiDriver, error) {
	host, port, err := splitIPMIAddress(ep.Address)
	if err != nil {
		return nil, err
	}
	conn, err := ipmitool.New(host, ep.Username, ep.Password,
		ipmitool.WithPort(port),
		ipmitool.WithCipherSuite(ipmiCipherSuite),
		ipmitool.WithIpmitoolPath(opts.IpmitoolPath))
	if err != nil {
		return nil, errdefs.FailedPrecondition("ipmi bmc %s: ipmitool not usable: %v", opts.Name, err)
	}
	return &ipmiDriver{conn: conn}, nil
}

// Equivalent to: `ipmitool -I lanplus -C 3 -H HOST -p PORT -U USER -E chassis power status`.
func (d *ipmiDriver) powerState(ctx context.Context) (string, error) {
	return d.conn.PowerStateGet(ctx)
}

// Equivalent to: `ipmitool ... chassis power on|off|soft`.
func (d *ipmiDriver) setPower(ctx context.Context, action string) error {
	ok, err := d.conn.PowerSet(ctx, action)
	if err == nil && !ok {
		return errdefs.Unavailable("the bmc did not accept power %s", action)
	}
	return err
}

// Equivalent to: `ipmitool ... chassis bootdev pxe|disk|cdrom [options=persistent,efiboot]`.
func (d *ipmiDriver) setBoot(ctx context.Context, device string, persistent, efi bool) error {
	ok, err := d.conn.BootDeviceSet(ctx, device, persistent, efi)
	if err == nil && !ok {
		return errdefs.Unavailable("the bmc did not accept boot device %s", device)
	}
	return err
}

func (d *ipmiDriver) bootPersistent(context.Context) (bool, error) {
	return false, errdefs.NotSupported("ipmi: reading the boot override back is not supported")
}

func (d *ipmiDriver) setMedia(context.Context, string) error {
	return errdefs.NotSupported("ipmi has no virtual media")
}

func (d *ipmiDriver) inventory(context.Context) (Inventory, error) {
	return Inventory{}, errdefs.NotSupported("ipmi inventory is not supported")
}

func (d *ipmiDriver) mediaSlots(context.Context) ([]MediaSlot, error) {
	return nil, nil
}
