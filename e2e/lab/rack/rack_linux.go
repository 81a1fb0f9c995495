package rack

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kilnhq/kiln/e2e/lab/ipmisim"
	"github.com/kilnhq/kiln/e2e/lab/libvirt"
	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/e2e/lab/netns"
	"github.com/kilnhq/kiln/e2e/lab/qemu"
	"github.com/kilnhq/kiln/e2e/lab/redfish"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// Up starts a lab: it writes the options into the state directory, starts
// opts.ServeCommand (which must call Serve for that directory) in the
// background and waits until the supervisor reports the lab ready. When
// the lab does not come up, Up removes whatever was created (Down) and
// returns the supervisor's error. It returns AlreadyExists when a lab is
// running in the state directory and FailedPrecondition when a dead one
// left its state there (run Down).
func Up(ctx context.Context, opts Options) (*Report, error) {
	if err := opts.defaults(); err != nil {
		return nil, err
	}
	if len(opts.ServeCommand) == 0 {
		return nil, errdefs.InvalidArgument("lab: no serve command")
	}
	if os.Geteuid() != 0 {
		return nil, errdefs.FailedPrecondition("lab up: needs root (namespaces, bridge, nftables)")
	}
	if st, err := ReadState(opts.StateDir); err == nil {
		if netns.ProcessAlive(st.Serve) {
			return nil, errdefs.AlreadyExists("lab %q is already up (state in %s)", st.Name, opts.StateDir)
		}
		return nil, errdefs.FailedPrecondition("a lab left its state in %s: run `kilnctl lab down --state-dir %s` first", opts.StateDir, opts.StateDir)
	}
	if err := os.MkdirAll(opts.StateDir, 0o700); err != nil {
		return nil, fmt.Errorf("lab up: %w", err)
	}
	if err := writeJSON(filepath.Join(opts.StateDir, OptionsFile), opts, 0o600); err != nil {
		return nil, fmt.Errorf("lab up: %w", err)
	}
	logf, err := os.OpenFile(filepath.Join(opts.StateDir, ServeLog), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("lab up: %w", err)
	}
	cmd := exec.Command(opts.ServeCommand[0], opts.ServeCommand[1:]...)
	cmd.Env = append(os.Environ(), opts.ServeEnv...)
	cmd.Dir = opts.StateDir
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	logf.Close()
	if err != nil {
		return nil, fmt.Errorf("lab up: start supervisor: %w", err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()

	fail := func(err error) (*Report, error) {
		dctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if derr := Down(dctx, opts.StateDir, nil); derr != nil {
			err = fmt.Errorf("%w (and cleaning up: %v)", err, derr)
		}
		return nil, err
	}
	deadline := time.NewTimer(opts.ReadyTimeout)
	defer deadline.Stop()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		if st, err := ReadState(opts.StateDir); err == nil {
			switch st.Phase {
			case PhaseReady:
				return Status(opts.StateDir)
			case PhaseFailed:
				return fail(fmt.Errorf("lab up: %s", st.Error))
			}
		}
		select {
		case <-exited:
			if st, err := ReadState(opts.StateDir); err == nil && st.Phase == PhaseReady {
				continue
			}
			return fail(fmt.Errorf("lab up: supervisor exited: %s", logTail(filepath.Join(opts.StateDir, ServeLog))))
		case <-deadline.C:
			return fail(errdefs.Unavailable("lab up: not ready after %s: %s", opts.ReadyTimeout, logTail(filepath.Join(opts.StateDir, ServeLog))))
		case <-ctx.Done():
			return fail(fmt.Errorf("lab up: %w", ctx.Err()))
		case <-tick.C:
		}
	}
}

func logTail(path string) string {
	b, _ := os.ReadFile(path)
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return strings.TrimSpace(string(b))
}

// server is the supervisor of one lab.
type server struct {
	dir  string
	opts Options
	log  *slog.Logger

	mu sync.Mutex
	st State

	machines []machine.Machine
	vms      []*qemu.VM
	domains  []*libvirt.VM
	libvirtd *libvirt.Daemon
	// libvirtSocket is the libvirtd the domains are defined at.
	libvirtSocket string
	redfish       []*redfish.BMC
	sims          []*ipmisim.Sim
	lb            *LoadBalancer
	// dnsmasq serves DHCP to VM hosts on the bridge (startDHCP).
	dnsmasq     *exec.Cmd
	dnsmasqDone chan struct{}
}

func (s *server) saveLocked() {
	s.st.Updated = time.Now().UTC()
	if err := writeJSON(filepath.Join(s.dir, StateFile), &s.st, 0o644); err != nil {
		s.log.Error("cannot write the lab state", "err", err)
	}
}

func (s *server) update(f func(*State)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f(&s.st)
	s.saveLocked()
}

// track records a resource in the state file before it is created.
func (s *server) track(r netns.Resource) {
	s.update(func(st *State) { st.Resources = append(st.Resources, r) })
}

// Serve runs the lab whose options Up wrote into dir until ctx ends: it
// creates the guard, bridge, hosts and BMCs (recording each in the state
// file first), marks the lab ready, and on ctx's end powers every host
// off and stops the BMCs. Network resources stay for Down. It blocks, and
// returns the error that kept the lab from coming up, if any.
func Serve(ctx context.Context, dir string, log *slog.Logger) error {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	b, err := os.ReadFile(filepath.Join(dir, OptionsFile))
	if err != nil {
		return fmt.Errorf("lab serve: %w", err)
	}
	var opts Options
	if err := json.Unmarshal(b, &opts); err != nil {
		return fmt.Errorf("lab serve: options: %w", err)
	}
	if err := opts.defaults(); err != nil {
		return err
	}
	s := &server{dir: dir, opts: opts, log: log.With("component", "lab", "lab", opts.Name)}
	s.update(func(st *State) {
		*st = State{Name: opts.Name, Backend: opts.Backend, Phase: PhaseStarting, Serve: netns.ProcessID(os.Getpid())}
	})
	if err := s.up(ctx); err != nil {
		s.log.Error("lab failed to come up", "err", err)
		s.shutdown()
		s.update(func(st *State) { st.Phase, st.Error = PhaseFailed, err.Error() })
		return err
	}
	s.update(func(st *State) { st.Phase = PhaseReady })
	s.log.Info("lab ready", "hosts", len(s.machines), "bridge", s.st.Bridge, "subnet", s.st.Subnet)
	<-ctx.Done()
	s.log.Info("lab stopping")
	s.shutdown()
	s.update(func(st *State) { st.Phase = PhaseStopped })
	return nil
}

func (s *server) up(ctx context.Context) error {
	o := s.opts
	if o.Backend == BackendNetns {
		if err := raiseInotifyInstances(s.log); err != nil {
			return err
		}
	}
	// 1. The guard, before any lab network exists.
	uplinks, err := uplinks(ctx)
	if err != nil {
		return err
	}
	table := "kiln-lab-" + o.Name
	bridge := "kbr-" + o.Name
	// Never adopt another lab's guard or bridge: Down would remove them.
	if exec.CommandContext(ctx, "nft", "list", "table", "inet", table).Run() == nil {
		return errdefs.AlreadyExists("nft table inet %s exists: is another lab named %q up? (kilnctl lab down --name %s)", table, o.Name, o.Name)
	}
	if _, err := os.Stat("/sys/class/net/" + bridge); err == nil {
		return errdefs.AlreadyExists("bridge %s exists: is another lab named %q up? (kilnctl lab down --name %s)", bridge, o.Name, o.Name)
	}
	s.update(func(st *State) { st.NFTTable, st.Uplink = "inet "+table, strings.Join(uplinks, ",") })
	s.track(netns.Resource{Kind: KindNFT, Value: "inet " + table})
	// VM hosts are bridged in this machine's own namespace: nothing may be
	// forwarded between their bridge and any other interface.
	guarded := ""
	if isVM(o.Backend) {
		guarded = bridge
	}
	if err := nftGuard(ctx, table, uplinks, guarded); err != nil {
		return err
	}
	if len(uplinks) == 0 {
		s.log.Warn("no default route: the guard has no uplink to block")
	}

	// 2. The bridge on a lab-only subnet.
	subnet := o.Subnet
	if subnet == "" {
		if subnet, err = freeSubnet(ctx, o.Name); err != nil {
			return err
		}
	}
	pfx, err := netip.ParsePrefix(subnet)
	if err != nil || !pfx.Addr().Is4() || pfx.Bits() != 24 {
		return errdefs.InvalidArgument("lab subnet %q: want an IPv4 /24", subnet)
	}
	pfx = pfx.Masked()
	gw := pfx.Addr().Next()
	s.update(func(st *State) { st.Bridge, st.Subnet, st.Gateway = bridge, pfx.String(), gw.String() })
	s.track(netns.Resource{Kind: netns.KindLink, Value: bridge})
	for _, args := range [][]string{
		{"link", "add", bridge, "address", netns.BridgeMAC(bridge), "type", "bridge"},
		{"addr", "add", gw.String() + "/24", "dev", bridge},
		{"link", "set", bridge, "up"},
	} {
		if err := ip(ctx, args...); err != nil {
			return err
		}
	}

	n := o.Hosts + o.IPMI
	// 3. VM hosts get their addresses (and PXE) from dnsmasq on the
	// bridge.
	if isVM(o.Backend) {
		if err := s.startDHCP(ctx, bridge, pfx, n); err != nil {
			return err
		}
	}

	// 4. Credentials, then hosts and their BMCs.
	creds := map[string]Credentials{}
	for i := 1; i <= n; i++ {
		creds[hostName(i)] = Credentials{Username: "admin", Password: randomPassword()}
	}
	if err := writeJSON(filepath.Join(s.dir, CredentialsFile), creds, 0o600); err != nil {
		return fmt.Errorf("lab credentials: %w", err)
	}
	chassis := ""
	if o.IPMI > 0 {
		if chassis, err = s.chassisWrapper(); err != nil {
			return err
		}
	}
	if o.Backend == BackendLibvirt {
		if err := s.startLibvirt(ctx); err != nil {
			return err
		}
	}
	addr := gw
	for i := 1; i <= n; i++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		name := hostName(i)
		addr = addr.Next()
		hdir := filepath.Join(s.dir, "hosts", name)
		resource := ResourceName(o.Name, name)
		agent := netns.Agent{CmdlineFile: filepath.Join(hdir, CmdlineExtra), Scratch: filepath.Join(hdir, "agent"), ReadMedia: true, FirmwareRetry: firmwareRetry}
		if o.AgentBinary != "" {
			// The lab's disks are files: the boot agent lays into them
			// only in its explicit file-target mode.
			agent.Command = []string{o.AgentBinary, "run", "--data-dir", agent.Scratch, "--file-targets"}
			agent.OSPower = true
		}
		if o.BootURL != "" {
			agent.BootScript = BootScriptURL(o.BootURL, resource, gw.String())
		}
		cl := []string{"kiln.host=" + resource}
		if o.ControllerURL != "" {
			cl = append(cl, "kiln.controller="+o.ControllerURL)
		}
		if o.CAHash != "" {
			cl = append(cl, "kiln.ca_hash="+o.CAHash)
		}
		agent.Cmdline = strings.Join(cl, " ")
		var (
			m machine.Machine
			h Host
		)
		switch o.Backend {
		case BackendQEMU:
			vm, err := s.newVM(ctx, i, name, hdir, bridge)
			if err != nil {
				return err
			}
			m = vm
			h = Host{Name: name, Resource: resource, Machine: vm.name, Address: addr.String(), MAC: vm.mac, Disk: vm.disk, Dir: hdir}
		case BackendLibvirt:
			d, err := s.newDomain(i, name, hdir, bridge)
			if err != nil {
				return err
			}
			m = d
			h = Host{Name: name, Resource: resource, Machine: d.Name(), Address: addr.String(), MAC: d.mac, Disk: d.disk, Dir: hdir}
		default:
			nm, err := netns.New(ctx, netns.Options{
				Name: name, Lab: o.Name, StateDir: hdir, Bridge: bridge,
				Address: addr.String() + "/24", Gateway: gw.String(),
				DiskSize: o.DiskSize, Agent: agent, Track: s.track, Logger: s.log,
			})
			if err != nil {
				return err
			}
			m = nm
			h = Host{Name: name, Resource: resource, Namespace: nm.Namespace(), Machine: nm.MachineName(), Address: addr.String(), MAC: nm.MAC(), Disk: nm.DiskPath(), Dir: hdir}
		}
		s.machines = append(s.machines, m)
		c := creds[name]
		if i <= o.Hosts {
			auth := redfish.AuthBoth
			if i-1 < len(o.RedfishAuth) {
				auth = o.RedfishAuth[i-1]
			}
			bmc, err := redfish.New(redfish.Config{
				Username: c.Username, Password: c.Password, TLS: true, Logger: s.log, Auth: auth,
				Systems: []redfish.System{{ID: "1", Name: name, Manufacturer: "Kiln", Model: "lab " + o.Backend + " host",
					SerialNumber: "KILN-" + strings.ToUpper(o.Name+"-"+name), MACs: []string{h.MAC}, Machine: m}},
			})
			if err != nil {
				return err
			}
			bmc.Start()
			if err := setNextBoot(m, func() string { return bmc.NextBootDevice("1") }); err != nil {
				return err
			}
			s.redfish = append(s.redfish, bmc)
			h.BMC = BMC{Protocol: ProtocolRedfish, Address: bmc.URL(), Insecure: true, Auth: auth}
		} else {
			sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			sim, err := ipmisim.Start(sctx, ipmisim.Options{
				Name: "kiln-" + o.Name + "-" + name, User: c.Username, Password: c.Password,
				ChassisProgram: chassis, Machine: m, Dir: filepath.Join(hdir, "ipmi"), Logger: s.log,
			})
			cancel()
			if err != nil {
				return err
			}
			s.track(netns.Resource{Kind: netns.KindPID, Value: netns.ProcessID(sim.PID())})
			if err := setNextBoot(m, sim.NextBoot); err != nil {
				return err
			}
			s.sims = append(s.sims, sim)
			h.BMC = BMC{Protocol: ProtocolIPMI, Address: sim.Addr()}
		}
		s.update(func(st *State) { st.Hosts = append(st.Hosts, h) })
	}
	// QEMU hosts reboot into the device their BMC sets (the boot agent
	// reboots into the laid disk), as servers do.
	for i, m := range s.machines {
		if vm, ok := m.(*labVM); ok {
			vm.SetNextBoot(s.nextBoot(i))
		}
	}
	if o.APIServerLB {
		var backends []string
		for _, h := range s.st.Hosts {
			backends = append(backends, net.JoinHostPort(h.Address, strconv.Itoa(APIServerPort)))
		}
		lb, err := ListenLoadBalancer(net.JoinHostPort(gw.String(), strconv.Itoa(APIServerPort)), backends, s.log)
		if err != nil {
			return fmt.Errorf("lab: API load balancer: %w", err)
		}
		s.lb = lb
		s.update(func(st *State) { st.APIServer = lb.Addr() })
	}
	return nil
}

