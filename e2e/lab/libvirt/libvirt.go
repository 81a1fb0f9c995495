// Package libvirt is the lab's libvirt machine backend: a VM defined in a
// running libvirtd (qemu:///system over its unix socket, through
// go-libvirt) behind the lab's machine.Machine interface, so the Redfish
// emulator and the ipmi_sim chassis program drive it like a server. It is
// the backend for labs that already run libvirtd; the qemu backend needs
// no daemon at all.
//
// The domain is defined once (New) from libvirtxml: TCG (`type='qemu'`)
// unless KVM is asked for, SeaBIOS with its console on the serial port or
// UEFI (OVMF), a raw virtio disk, an empty SATA CD drive and a virtio NIC
// on user-mode networking, a bridge or a libvirt network. Power on
// rewrites each device's `<boot order>` so the requested device is first
// and starts the domain; power off is an ACPI shutdown bounded by a grace
// period, then destroy; virtual media is a live update of the CD drive's
// source to a local file (http(s) URLs are downloaded into the VM's
// directory first). Close destroys and undefines the domain.
package libvirt

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	golibvirt "github.com/digitalocean/go-libvirt"
	"github.com/digitalocean/go-libvirt/socket/dialers"
	"libvirt.org/go/libvirtxml"

	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/internal/atomicfile"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// DefaultSocket is libvirtd's read-write unix socket (qemu:///system).
const DefaultSocket = "/run/libvirt/libvirt-sock"

// Network attaches the VM's NIC. The zero value is user-mode networking
// (the guest reaches the host's loopback as 10.0.2.2).
type Network struct {
	// Bridge puts the NIC on an existing Linux bridge (`<interface
	// type='bridge'>`).
	Bridge string
	// Network puts the NIC on a libvirt network (`<interface
	// type='network'>`), e.g. "default".
	Network string
}

// Options configure a libvirt VM.
type Options struct {
	// Name of the libvirt domain; required. New refuses a name that is
	// already defined.
	Name string
	// Dir holds the VM's files (serial log, blank disk, UEFI variables,
	// downloaded media); required. QEMU must be able to reach it: run
	// QEMU as root (RunAsRoot) or make the path traversable by
	// libvirt-qemu.
	Dir string
	// Disk is a raw disk image; "" creates a sparse blank DiskSize disk
	// (default 1 GiB) in Dir.
	Disk     string
	DiskSize int64
	// MAC of the NIC (default 52:54:00:4b:69:21).
	MAC string
	// MemoryMB (default 1024) and CPUs (default 1).
	MemoryMB, CPUs int
	// KVM defines a `type='kvm'` domain; the default is TCG (`type='qemu'`).
	KVM bool
	// UEFI boots with OVMF (UEFICode read-only, variables copied from
	// UEFIVars into Dir by libvirt) instead of SeaBIOS.
	UEFI bool
	// UEFICode and UEFIVars default to Debian's ovmf package.
	UEFICode, UEFIVars string
	// Network of the NIC.
	Network Network
	// RunAsRoot runs QEMU as root without relabelling its files
	// (`<seclabel type='static' model='dac' relabel='no'>` with label
	// +0:+0) instead of libvirt's default user (libvirt-qemu), for labs
	// whose directories that user cannot read (test temp dirs are 0700).
	RunAsRoot bool
	// Socket is libvirtd's unix socket (default DefaultSocket) and URI
	// the connection URI (default qemu:///system).
	Socket, URI string
	// GracePeriod bounds a graceful power-off before the domain is
	// destroyed (default 60s, or the caller's ctx).
	GracePeriod time.Duration
	// Logger receives lifecycle messages; nil discards them.
	Logger *slog.Logger
}

// VM is a libvirt domain behind machine.Machine. It is defined (not
// running) from New until Close.
type VM struct {
	o      Options
	log    *slog.Logger
	serial string

	mu    sync.Mutex
	lv    *golibvirt.Libvirt
	dom   golibvirt.Domain
	def   *libvirtxml.Domain
	boot  string
	media string // local path in the CD drive, "" when empty
	nfile int
	// attached: the domain existed before (Attach); it is redefined
	// only in its boot order and CD source, and Close leaves it defined.
	attached bool
	// nextBoot picks the device after a reset (SetNextBoot);
	// stopEvents ends its event subscription.
	nextBoot   func() string
	stopEvents context.CancelFunc
}

