package libvirt

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	golibvirt "github.com/digitalocean/go-libvirt"
	"libvirt.org/go/libvirtxml"

	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// AttachOptions configure Attach.
type AttachOptions struct {
	// Domain is the name or UUID of a defined (persistent) domain;
	// required.
	Domain string
	// Dir receives media downloaded from http(s) URLs; required. QEMU
	// must be able to read it (libvirt's libvirt-qemu user under a
	// system libvirtd: keep it traversable).
	Dir string
	// Socket is libvirtd's unix socket (default DefaultSocket) and URI
	// the connection URI (default qemu:///system).
	Socket, URI string
	// GracePeriod bounds a graceful power-off before the domain is
	// destroyed (default 60s, or the caller's ctx).
	GracePeriod time.Duration
	// Logger receives lifecycle messages; nil discards them.
	Logger *slog.Logger
}

// Attach connects to libvirtd and returns an existing domain behind
// machine.Machine, for a BMC in front of VMs a CI already defines. Power
// on rewrites only the domain's boot order (`<os><boot dev>` when the
// domain uses it, else the `<boot order>` of its boot disk, CD drive and
// NIC) and starts it; virtual media changes the source of its first
// CD drive. Close disconnects and leaves the domain defined.
//
// It returns InvalidArgument without a domain or directory, NotFound
// when no domain has that name or UUID, FailedPrecondition for a
// transient domain (it could not be started again once off) and
// Unavailable when libvirtd does not answer.
func Attach(o AttachOptions) (*VM, error) {
	if o.Domain == "" || o.Dir == "" {
		return nil, errdefs.InvalidArgument("libvirt: a domain and a directory are required")
	}
	if o.GracePeriod <= 0 {
		o.GracePeriod = time.Minute
	}
	if o.Socket == "" {
		o.Socket = DefaultSocket
	}
	if err := os.MkdirAll(o.Dir, 0o755); err != nil {
		return nil, fmt.Errorf("libvirt: %w", err)
	}
	lv, err := Dial(o.Socket, o.URI)
	if err != nil {
		return nil, err
	}
	dom, err := lookup(lv, o.Domain)
	if err != nil {
		_ = lv.Disconnect()
		return nil, err
	}
	if p, err := lv.DomainIsPersistent(dom); err != nil || p != 1 {
		_ = lv.Disconnect()
		if err != nil {
			return nil, fmt.Errorf("libvirt: domain %s: %w", o.Domain, err)
		}
		return nil, errdefs.FailedPrecondition("libvirt: domain %q is transient: define it (virsh define) so it can be powered on again", dom.Name)
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	v := &VM{
		o: Options{Name: dom.Name, Dir: o.Dir, Socket: o.Socket, URI: o.URI,
			GracePeriod: o.GracePeriod, Logger: o.Logger},
		log:      log.With("component", "libvirt", "vm", dom.Name),
		lv:       lv,
		dom:      dom,
		attached: true,
	}
	def, err := v.persistentLocked()
	if err != nil {
		_ = lv.Disconnect()
		return nil, err
	}
	v.def = def
	if cd := firstDisk(def, "cdrom"); cd != nil && cd.Source != nil && cd.Source.File != nil {
		v.media = cd.Source.File.File
	}
	// The serial console when the domain writes it to a file.
	for _, s := range def.Devices.Serials {
		if s.Source != nil && s.Source.File != nil {
			v.serial = s.Source.File.Path
			break
		}
	}
	v.log.Info("domain attached", "uuid", def.UUID)
	return v, nil
}

// lookup finds a domain by UUID (when id parses as one) or name.
// Equivalent to `virsh domuuid ID` / `virsh domname ID`.
func lookup(lv *golibvirt.Libvirt, id string) (golibvirt.Domain, error) {
	if u, ok := parseUUID(id); ok {
		if dom, err := lv.DomainLookupByUUID(u); err == nil {
			return dom, nil
		}
	}
	dom, err := lv.DomainLookupByName(id)
	if err != nil {
		if golibvirt.IsNotFound(err) {
			return dom, errdefs.NotFound("libvirt: no domain named %q or with that UUID (virsh list --all)", id)
		}
		return dom, fmt.Errorf("libvirt: domain %q: %w", id, err)
	}
	return dom, nil
}

func parseUUID(s string) (golibvirt.UUID, bool) {
	var u golibvirt.UUID
	h := strings.ReplaceAll(s, "-", "")
	if len(h) != 2*len(u) {
		return u, false
	}
	for i := range u {
		var b byte
		if _, err := fmt.Sscanf(h[2*i:2*i+2], "%02x", &b); err != nil {
			return u, false
		}
		u[i] = b
	}
	return u, true
}

// UUID is the domain's UUID.
func (v *VM) UUID() string { return uuidString(v.dom.UUID) }

// persistentLocked reads the domain's persistent definition. Equivalent
// to `virsh dumpxml --inactive NAME`.
func (v *VM) persistentLocked() (*libvirtxml.Domain, error) {
	x, err := v.lv.DomainGetXMLDesc(v.dom, golibvirt.DomainXMLInactive)
	if err != nil {
		return nil, fmt.Errorf("libvirt: dumpxml %s: %w", v.o.Name, err)
	}
	d := &libvirtxml.Domain{}
	if err := d.Unmarshal(x); err != nil {
		return nil, fmt.Errorf("libvirt: domain XML of %s: %w", v.o.Name, err)
	}
	return d, nil
}

// liveLocked reads the running domain's definition.
func (v *VM) liveLocked() (*libvirtxml.Domain, error) {
	x, err := v.lv.DomainGetXMLDesc(v.dom, 0)
	if err != nil {
		return nil, fmt.Errorf("libvirt: dumpxml %s: %w", v.o.Name, err)
	}
	d := &libvirtxml.Domain{}
	if err := d.Unmarshal(x); err != nil {
		return nil, fmt.Errorf("libvirt: domain XML of %s: %w", v.o.Name, err)
	}
	return d, nil
}

// firstDisk is d's first disk of device kind ("disk" also matches a disk
// without a device attribute, libvirt's default), nil when none.
func firstDisk(d *libvirtxml.Domain, device string) *libvirtxml.DomainDisk {
	if d.Devices == nil {
		return nil
	}
	for i := range d.Devices.Disks {
		dev := d.Devices.Disks[i].Device
		if dev == device || (device == "disk" && dev == "") {
			return &d.Devices.Disks[i]
		}
	}
	return nil
}

// bootDisk is the disk of device kind that boots first in d (the lowest
// `<boot order>`), else the first of that kind; nil when none.
func bootDisk(d *libvirtxml.Domain, device string) *libvirtxml.DomainDisk {
	var best *libvirtxml.DomainDisk
	for i := range d.Devices.Disks {
		dk := &d.Devices.Disks[i]
		if dk.Device != device && !(device == "disk" && dk.Device == "") {
			continue
		}
		if best == nil || (dk.Boot != nil && (best.Boot == nil || dk.Boot.Order < best.Boot.Order)) {
			best = dk
		}
	}
	return best
}

// osBootDev are the `<os><boot dev>` names of the lab's boot devices.
var osBootDev = map[string]string{machine.BootDisk: "hd", machine.BootCD: "cdrom", machine.BootPXE: "network"}

// setBootDevice makes dev boot first in an existing domain definition.
// A domain with `<os><boot dev>` elements gets dev's element first; one
// with per-device `<boot order>` (or none) gets order 1 on its device of
// that kind that booted first (else the first of that kind) and 2, 3 on
// the others (the disk, NIC, CD of bootOrder), every other disk and NIC
// losing its order (libvirt wants them unique). It returns FailedPrecondition when the domain has no
// device of that kind.
func setBootDevice(d *libvirtxml.Domain, dev string) error {
	if d.OS != nil && len(d.OS.BootDevices) > 0 {
		first := osBootDev[dev]
		devs := []libvirtxml.DomainBootDevice{{Dev: first}}
		for _, b := range d.OS.BootDevices {
			if b.Dev != first {
				devs = append(devs, b)
			}
		}
		d.OS.BootDevices = devs
		return nil
	}
	if d.Devices == nil {
		return errdefs.FailedPrecondition("domain has no devices")
	}
	disk, cd := bootDisk(d, "disk"), bootDisk(d, "cdrom")
	var nic *libvirtxml.DomainInterface
	for i := range d.Devices.Interfaces {
		n := &d.Devices.Interfaces[i]
		if nic == nil || (n.Boot != nil && (nic.Boot == nil || n.Boot.Order < nic.Boot.Order)) {
			nic = n
		}
	}
	switch {
	case dev == machine.BootCD && cd == nil:
		return errdefs.FailedPrecondition("no CD drive to boot from: add <disk type='file' device='cdrom'> to the domain")
	case dev == machine.BootDisk && disk == nil:
		return errdefs.FailedPrecondition("no disk to boot from")
	case dev == machine.BootPXE && nic == nil:
		return errdefs.FailedPrecondition("no network interface to PXE boot from")
	}
	for i := range d.Devices.Disks {
		d.Devices.Disks[i].Boot = nil
	}
	for i := range d.Devices.Interfaces {
		d.Devices.Interfaces[i].Boot = nil
	}
	n := uint(0)
	for _, k := range []string{dev, machine.BootDisk, machine.BootPXE, machine.BootCD} {
		var boot **libvirtxml.DomainDeviceBoot
		switch k {
		case machine.BootDisk:
			if disk != nil {
				boot = &disk.Boot
			}
		case machine.BootCD:
			if cd != nil {
				boot = &cd.Boot
			}
		case machine.BootPXE:
			if nic != nil {
				boot = &nic.Boot
			}
		}
		if boot == nil || *boot != nil {
			continue
		}
		n++
		*boot = &libvirtxml.DomainDeviceBoot{Order: n}
	}
	return nil
}

// insertAttachedLocked puts path ("" ejects) in the attached domain's
// first CD drive: in the persistent definition (`virsh change-media
// --config`) and, when the domain runs, live (`--live`). Each definition
// keeps its own drive XML but for the source.
func (v *VM) insertAttachedLocked(rawURL, path string, on bool) error {
	setSource := func(d *libvirtxml.Domain) (*libvirtxml.DomainDisk, error) {
		cd := firstDisk(d, "cdrom")
		if cd == nil {
			return nil, errdefs.FailedPrecondition("libvirt: domain %s has no CD drive for virtual media: add <disk type='file' device='cdrom'>", v.o.Name)
		}
		cd.Source = nil
		if path != "" {
			cd.Source = &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: path}}
		}
		if cd.Driver == nil {
			cd.Driver = &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "raw"}
		}
		return cd, nil
	}
	fail := func(err error) error {
		v.removeDownload(path)
		return err
	}
	update := func(d *libvirtxml.Domain, flags golibvirt.DomainDeviceModifyFlags) error {
		cd, err := setSource(d)
		if err != nil {
			return err
		}
		x, err := cd.Marshal()
		if err != nil {
			return fmt.Errorf("libvirt: cdrom XML: %w", err)
		}
		err = v.lv.DomainUpdateDeviceFlags(v.dom, x, flags)
		// See InsertMedia: the tray may need a moment to open.
		for i := 0; err != nil && i < 20 && strings.Contains(err.Error(), "is not open"); i++ {
			time.Sleep(250 * time.Millisecond)
			err = v.lv.DomainUpdateDeviceFlags(v.dom, x, flags)
		}
		if err != nil {
			return fmt.Errorf("libvirt: insert media %s into %s: %w", redact(rawURL), v.o.Name, err)
		}
		return nil
	}
	if on {
		live, err := v.liveLocked()
		if err != nil {
			return fail(err)
		}
		if err := update(live, golibvirt.DomainDeviceModifyLive); err != nil {
			return fail(err)
		}
	}
	def, err := v.persistentLocked()
	if err != nil {
		return fail(err)
	}
	if err := update(def, golibvirt.DomainDeviceModifyConfig); err != nil {
		return fail(err)
	}
	if prev := v.media; prev != path {
		v.removeDownload(prev)
	}
	v.media = path
	if path == "" {
		v.log.Info("media ejected")
	} else {
		v.log.Info("media inserted", "url", redact(rawURL), "file", path)
	}
	return nil
}