func hostName(i int) string { return fmt.Sprintf("h%d", i) }

// nextBoot is the boot device the BMC of host i (0-based: the Redfish
// hosts, then the IPMI ones) sets for the next boot.
func (s *server) nextBoot(i int) func() string {
	if i < len(s.redfish) {
		b := s.redfish[i]
		return func() string { return b.NextBootDevice("1") }
	}
	return s.sims[i-len(s.redfish)].NextBoot
}

// firmwareRetry is how long a lab host's firmware retries boot media
// while the controller's boot server is away.
const firmwareRetry = 90 * time.Second

// randomPassword is 16 hex digits: IPMI passwords have at most 16 bytes
// (20 with IPMI 2.0 only).
func randomPassword() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// chassisWrapper writes the program ipmi_sim runs for chassis control: a
// script that executes ChassisCommand with ipmi_sim's arguments.
func (s *server) chassisWrapper() (string, error) {
	var q []string
	for _, a := range s.opts.ChassisCommand {
		q = append(q, "'"+strings.ReplaceAll(a, "'", `'\''`)+"'")
	}
	p := filepath.Join(s.dir, "kiln-chassis")
	script := "#!/bin/sh\nexec " + strings.Join(q, " ") + " \"$@\"\n"
	if err := os.WriteFile(p, []byte(script), 0o700); err != nil {
		return "", fmt.Errorf("lab: chassis program: %w", err)
	}
	return p, nil
}