var _ machine.Machine = (*VM)(nil)

// Device targets of the domain.
const (
	diskTarget = "vda"
	cdTarget   = "sda"
)

// Dial connects to libvirtd at socket with uri (qemu:///system when "").
// Equivalent to `virsh -c 'qemu:///system?socket=SOCKET' version`.
func Dial(socket, uri string) (*golibvirt.Libvirt, error) {
	if socket == "" {
		socket = DefaultSocket
	}
	if uri == "" {
		uri = string(golibvirt.QEMUSystem)
	}
	lv := golibvirt.NewWithDialer(dialers.NewLocal(dialers.WithSocket(socket), dialers.WithLocalTimeout(5*time.Second)))
	if err := lv.ConnectToURI(golibvirt.ConnectURI(uri)); err != nil {
		return nil, errdefs.Unavailable("libvirt: libvirtd not reachable at %s (install libvirt-daemon-system and start libvirtd): %v", socket, err)
	}
	return lv, nil
}

// New connects to libvirtd and defines a powered-off domain. It creates
// the blank disk when Options.Disk is empty.
func New(o Options) (*VM, error) {
	if o.Name == "" || o.Dir == "" {
		return nil, errdefs.InvalidArgument("libvirt: a name and a directory are required")
	}
	if o.MAC == "" {
		o.MAC = "52:54:00:4b:69:21"
	}
	if o.MemoryMB <= 0 {
		o.MemoryMB = 1024
	}
	if o.CPUs <= 0 {
		o.CPUs = 1
	}
	if o.GracePeriod <= 0 {
		o.GracePeriod = time.Minute
	}
	if o.Socket == "" {
		o.Socket = DefaultSocket
	}
	if o.UEFI {
		if o.UEFICode == "" {
			o.UEFICode = "/usr/share/OVMF/OVMF_CODE_4M.fd"
		}
		if o.UEFIVars == "" {
			o.UEFIVars = "/usr/share/OVMF/OVMF_VARS_4M.fd"
		}
		for _, f := range []string{o.UEFICode, o.UEFIVars} {
			if _, err := os.Stat(f); err != nil {
				return nil, errdefs.NotFound("libvirt: UEFI firmware %s not found (apt-get install ovmf)", f)
			}
		}
	}
	if err := os.MkdirAll(o.Dir, 0o755); err != nil {
		return nil, fmt.Errorf("libvirt: %w", err)
	}
	if o.Disk == "" {
		if o.DiskSize <= 0 {
			o.DiskSize = 1 << 30
		}
		o.Disk = filepath.Join(o.Dir, "disk.raw")
		if err := sparseFile(o.Disk, o.DiskSize); err != nil {
			return nil, fmt.Errorf("libvirt: disk: %w", err)
		}
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	v := &VM{
		o:      o,
		log:    log.With("component", "libvirt", "vm", o.Name),
		serial: filepath.Join(o.Dir, "serial.log"),
	}
	v.def = v.domainXML(machine.BootDisk)

	lv, err := Dial(o.Socket, o.URI)
	if err != nil {
		return nil, err
	}
	if _, err := lv.DomainLookupByName(o.Name); err == nil {
		_ = lv.Disconnect()
		return nil, errdefs.AlreadyExists("libvirt: domain %q is already defined (virsh undefine %s)", o.Name, o.Name)
	}
	v.lv = lv
	if err := v.defineLocked(); err != nil {
		_ = lv.Disconnect()
		return nil, err
	}
	v.log.Info("domain defined", "type", v.def.Type, "uefi", o.UEFI)
	return v, nil
}

func sparseFile(path string, size int64) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return err
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// bootOrder is the `<boot order>` of each device when dev boots first;
// the other devices keep the order disk, NIC, CD.
func bootOrder(dev string) map[string]uint {
	order := map[string]uint{}
	n := uint(1)
	order[dev] = n
	for _, d := range []string{machine.BootDisk, machine.BootPXE, machine.BootCD} {
		if d != dev {
			n++
			order[d] = n
		}
	}
	return order
}

// domainXML builds the domain definition with bootDevice first.
func (v *VM) domainXML(bootDevice string) *libvirtxml.Domain {
	o := v.o
	typ := "qemu"
	if o.KVM {
		typ = "kvm"
	}
	order := bootOrder(bootDevice)
	port := uint(0)
	d := &libvirtxml.Domain{
		Type:   typ,
		Name:   o.Name,
		Memory: &libvirtxml.DomainMemory{Value: uint(o.MemoryMB), Unit: "MiB"},
		VCPU:   &libvirtxml.DomainVCPU{Value: uint(o.CPUs)},
		OS: &libvirtxml.DomainOS{
			Type: &libvirtxml.DomainOSType{Arch: "x86_64", Machine: "q35", Type: "hvm"},
		},
		Features:   &libvirtxml.DomainFeatureList{ACPI: &libvirtxml.DomainFeature{}},
		OnPoweroff: "destroy",
		OnReboot:   "restart",
		OnCrash:    "destroy",
		Devices: &libvirtxml.DomainDeviceList{
			Disks: []libvirtxml.DomainDisk{
				{
					Device: "disk",
					Driver: &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "raw"},
					Source: &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: o.Disk}},
					Target: &libvirtxml.DomainDiskTarget{Dev: diskTarget, Bus: "virtio"},
					Boot:   &libvirtxml.DomainDeviceBoot{Order: order[machine.BootDisk]},
				},
				v.cdrom(order[machine.BootCD]),
			},
			Interfaces: []libvirtxml.DomainInterface{{
				MAC:    &libvirtxml.DomainInterfaceMAC{Address: o.MAC},
				Source: interfaceSource(o.Network),
				Model:  &libvirtxml.DomainInterfaceModel{Type: "virtio"},
				Boot:   &libvirtxml.DomainDeviceBoot{Order: order[machine.BootPXE]},
			}},
			Serials: []libvirtxml.DomainSerial{{
				Source: &libvirtxml.DomainChardevSource{File: &libvirtxml.DomainChardevSourceFile{Path: v.serial, Append: "on"}},
				Target: &libvirtxml.DomainSerialTarget{Port: &port},
			}},
		},
	}
	if o.UEFI {
		d.OS.Loader = &libvirtxml.DomainLoader{Path: o.UEFICode, Readonly: "yes", Type: "pflash"}
		d.OS.NVRam = &libvirtxml.DomainNVRam{NVRam: filepath.Join(o.Dir, "efivars.fd"), Template: o.UEFIVars}
	} else {
		// SeaBIOS mirrors its console (and iPXE's, GRUB's) to the serial port.
		d.OS.BIOS = &libvirtxml.DomainBIOS{UseSerial: "yes"}
	}
	if o.RunAsRoot {
		d.SecLabel = []libvirtxml.DomainSecLabel{{Type: "static", Model: "dac", Relabel: "no", Label: "+0:+0"}}
	}
	return d
}

