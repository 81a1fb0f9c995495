// Package domainbmc puts the lab's BMC emulators in front of libvirt
// domains that exist already (a CI's own VMs, defined with `virsh
// define`): one Redfish emulator (e2e/lab/redfish) per domain, and
// optionally one ipmi_sim (e2e/lab/ipmisim), each driving the domain
// through e2e/lab/libvirt.Attach. Power, one-time boot override and
// virtual media sent to the BMC change the domain; nothing else of it
// does, and a reset of the domain (its OS rebooting) boots the device the
// BMC sets, as a server's firmware does. It is what `kilnctl lab bmc` serves, in the way virtualbmc and
// sushy-tools serve Metal3's and OpenStack's CI domains.
//
// The BMC password is the caller's (read from a file or the
// environment); it is never logged or put in an error.
package domainbmc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/kilnhq/kiln/e2e/lab/ipmisim"
	"github.com/kilnhq/kiln/e2e/lab/libvirt"
	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/e2e/lab/redfish"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// Options configure Start.
type Options struct {
	// Domains are the names or UUIDs of defined libvirt domains; at least
	// one.
	Domains []string
	// Listen is host:port of the first domain's Redfish emulator
	// (default 127.0.0.1:0); each further domain listens on the next
	// port, or on a free one when the port is 0.
	Listen string
	// Username (default "admin") and Password (required) of every BMC.
	Username, Password string
	// NoTLS serves plain HTTP instead of HTTPS with a self-signed
	// certificate.
	NoTLS bool
	// IPMI also starts an ipmi_sim per domain on 127.0.0.1, at IPMIPort
	// and the next ports (0: free ports). ChassisCommand is its chassis
	// control program (`kilnctl lab chassis`, or kiln-chassis).
	IPMI           bool
	IPMIPort       int
	ChassisCommand []string
	// Socket is libvirtd's unix socket (default libvirt.DefaultSocket).
	Socket string
	// Dir keeps media downloaded from http(s) URLs (per domain) and the
	// ipmi_sim state; required. QEMU must be able to read it.
	Dir string
	// Logger receives BMC and domain messages; nil discards them.
	Logger *slog.Logger
}

// BMC is one domain's emulated BMC.
type BMC struct {
	Domain string
	UUID   string
	// Redfish is the emulator's base URL; IPMI the ipmi_sim host:port
	// ("" without Options.IPMI).
	Redfish string
	IPMI    string
	MACs    []string
}

// Server runs the BMCs of Start until Close.
type Server struct {
	bmcs    []BMC
	vms     []*libvirt.VM
	redfish []*redfish.BMC
	sims    []*ipmisim.Sim
}

// BMCs lists the BMC of each domain, in the order of Options.Domains.
func (s *Server) BMCs() []BMC { return s.bmcs }