// shutdown powers every host off (hard) and stops the BMCs.
func (s *server) shutdown() {
	if s.lb != nil {
		_ = s.lb.Close()
	}
	for _, b := range s.redfish {
		b.Close()
	}
	for _, sim := range s.sims {
		sim.Stop()
	}
	var wg sync.WaitGroup
	for _, m := range s.machines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_ = m.PowerOff(ctx, false)
		}()
	}
	wg.Wait()
	for _, vm := range s.vms {
		_ = vm.Close()
	}
	for _, d := range s.domains {
		if err := d.Close(); err != nil {
			s.log.Warn("libvirt domain not removed (lab down retries)", "domain", d.Name(), "err", err)
		}
	}
	if s.libvirtd != nil {
		_ = s.libvirtd.Close()
	}
	s.stopDHCP()
}

// labVM is a lab host on QEMU: it records the QEMU process (started at
// the first power on) in the state file as soon as it runs.
type labVM struct {
	*qemu.VM
	name, mac, disk string
	track           func(netns.Resource)

	mu      sync.Mutex
	tracked int // PID last recorded
}

// hostMAC is the NIC of VM host i (1-based).
func hostMAC(i int) string { return fmt.Sprintf("52:54:00:4b:%02x:%02x", i>>8&0xff, i&0xff) }