func interfaceSource(n Network) *libvirtxml.DomainInterfaceSource {
	switch {
	case n.Bridge != "":
		return &libvirtxml.DomainInterfaceSource{Bridge: &libvirtxml.DomainInterfaceSourceBridge{Bridge: n.Bridge}}
	case n.Network != "":
		return &libvirtxml.DomainInterfaceSource{Network: &libvirtxml.DomainInterfaceSourceNetwork{Network: n.Network}}
	}
	return &libvirtxml.DomainInterfaceSource{User: &libvirtxml.DomainInterfaceSourceUser{}}
}

// cdrom is the CD drive's definition holding v.media (empty when "").
func (v *VM) cdrom(order uint) libvirtxml.DomainDisk {
	d := libvirtxml.DomainDisk{
		Device:   "cdrom",
		Driver:   &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "raw"},
		Target:   &libvirtxml.DomainDiskTarget{Dev: cdTarget, Bus: "sata"},
		ReadOnly: &libvirtxml.DomainDiskReadOnly{},
		Boot:     &libvirtxml.DomainDeviceBoot{Order: order},
	}
	if v.media != "" {
		d.Source = &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: v.media}}
	}
	return d
}

// defineLocked (re)defines the persistent domain from v.def. Equivalent
// to `virsh define DOMAIN.xml`.
func (v *VM) defineLocked() error {
	x, err := v.def.Marshal()
	if err != nil {
		return fmt.Errorf("libvirt: domain XML: %w", err)
	}
	dom, err := v.lv.DomainDefineXML(x)
	if err != nil {
		return fmt.Errorf("libvirt: define %s: %w", v.o.Name, err)
	}
	v.dom = dom
	// Later definitions replace this domain: libvirt matches them by UUID.
	v.def.UUID = uuidString(dom.UUID)
	return nil
}