// Start attaches to each domain and starts its BMCs. It returns
// InvalidArgument for missing options, NotFound for a domain libvirtd
// does not know, Unavailable when libvirtd does not answer or an address
// cannot be listened on; nothing stays running after an error.
func Start(ctx context.Context, o Options) (*Server, error) {
	if len(o.Domains) == 0 {
		return nil, errdefs.InvalidArgument("domain BMC: no domains")
	}
	if o.Password == "" {
		return nil, errdefs.InvalidArgument("domain BMC: no password (give a password file or KILN_BMC_PASSWORD)")
	}
	if o.Dir == "" {
		return nil, errdefs.InvalidArgument("domain BMC: no directory for media")
	}
	if o.Username == "" {
		o.Username = "admin"
	}
	if o.Listen == "" {
		o.Listen = "127.0.0.1:0"
	}
	host, portS, err := net.SplitHostPort(o.Listen)
	if err != nil {
		return nil, errdefs.InvalidArgument("domain BMC: listen address %q: want HOST:PORT", o.Listen)
	}
	port, err := strconv.Atoi(portS)
	if err != nil || port < 0 || port+len(o.Domains) > 65536 {
		return nil, errdefs.InvalidArgument("domain BMC: listen port %q", portS)
	}
	if o.IPMI {
		if len(o.ChassisCommand) == 0 {
			return nil, errdefs.InvalidArgument("domain BMC: IPMI needs a chassis command")
		}
		if len(o.Password) > 20 {
			return nil, errdefs.InvalidArgument("domain BMC: an IPMI password has at most 20 characters")
		}
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{}
	seen := map[string]bool{}
	for i, d := range o.Domains {
		vm, err := libvirt.Attach(libvirt.AttachOptions{
			Domain: d, Dir: filepath.Join(o.Dir, "media", strconv.Itoa(i)), Socket: o.Socket, Logger: log,
		})
		if err != nil {
			s.Close()
			return nil, err
		}
		s.vms = append(s.vms, vm)
		if seen[vm.UUID()] {
			s.Close()
			return nil, errdefs.InvalidArgument("domain BMC: domain %s given twice", vm.Name())
		}
		seen[vm.UUID()] = true
		macs, err := vm.MACs()
		if err != nil {
			s.Close()
			return nil, err
		}
		b := BMC{Domain: vm.Name(), UUID: vm.UUID(), MACs: macs}
		rf, err := redfish.New(redfish.Config{
			Username: o.Username, Password: o.Password, TLS: !o.NoTLS, Logger: log,
			Systems: []redfish.System{{ID: vm.UUID(), Name: vm.Name(), Manufacturer: "Kiln",
				Model: "libvirt domain", SerialNumber: vm.UUID(), MACs: macs, Machine: vm}},
		})
		if err != nil {
			s.Close()
			return nil, err
		}
		p := 0
		if port != 0 {
			p = port + i
		}
		if err := rf.StartOn(net.JoinHostPort(host, strconv.Itoa(p))); err != nil {
			s.Close()
			return nil, err
		}
		s.redfish = append(s.redfish, rf)
		b.Redfish = rf.URL()
		next := func() string { return rf.NextBootDevice(vm.UUID()) }
		if o.IPMI {
			chassis, err := chassisWrapper(o.Dir, o.ChassisCommand)
			if err != nil {
				s.Close()
				return nil, err
			}
			ip := 0
			if o.IPMIPort != 0 {
				ip = o.IPMIPort + i
			}
			sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			sim, err := ipmisim.Start(sctx, ipmisim.Options{
				Name: "kiln-bmc-" + strconv.Itoa(i), Port: ip, User: o.Username, Password: o.Password,
				ChassisProgram: chassis, Machine: vm, Dir: filepath.Join(o.Dir, "ipmi", strconv.Itoa(i)), Logger: log,
			})
			cancel()
			if err != nil {
				s.Close()
				return nil, err
			}
			s.sims = append(s.sims, sim)
			b.IPMI = sim.Addr()
			next = func() string {
				// Both BMCs' one-time overrides are consumed; IPMI's wins
				// when it names something else than the disk.
				dev := rf.NextBootDevice(vm.UUID())
				if d := sim.NextBoot(); d != machine.BootDisk {
					dev = d
				}
				return dev
			}
		}
		// A reset of the domain (its OS rebooting) boots what the BMC
		// says, as a real server's firmware does at every POST.
		if err := vm.SetNextBoot(next); err != nil {
			s.Close()
			return nil, err
		}
		s.bmcs = append(s.bmcs, b)
		log.Info("BMC serving", "domain", b.Domain, "uuid", b.UUID, "redfish", b.Redfish, "ipmi", b.IPMI)
	}
	return s, nil
}

// chassisWrapper writes the program ipmi_sim runs for chassis control: a
// script executing command with ipmi_sim's arguments.
func chassisWrapper(dir string, command []string) (string, error) {
	var q []string
	for _, a := range command {
		q = append(q, "'"+strings.ReplaceAll(a, "'", `'\''`)+"'")
	}
	p := filepath.Join(dir, "kiln-chassis")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("domain BMC: %w", err)
	}
	if err := os.WriteFile(p, []byte("#!/bin/sh\nexec "+strings.Join(q, " ")+" \"$@\"\n"), 0o700); err != nil {
		return "", fmt.Errorf("domain BMC: chassis program: %w", err)
	}
	return p, nil
}

// Close stops the BMCs and disconnects from libvirtd. The domains stay
// as they are (running or not) and stay defined.
func (s *Server) Close() error {
	for _, b := range s.redfish {
		b.Close()
	}
	for _, sim := range s.sims {
		sim.Stop()
	}
	var errs []error
	for _, vm := range s.vms {
		errs = append(errs, vm.Close())
	}
	return errors.Join(errs...)
}