// tapName is the tap of QEMU host hI in lab: "kt" + lab + host, at most
// 14 characters (IFNAMSIZ is 16 with the NUL).
func tapName(lab, host string) string { return "kt" + lab + host }

// newVM makes host i a QEMU VM with a sparse disk in hdir and its NIC on
// a tap in the lab bridge. The host directory (disk, serial log, QEMU
// log) and the tap are recorded before they are created, the QMP socket
// directory right after. Equivalent to:
//
//	ip tuntap add dev TAP mode tap
//	ip link set TAP address fe:54:00:4b:00:0I
//	ip link set TAP master BRIDGE
//	ip link set TAP up
func (s *server) newVM(ctx context.Context, i int, name, hdir, bridge string) (*labVM, error) {
	disk := filepath.Join(hdir, "disk.raw")
	s.track(netns.Resource{Kind: netns.KindDir, Value: hdir})
	vname := "kiln-" + s.opts.Name + "-" + name
	mac := hostMAC(i)
	tap := tapName(s.opts.Name, name)
	if _, err := os.Stat("/sys/class/net/" + tap); err == nil {
		return nil, errdefs.AlreadyExists("tap %s exists: is another lab named %q up?", tap, s.opts.Name)
	}
	s.track(netns.Resource{Kind: netns.KindLink, Value: tap})
	for _, args := range [][]string{
		{"tuntap", "add", "dev", tap, "mode", "tap"},
		// As libvirt does: the tap's own address is the NIC's with
		// fe: first, so the bridge never takes the guest's MAC.
		{"link", "set", tap, "address", "fe" + mac[2:]},
		{"link", "set", tap, "master", bridge},
		{"link", "set", tap, "up"},
	} {
		if err := ip(ctx, args...); err != nil {
			return nil, err
		}
	}
	vm, err := qemu.New(qemu.Options{
		Name: vname, Dir: hdir, DiskSize: s.opts.DiskSize, MAC: mac, Logger: s.log,
		MemoryMB: s.opts.MemoryMB, CPUs: s.opts.CPUs, Network: qemu.Network{Tap: tap},
	})
	if err != nil {
		return nil, err
	}
	s.track(netns.Resource{Kind: netns.KindDir, Value: vm.SocketDir()})
	s.vms = append(s.vms, vm)
	return &labVM{VM: vm, name: vname, mac: mac, disk: disk, track: s.track}, nil
}