func uuidString(u golibvirt.UUID) string {
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

// SerialLog is the path of the file that receives the VM's serial
// console (ttyS0), appended across boots.
func (v *VM) SerialLog() string { return v.serial }

// Name is the libvirt domain's name.
func (v *VM) Name() string { return v.o.Name }

// XML is the domain's live definition (the persistent one when off).
// Equivalent to `virsh dumpxml NAME`.
func (v *VM) XML() (string, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.lv == nil {
		return "", errdefs.FailedPrecondition("libvirt: %s is closed", v.o.Name)
	}
	x, err := v.lv.DomainGetXMLDesc(v.dom, 0)
	if err != nil {
		return "", fmt.Errorf("libvirt: dumpxml %s: %w", v.o.Name, err)
	}
	return x, nil
}

// stateLocked reports whether the domain is powered: running, blocked,
// paused, suspended or shutting down are on; shut off, crashed and no
// state are off. Equivalent to `virsh domstate NAME`.
func (v *VM) stateLocked() (bool, error) {
	if v.lv == nil {
		return false, errdefs.FailedPrecondition("libvirt: %s is closed", v.o.Name)
	}
	st, _, err := v.lv.DomainGetState(v.dom, 0)
	if err != nil {
		return false, fmt.Errorf("libvirt: state of %s: %w", v.o.Name, err)
	}
	switch golibvirt.DomainState(st) {
	case golibvirt.DomainShutoff, golibvirt.DomainCrashed, golibvirt.DomainNostate:
		return false, nil
	}
	return true, nil
}

// PowerOn implements machine.Machine: it redefines the domain with
// bootDevice first in the boot order and starts it. Equivalent to
// `virsh define` (with `<boot order='1'/>` on the device) and `virsh start`.
func (v *VM) PowerOn(ctx context.Context, bootDevice string) error {
	if err := machine.ValidBootDevice(bootDevice); err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	on, err := v.stateLocked()
	if err != nil {
		return err
	}
	if on {
		return nil
	}
	return v.startLocked(bootDevice)
}

// startLocked redefines the domain with bootDevice first and starts it.
func (v *VM) startLocked(bootDevice string) error {
	if v.attached {
		def, err := v.persistentLocked()
		if err != nil {
			return err
		}
		if err := setBootDevice(def, bootDevice); err != nil {
			return fmt.Errorf("libvirt: %s: %w", v.o.Name, err)
		}
		v.def = def
	} else {
		uuid := v.def.UUID
		v.def = v.domainXML(bootDevice)
		v.def.UUID = uuid
	}
	if err := v.defineLocked(); err != nil {
		return err
	}
	if err := v.lv.DomainCreate(v.dom); err != nil {
		return fmt.Errorf("libvirt: start %s: %w", v.o.Name, err)
	}
	v.boot = bootDevice
	v.log.Info("powered on", "boot", bootDevice)
	return nil
}

// SetNextBoot sets how the domain picks its boot device when it resets
// while running (its OS reboots it, or `virsh reset`): a BMC's choice (a
// one-time override consumed, else the persistent setting). QEMU keeps a
// running domain's boot order across a reset, so a BMC's boot override
// set while the domain ran would never be seen; firmware reads it at
// every POST. So when next names another device than the one the domain
// runs from, the domain is powered off and started again from that
// device (a reset that keeps the device is left alone). Without it a
// reset boots the same device again. Equivalent to watching `virsh event
// --event reboot` and then `virsh destroy`, `virsh define`, `virsh start`.
// It returns Unavailable when libvirtd refuses the event subscription.
func (v *VM) SetNextBoot(next func() string) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.lv == nil {
		return errdefs.FailedPrecondition("libvirt: %s is closed", v.o.Name)
	}
	v.nextBoot = next
	if v.stopEvents != nil || next == nil {
		return nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	events, err := v.lv.SubscribeEvents(ctx, golibvirt.DomainEventIDReboot, golibvirt.OptDomain{})
	if err != nil {
		cancel()
		return errdefs.Unavailable("libvirt: reboot events of %s: %v", v.o.Name, err)
	}
	v.stopEvents = cancel
	uuid := v.dom.UUID
	go func() {
		for ev := range events {
			if m, ok := ev.(*golibvirt.DomainEventCallbackRebootMsg); ok && m.Msg.Dom.UUID == uuid {
				v.reset()
			}
		}
	}()
	return nil
}

// reset boots the domain from the device nextBoot picks after it reset.
func (v *VM) reset() {
	v.mu.Lock()
	next := v.nextBoot
	v.mu.Unlock()
	if next == nil {
		return
	}
	dev := next()
	if machine.ValidBootDevice(dev) != nil {
		return
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.lv == nil || dev == v.boot {
		return
	}
	if on, err := v.stateLocked(); err != nil || !on {
		return
	}
	v.log.Info("domain reset: starting it again from the device its BMC sets", "from", v.boot, "boot", dev)
	if err := v.destroyLocked(); err != nil {
		v.log.Warn("reset to another boot device failed", "boot", dev, "error", err)
		return
	}
	if err := v.startLocked(dev); err != nil {
		v.log.Warn("reset to another boot device failed", "boot", dev, "error", err)
		return
	}
	v.keepRunningLocked(dev)
}

// resetSettle is how long reset watches a domain it started again, and
// resetStarts how often it starts it when libvirt stops it meanwhile.
const (
	resetSettle = 3 * time.Second
	resetStarts = 3
)

// keepRunningLocked watches a domain reset just started from dev for
// resetSettle and starts it again when it went off: libvirtd may handle
// the old QEMU's shutdown (its SIGTERM from the destroy) after the new
// QEMU is up, and then stops the new one (seen under load in CI: the
// domain "is not running" a moment after its reset). A powered-on
// server whose firmware reset stays on.
func (v *VM) keepRunningLocked(dev string) {
	for starts := 1; ; {
		deadline := time.Now().Add(resetSettle)
		on := true
		for time.Now().Before(deadline) {
			var err error
			if on, err = v.stateLocked(); err != nil || !on {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if on {
			return
		}
		if starts >= resetStarts {
			v.log.Warn("domain went off after its reset; left off", "boot", dev, "starts", starts)
			return
		}
		starts++
		v.log.Warn("domain went off right after its reset (libvirtd stopped the new QEMU); starting it again", "boot", dev)
		if err := v.startLocked(dev); err != nil {
			v.log.Warn("reset to another boot device failed", "boot", dev, "error", err)
			return
		}
	}
}

// PowerOff implements machine.Machine. Graceful presses the ACPI power
// button and waits for the guest to power off, up to GracePeriod or ctx,
// then destroys the domain; hard off destroys it at once. Equivalent to
// `virsh shutdown --mode acpi NAME` and `virsh destroy NAME`.
func (v *VM) PowerOff(ctx context.Context, graceful bool) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	on, err := v.stateLocked()
	if err != nil || !on {
		return err
	}
	if graceful {
		if err := v.lv.DomainShutdownFlags(v.dom, golibvirt.DomainShutdownAcpiPowerBtn); err != nil {
			return fmt.Errorf("libvirt: shutdown %s: %w", v.o.Name, err)
		}
		wctx, cancel := context.WithTimeout(ctx, v.o.GracePeriod)
		defer cancel()
		for {
			if on, err := v.stateLocked(); err == nil && !on {
				v.log.Info("shut down")
				return nil
			}
			select {
			case <-time.After(200 * time.Millisecond):
				continue
			case <-wctx.Done():
			}
			break
		}
		v.log.Warn("guest did not shut down; destroying the domain")
	}
	if err := v.destroyLocked(); err != nil {
		return err
	}
	v.log.Info("powered off")
	return nil
}

// destroyLocked cuts power; a domain that went off meanwhile is fine.
func (v *VM) destroyLocked() error {
	if err := v.lv.DomainDestroy(v.dom); err != nil {
		if on, serr := v.stateLocked(); serr == nil && !on {
			return nil
		}
		return fmt.Errorf("libvirt: destroy %s: %w", v.o.Name, err)
	}
	return nil
}

// Reset implements machine.Machine. Equivalent to `virsh reset NAME`.
func (v *VM) Reset(ctx context.Context) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	on, err := v.stateLocked()
	if err != nil {
		return err
	}
	if !on {
		return errdefs.FailedPrecondition("reset: machine is off")
	}
	if err := v.lv.DomainReset(v.dom, 0); err != nil {
		return fmt.Errorf("libvirt: reset %s: %w", v.o.Name, err)
	}
	return nil
}

// State implements machine.Machine. An error asking libvirtd reads as
// off (and is logged).
func (v *VM) State() bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	on, err := v.stateLocked()
	if err != nil {
		v.log.Warn("domain state failed", "error", err)
		return false
	}
	return on
}

// BootSource implements machine.Machine.
func (v *VM) BootSource() string {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.boot
}

// Media is the local file in the CD drive ("" when empty): the path
// InsertMedia was given, or the download of its http(s) URL.
func (v *VM) Media() string {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.media
}

// mediaTimeout bounds the download of an http(s) media URL.
const mediaTimeout = 10 * time.Minute

// InsertMedia implements machine.Machine: a local path, a file:// URL or
// an http(s):// URL (downloaded into Dir first: libvirt reads media from
// the host's files) goes into the CD drive; "" ejects. A running domain
// gets the change live and in its definition. Equivalent to `virsh
// change-media NAME sda FILE --update --live --config` (`--eject`).
func (v *VM) InsertMedia(rawURL string) error {
	path, err := v.localMedia(rawURL)
	if err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.lv == nil {
		return errdefs.FailedPrecondition("libvirt: %s is closed", v.o.Name)
	}
	on, err := v.stateLocked()
	if err != nil {
		return err
	}
	if v.attached {
		return v.insertAttachedLocked(rawURL, path, on)
	}
	prev := v.media
	v.media = path
	cd := v.cdrom(bootOrder(v.bootOrDisk())[machine.BootCD])
	for i := range v.def.Devices.Disks {
		if v.def.Devices.Disks[i].Device == "cdrom" {
			v.def.Devices.Disks[i] = cd
		}
	}
	if !on {
		if err := v.defineLocked(); err != nil {
			v.removeDownload(path)
			v.media = prev
			return err
		}
	} else {
		x, err := cd.Marshal()
		if err != nil {
			return fmt.Errorf("libvirt: cdrom XML: %w", err)
		}
		flags := golibvirt.DomainDeviceModifyLive | golibvirt.DomainDeviceModifyConfig
		err = v.lv.DomainUpdateDeviceFlags(v.dom, x, flags)
		// A live media change opens the drive's tray first; on a loaded
		// machine QEMU can refuse the removal with "Tray of device ... is
		// not open" because the tray has not opened yet. Give it a few
		// seconds, as a person at a BMC would retry.
		for i := 0; err != nil && i < 20 && strings.Contains(err.Error(), "is not open"); i++ {
			time.Sleep(250 * time.Millisecond)
			err = v.lv.DomainUpdateDeviceFlags(v.dom, x, flags)
		}
		if err != nil {
			v.removeDownload(path)
			v.media = prev
			return fmt.Errorf("libvirt: insert media %s: %w", redact(rawURL), err)
		}
	}
	if prev != path {
		v.removeDownload(prev)
	}
	if path == "" {
		v.log.Info("media ejected")
	} else {
		v.log.Info("media inserted", "url", redact(rawURL), "file", path)
	}
	return nil
}

func (v *VM) bootOrDisk() string {
	if v.boot == "" {
		return machine.BootDisk
	}
	return v.boot
}

// localMedia turns InsertMedia's argument into a local file path.
func (v *VM) localMedia(raw string) (string, error) {
	switch {
	case raw == "":
		return "", nil
	case strings.HasPrefix(raw, "http://"), strings.HasPrefix(raw, "https://"):
		v.mu.Lock()
		v.nfile++
		path := filepath.Join(v.o.Dir, fmt.Sprintf("media-%d.iso", v.nfile))
		v.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), mediaTimeout)
		defer cancel()
		if err := download(ctx, raw, path); err != nil {
			return "", errdefs.Unavailable("libvirt: media %s: %v", redact(raw), err)
		}
		return path, nil
	case strings.HasPrefix(raw, "file://"):
		u, err := url.Parse(raw)
		if err != nil {
			return "", errdefs.InvalidArgument("libvirt: media %q: %v", raw, err)
		}
		raw = u.Path
	case strings.Contains(raw, "://"):
		return "", errdefs.InvalidArgument("libvirt: media %q: want a local path, file://, http:// or https://", redact(raw))
	}
	if !filepath.IsAbs(raw) {
		return "", errdefs.InvalidArgument("libvirt: media %q: want an absolute path", raw)
	}
	if _, err := os.Stat(raw); err != nil {
		return "", errdefs.NotFound("libvirt: media %s: %v", raw, err)
	}
	return raw, nil
}