// Undefine destroys and undefines (with its UEFI variables) the domain
// name at libvirtd's socket, for a teardown that no longer holds the VM.
// A domain that is not defined is fine. It returns Unavailable when
// libvirtd does not answer. Equivalent to `virsh destroy NAME; virsh
// undefine --nvram NAME`.
func Undefine(socket, name string) error {
	lv, err := Dial(socket, "")
	if err != nil {
		return err
	}
	defer lv.Disconnect()
	dom, err := lv.DomainLookupByName(name)
	if golibvirt.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("libvirt: domain %s: %w", name, err)
	}
	if st, _, err := lv.DomainGetState(dom, 0); err == nil && golibvirt.DomainState(st) != golibvirt.DomainShutoff {
		if err := lv.DomainDestroy(dom); err != nil && !golibvirt.IsNotFound(err) {
			return fmt.Errorf("libvirt: destroy %s: %w", name, err)
		}
	}
	if err := lv.DomainUndefineFlags(dom, golibvirt.DomainUndefineNvram); err != nil && !golibvirt.IsNotFound(err) {
		return fmt.Errorf("libvirt: undefine %s: %w", name, err)
	}
	return nil
}

// QEMU driver paths (compiled into Debian's libvirt) where libvirtd keeps
// a domain's state.
const (
	qemuConfigDir = "/etc/libvirt/qemu"
	qemuStateDir  = "/run/libvirt/qemu"
	qemuLibDir    = "/var/lib/libvirt/qemu"
	qemuLogDir    = "/var/log/libvirt/qemu"
)