// PowerOn starts QEMU when needed and records its PID.
func (v *labVM) PowerOn(ctx context.Context, bootDevice string) error {
	err := v.VM.PowerOn(ctx, bootDevice)
	if pid := v.VM.PID(); pid != 0 {
		v.mu.Lock()
		if pid != v.tracked {
			v.tracked = pid
			v.track(netns.Resource{Kind: netns.KindPID, Value: netns.ProcessID(pid)})
		}
		v.mu.Unlock()
	}
	return err
}

// Down stops the lab in dir and removes everything its state file
// records: the supervisor (SIGTERM, then SIGKILL after 60 s), every
// libvirt domain, process, cgroup, mount, loop device, namespace, link and
// the nft table,
// then the state directory itself. Things already gone are skipped, so
// Down can be run again after a partial teardown; the state directory
// stays when something could not be removed. It returns NotFound when dir
// holds no lab.
func Down(ctx context.Context, dir string, log *slog.Logger) error {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	st, err := ReadState(dir)
	if errdefs.IsNotFound(err) {
		if _, serr := os.Stat(filepath.Join(dir, OptionsFile)); serr == nil {
			// Up wrote its options but the supervisor recorded nothing.
			return os.RemoveAll(dir)
		}
		return err
	}
	if err != nil {
		return err
	}
	if st.Serve != "" && netns.ProcessAlive(st.Serve) {
		pid := 0
		fmt.Sscanf(st.Serve, "%d:", &pid)
		log.Info("stopping the lab supervisor", "pid", pid)
		_ = syscall.Kill(pid, syscall.SIGTERM)
		deadline := time.Now().Add(60 * time.Second)
		for netns.ProcessAlive(st.Serve) && time.Now().Before(deadline) && ctx.Err() == nil {
			time.Sleep(100 * time.Millisecond)
		}
		if err := netns.KillProcess(st.Serve); err != nil {
			return fmt.Errorf("lab down: supervisor: %w", err)
		}
	}
	if st2, err := ReadState(dir); err == nil {
		st = st2
	}
	var errs []error
	order := []string{KindDomain, netns.KindPID, KindDHCP, netns.KindCgroup, netns.KindMount, netns.KindLoop, netns.KindDir, netns.KindNetns, netns.KindLink, KindNFT}
	for _, kind := range order {
		rs := slices.Clone(st.Resources)
		slices.Reverse(rs)
		for _, r := range rs {
			if r.Kind != kind {
				continue
			}
			var err error
			switch kind {
			case KindNFT:
				err = removeTable(ctx, r.Value)
			case KindDomain:
				err = removeDomain(st, r.Value)
			case KindDHCP:
				err = killDHCP(r.Value)
			default:
				err = netns.Remove(ctx, r)
			}
			if err != nil {
				log.Warn("could not remove", "kind", r.Kind, "value", r.Value, "err", err)
				errs = append(errs, fmt.Errorf("%s %s: %w", r.Kind, r.Value, err))
			}
		}
		if kind == netns.KindPID && st.LibvirtPrivate {
			// The private libvirtd is gone now: what its QEMU driver kept
			// of the lab's domains in the system paths goes too.
			for _, r := range st.Resources {
				if r.Kind == KindDomain {
					if err := libvirt.RemoveDomainFiles(r.Value); err != nil {
						errs = append(errs, err)
					}
				}
			}
		}
		if kind == netns.KindDir && !isVM(st.Backend) {
			for _, h := range st.Hosts {
				if h.Machine == "" {
					continue
				}
				_ = os.RemoveAll(filepath.Join("/run/systemd/nspawn/propagate", h.Machine))
			}
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("lab down: %w (state kept in %s: run down again)", errors.Join(errs...), dir)
	}
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("lab down: %w", err)
	}
	log.Info("lab removed", "lab", st.Name)
	return nil
}