// removeDownload deletes a media file this VM downloaded.
func (v *VM) removeDownload(path string) {
	if path != "" && filepath.Dir(path) == v.o.Dir && strings.HasPrefix(filepath.Base(path), "media-") {
		_ = os.Remove(path)
	}
}

// redact drops a URL's user information (a password must not reach logs
// or errors).
func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.User == nil {
		return raw
	}
	return u.Redacted()
}

// download fetches url into path (via a temporary name).
func download(ctx context.Context, rawURL, path string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, rawURL, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		var uerr *url.Error
		if errors.As(err, &uerr) {
			err = uerr.Err
		}
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET: %s", resp.Status)
	}
	return atomicfile.WriteFunc(path, 0o644, func(w io.Writer) error {
		if _, err := io.Copy(w, resp.Body); err != nil {
			return fmt.Errorf("GET: %w", err)
		}
		return nil
	})
}

// Close destroys the domain if it runs, undefines it (with its UEFI
// variables) and disconnects. The VM's directory is left to its owner.
// Equivalent to `virsh destroy NAME; virsh undefine --nvram NAME`.
func (v *VM) Close() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.lv == nil {
		return nil
	}
	if v.stopEvents != nil {
		v.stopEvents()
		v.stopEvents = nil
	}
	if v.attached {
		v.removeDownload(v.media)
		err := v.lv.Disconnect()
		v.lv = nil
		return err
	}
	var errs []error
	if on, err := v.stateLocked(); err != nil {
		errs = append(errs, err)
	} else if on {
		errs = append(errs, v.destroyLocked())
	}
	var flags golibvirt.DomainUndefineFlagsValues
	if v.o.UEFI {
		flags |= golibvirt.DomainUndefineNvram
	}
	if err := v.lv.DomainUndefineFlags(v.dom, flags); err != nil && !golibvirt.IsNotFound(err) {
		errs = append(errs, fmt.Errorf("libvirt: undefine %s: %w", v.o.Name, err))
	}
	v.removeDownload(v.media)
	errs = append(errs, v.lv.Disconnect())
	v.lv = nil
	v.log.Info("domain undefined")
	return errors.Join(errs...)
}