// PIDFile is where libvirtd's QEMU driver writes the QEMU process ID of
// the running domain name.
func PIDFile(name string) string { return filepath.Join(qemuStateDir, name+".pid") }

// RemoveDomainFiles removes what libvirtd's QEMU driver keeps of domain
// name — its persistent and live definitions, PID file, per-run
// directories, UEFI variables and QEMU log — for a teardown after a
// private libvirtd (StartDaemon) died with the domain defined. Never call
// it for a domain of a libvirtd that still runs.
func RemoveDomainFiles(name string) error {
	if name == "" || strings.ContainsAny(name, "/*?[") {
		return errdefs.InvalidArgument("libvirt: domain name %q", name)
	}
	paths := []string{
		filepath.Join(qemuConfigDir, name+".xml"),
		filepath.Join(qemuConfigDir, "autostart", name+".xml"),
		filepath.Join(qemuStateDir, name+".xml"),
		PIDFile(name),
		filepath.Join(qemuLibDir, "nvram", name+"_VARS.fd"),
		filepath.Join(qemuLogDir, name+".log"),
	}
	for _, pat := range []string{
		filepath.Join(qemuLibDir, "domain-*-"+name),
		filepath.Join(qemuStateDir, "domain-*-"+name),
		filepath.Join(qemuLibDir, "channel", "target", "domain-*-"+name),
	} {
		m, _ := filepath.Glob(pat)
		paths = append(paths, m...)
	}
	var errs []string
	for _, p := range paths {
		if err := os.RemoveAll(p); err != nil {
			errs = append(errs, err.Error())
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("libvirt: files of %s: %s", name, strings.Join(errs, "; "))
	}
	return nil
}

// Answers reports whether a libvirtd listens on socket.
func Answers(socket string) bool { return answers(socket) }

// MACs are the addresses of the domain's network interfaces (in its
// definition), lowercase.
func (v *VM) MACs() ([]string, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.def == nil || v.def.Devices == nil {
		return nil, nil
	}
	var macs []string
	for _, n := range v.def.Devices.Interfaces {
		if n.MAC != nil && n.MAC.Address != "" {
			macs = append(macs, strings.ToLower(n.MAC.Address))
		}
	}
	return macs, nil
}