// --- network

func ip(ctx context.Context, args ...string) error {
	out, err := exec.CommandContext(ctx, "ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// uplinks are the interfaces of the default routes. Equivalent to
// `ip -j route show default` (and `ip -j -6 ...`).
func uplinks(ctx context.Context) ([]string, error) {
	var devs []string
	for _, fam := range []string{"-4", "-6"} {
		out, err := exec.CommandContext(ctx, "ip", "-j", fam, "route", "show", "default").Output()
		if err != nil {
			return nil, fmt.Errorf("lab: default route: %w", err)
		}
		var routes []struct {
			Dev string `json:"dev"`
		}
		if len(strings.TrimSpace(string(out))) > 0 {
			if err := json.Unmarshal(out, &routes); err != nil {
				return nil, fmt.Errorf("lab: default route: %w", err)
			}
		}
		for _, r := range routes {
			if r.Dev != "" && !slices.Contains(devs, r.Dev) {
				devs = append(devs, r.Dev)
			}
		}
	}
	return devs, nil
}

// nftGuard creates the lab's table: forwarded traffic leaving through an
// uplink is dropped and, when bridge is set, everything forwarded between
// that bridge and any other interface (its hosts reach each other and this
// machine's own addresses, nothing else). Equivalent to:
//
//	nft add table inet TABLE
//	nft add chain inet TABLE forward '{ type filter hook forward priority -200; policy accept; }'
//	nft add rule inet TABLE forward oifname "eth0" counter drop
//	nft add rule inet TABLE forward iifname "BRIDGE" oifname != "BRIDGE" counter drop
//	nft add rule inet TABLE forward oifname "BRIDGE" iifname != "BRIDGE" counter drop
func nftGuard(ctx context.Context, table string, uplinks []string, bridge string) error {
	if _, err := exec.LookPath("nft"); err != nil {
		return errdefs.FailedPrecondition("lab: nft not found (Debian package nftables)")
	}
	cmd := exec.CommandContext(ctx, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(guardRules(table, uplinks, bridge))
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("lab: nft guard: %w: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// guardRules is nftGuard's ruleset (nft -f).
func guardRules(table string, uplinks []string, bridge string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "table inet %s {\n  chain forward {\n    type filter hook forward priority -200; policy accept;\n", table)
	for _, u := range uplinks {
		fmt.Fprintf(&b, "    oifname %q counter drop\n", u)
	}
	if bridge != "" {
		fmt.Fprintf(&b, "    iifname %[1]q oifname != %[1]q counter drop\n", bridge)
		fmt.Fprintf(&b, "    oifname %[1]q iifname != %[1]q counter drop\n", bridge)
	}
	b.WriteString("  }\n}\n")
	return b.String()
}

// removeTable deletes an nft table ("inet NAME") if it exists.
// Equivalent to `nft delete table inet NAME`.
func removeTable(ctx context.Context, table string) error {
	fam, name, ok := strings.Cut(table, " ")
	if !ok {
		return errdefs.InvalidArgument("nft table %q: want FAMILY NAME", table)
	}
	if exec.CommandContext(ctx, "nft", "list", "table", fam, name).Run() != nil {
		return nil
	}
	if out, err := exec.CommandContext(ctx, "nft", "delete", "table", fam, name).CombinedOutput(); err != nil {
		return fmt.Errorf("nft delete table %s: %w: %s", table, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// freeSubnet picks a 10.251.X.0/24 (X derived from the lab name, then the
// next ones) that overlaps no address or route of this machine.
// Equivalent to reading `ip -j -4 addr` and `ip -j -4 route show table all`.
func freeSubnet(ctx context.Context, name string) (string, error) {
	used, err := usedPrefixes(ctx)
	if err != nil {
		return "", err
	}
	h := fnv.New32a()
	h.Write([]byte(name))
	start := int(h.Sum32() % 256)
	for i := range 256 {
		x := (start + i) % 256
		cand := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 251, byte(x), 0}), 24)
		if !slices.ContainsFunc(used, cand.Overlaps) {
			return cand.String(), nil
		}
	}
	return "", errdefs.Unavailable("lab: no free /24 in 10.251.0.0/16; pass a subnet")
}

func usedPrefixes(ctx context.Context) ([]netip.Prefix, error) {
	var used []netip.Prefix
	out, err := exec.CommandContext(ctx, "ip", "-j", "-4", "addr", "show").Output()
	if err != nil {
		return nil, fmt.Errorf("lab: addresses: %w", err)
	}
	var links []struct {
		AddrInfo []struct {
			Local     string `json:"local"`
			PrefixLen int    `json:"prefixlen"`
		} `json:"addr_info"`
	}
	if err := json.Unmarshal(out, &links); err != nil {
		return nil, fmt.Errorf("lab: addresses: %w", err)
	}
	for _, l := range links {
		for _, a := range l.AddrInfo {
			if p, err := netip.ParsePrefix(fmt.Sprintf("%s/%d", a.Local, a.PrefixLen)); err == nil {
				used = append(used, p.Masked())
			}
		}
	}
	out, err = exec.CommandContext(ctx, "ip", "-j", "-4", "route", "show", "table", "all").Output()
	if err != nil {
		return nil, fmt.Errorf("lab: routes: %w", err)
	}
	var routes []struct {
		Dst string `json:"dst"`
	}
	if err := json.Unmarshal(out, &routes); err != nil {
		return nil, fmt.Errorf("lab: routes: %w", err)
	}
	for _, r := range routes {
		if r.Dst == "" || r.Dst == "default" {
			continue
		}
		d := r.Dst
		if !strings.Contains(d, "/") {
			d += "/32"
		}
		if p, err := netip.ParsePrefix(d); err == nil {
			used = append(used, p.Masked())
		}
	}
	return used, nil
}

// inotifyInstances is the fs.inotify.max_user_instances a netns lab needs:
// the hosts share this machine's user namespace, and each booted host's
// systemd, journald, containerd (its CNI config watch) and kubelet take
// instances from the same per-user budget. Debian's default, 128, runs
// out at about eight Kubernetes hosts, and containerd then starts without
// its CRI plugin ("failed to create fsnotify watcher: too many open
// files").
const inotifyInstances = 8192

// raiseInotifyInstances raises fs.inotify.max_user_instances to
// inotifyInstances when it is lower, as kind's documentation asks for
// multi-node clusters. It never lowers it, and lab down leaves it (another
// lab may be running). Equivalent to: `sysctl -w
// fs.inotify.max_user_instances=8192`.
func raiseInotifyInstances(log *slog.Logger) error {
	const p = "/proc/sys/fs/inotify/max_user_instances"
	b, err := os.ReadFile(p)
	if err != nil {
		return nil // not Linux-like enough to matter
	}
	cur, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || cur >= inotifyInstances {
		return nil
	}
	if err := os.WriteFile(p, []byte(strconv.Itoa(inotifyInstances)), 0o644); err != nil {
		return fmt.Errorf("lab: fs.inotify.max_user_instances is %d, too few for lab hosts running Kubernetes; raising it to %d failed: %w (run: sysctl -w fs.inotify.max_user_instances=%d)", cur, inotifyInstances, err, inotifyInstances)
	}
	log.Info("raised fs.inotify.max_user_instances for the lab's hosts (left raised)", "from", cur, "to", inotifyInstances)
	return nil
}

// --- libvirt

// startLibvirt picks the lab's libvirtd: the system one when its socket
// answers, else a private one (libvirt.StartDaemon) in STATE_DIR/libvirtd,
// recorded by PID.
func (s *server) startLibvirt(ctx context.Context) error {
	if libvirt.Answers(libvirt.DefaultSocket) {
		s.libvirtSocket = libvirt.DefaultSocket
		s.update(func(st *State) { st.LibvirtSocket = libvirt.DefaultSocket })
		s.log.Info("using the system libvirtd", "socket", libvirt.DefaultSocket)
		return nil
	}
	d, err := libvirt.StartDaemon(ctx, libvirt.DaemonOptions{Dir: filepath.Join(s.dir, "libvirtd"), Logger: s.log})
	if err != nil {
		return fmt.Errorf("lab: no system libvirtd at %s and a private one did not start: %w", libvirt.DefaultSocket, err)
	}
	s.libvirtd, s.libvirtSocket = d, d.Socket()
	s.track(netns.Resource{Kind: netns.KindPID, Value: netns.ProcessID(d.PID())})
	s.update(func(st *State) { st.LibvirtSocket, st.LibvirtPrivate = d.Socket(), true })
	s.log.Info("started a private libvirtd", "pid", d.PID(), "socket", d.Socket())
	return nil
}

// labDomain is a lab host on libvirt: it records the domain's QEMU
// process in the state file as soon as it runs.
type labDomain struct {
	*libvirt.VM
	mac, disk string
	track     func(netns.Resource)

	mu      sync.Mutex
	tracked int
}

// newDomain makes host i a libvirt domain (TCG unless
// KILN_QEMU_ACCEL=kvm, SeaBIOS, a sparse disk in hdir, its NIC on the lab
// bridge: `<interface type='bridge'>`, whose tap libvirt creates when the
// domain starts and removes when it stops). The host directory and the
// domain are recorded before they are created.
func (s *server) newDomain(i int, name, hdir, bridge string) (*labDomain, error) {
	s.track(netns.Resource{Kind: netns.KindDir, Value: hdir})
	dname := "kiln-" + s.opts.Name + "-" + name
	mac := hostMAC(i)
	s.track(netns.Resource{Kind: KindDomain, Value: dname})
	vm, err := libvirt.New(libvirt.Options{
		Name: dname, Dir: hdir, DiskSize: s.opts.DiskSize, MAC: mac,
		MemoryMB: s.opts.MemoryMB, CPUs: s.opts.CPUs, Network: libvirt.Network{Bridge: bridge},
		KVM: os.Getenv("KILN_QEMU_ACCEL") == "kvm",
		// The state directory is 0700: QEMU runs as root to read it.
		RunAsRoot: true,
		Socket:    s.libvirtSocket,
		Logger:    s.log,
	})
	if err != nil {
		return nil, err
	}
	s.domains = append(s.domains, vm)
	return &labDomain{VM: vm, mac: mac, disk: filepath.Join(hdir, "disk.raw"), track: s.track}, nil
}

// PowerOn starts the domain and records its QEMU PID.
func (d *labDomain) PowerOn(ctx context.Context, bootDevice string) error {
	err := d.VM.PowerOn(ctx, bootDevice)
	b, _ := os.ReadFile(libvirt.PIDFile(d.Name()))
	if pid, perr := strconv.Atoi(strings.TrimSpace(string(b))); perr == nil && pid > 0 {
		d.mu.Lock()
		if pid != d.tracked {
			d.tracked = pid
			d.track(netns.Resource{Kind: netns.KindPID, Value: netns.ProcessID(pid)})
		}
		d.mu.Unlock()
	}
	return err
}

// removeDomain destroys and undefines a lab domain at the lab's
// libvirtd. When that is a private libvirtd that no longer answers, the
// domain's QEMU is killed by PID and its files removed after (Down).
func removeDomain(st *State, name string) error {
	if st.LibvirtSocket == "" {
		return nil
	}
	err := libvirt.Undefine(st.LibvirtSocket, name)
	if errdefs.IsUnavailable(err) && st.LibvirtPrivate {
		return nil
	}
	return err
}

// setNextBoot makes a machine whose OS can reboot it boot the device its
// BMC sets (netns hosts whose boot agent reboots, libvirt domains that
// reset), as a server's firmware reads the BMC's override at every POST.
func setNextBoot(m machine.Machine, next func() string) error {
	switch m := m.(type) {
	case *netns.Machine:
		m.SetNextBoot(next)
	case *libvirt.VM:
		return m.SetNextBoot(next)
	case *labDomain: // a lab's libvirt domain on the lab bridge
		return m.VM.SetNextBoot(next)
	}
	return nil
}
