package rack

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kilnhq/kiln/controller/bootserver"
	"github.com/kilnhq/kiln/e2e/lab/netns"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// dhcpConfig is the lab dnsmasq's configuration for n VM hosts on bridge:
// DHCP only (no DNS, no upstream), on the bridge only; host i (MAC
// hostMAC(i)) gets the gateway's address plus i and nobody else gets an
// address; the router is the gateway. With a boot URL, a host's iPXE
// (the VM NIC's option ROM) gets its script's URL at the boot server.
func dhcpConfig(o Options, bridge string, pfx netip.Prefix, n int, dir string) string {
	gw := pfx.Masked().Addr().Next()
	d := bootserver.DnsmasqOptions{
		Interface:  bridge,
		RangeStart: gw.Next().String(),
		Router:     gw.String(),
		LeaseFile:  filepath.Join(dir, "leases"),
		PIDFile:    filepath.Join(dir, "dnsmasq.pid"),
	}
	if o.BootURL != "" {
		// defaults checked that the template ends in /boot/ipxe/{host}.
		d.BootServer = strings.TrimSuffix(BootScriptURL(o.BootURL, "{host}", gw.String()), "/boot/ipxe/{host}")
	}
	addr := gw
	for i := 1; i <= n; i++ {
		addr = addr.Next()
		d.Hosts = append(d.Hosts, bootserver.DnsmasqHost{MAC: hostMAC(i), IP: addr.String(), Name: ResourceName(o.Name, hostName(i))})
	}
	return bootserver.DnsmasqConfig(d)
}

// startDHCP runs the lab's dnsmasq (dhcpConfig) in STATE_DIR/dnsmasq,
// recorded by its configuration file before it starts (KindDHCP) and by
// PID right after. It returns FailedPrecondition
// without dnsmasq and Unavailable when dnsmasq exits at once (its log in
// the error). Equivalent to: `dnsmasq --keep-in-foreground --user=root
// --conf-file=STATE_DIR/dnsmasq/dnsmasq.conf`.
func (s *server) startDHCP(ctx context.Context, bridge string, pfx netip.Prefix, n int) error {
	if _, err := exec.LookPath("dnsmasq"); err != nil {
		return errdefs.FailedPrecondition("lab: dnsmasq not found (Debian package dnsmasq-base): %s hosts get their addresses from it", s.opts.Backend)
	}
	dir := filepath.Join(s.dir, "dnsmasq")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("lab: dnsmasq: %w", err)
	}
	conf := filepath.Join(dir, "dnsmasq.conf")
	if err := os.WriteFile(conf, []byte(dhcpConfig(s.opts, bridge, pfx, n, dir)), 0o600); err != nil {
		return fmt.Errorf("lab: dnsmasq: %w", err)
	}
	s.track(netns.Resource{Kind: KindDHCP, Value: conf})
	logPath := filepath.Join(dir, "dnsmasq.log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("lab: dnsmasq: %w", err)
	}
	defer logf.Close()
	// --user=root: the lease file is in the 0700 state directory.
	cmd := exec.Command("dnsmasq", "--keep-in-foreground", "--log-facility=-", "--user=root", dhcpArg(conf))
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("lab: start dnsmasq: %w", err)
	}
	id := netns.ProcessID(cmd.Process.Pid)
	s.track(netns.Resource{Kind: netns.KindPID, Value: id})
	s.update(func(st *State) { st.DHCP = id })
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	s.dnsmasq, s.dnsmasqDone = cmd, done
	// dnsmasq binds the bridge (or fails) before it would answer anything.
	select {
	case <-done:
		s.dnsmasq = nil
		return errdefs.Unavailable("lab: dnsmasq on %s exited: %s", bridge, logTail(logPath))
	case <-time.After(300 * time.Millisecond):
	case <-ctx.Done():
		return ctx.Err()
	}
	s.log.Info("dnsmasq serves DHCP on the lab bridge", "bridge", bridge, "pid", cmd.Process.Pid)
	return nil
}

// dhcpArg is the argument that tells the lab's dnsmasq apart from any
// other process: its configuration file in the lab's state directory.
func dhcpArg(conf string) string { return "--conf-file=" + conf }

// killDHCP kills (SIGKILL) every process started with the lab's dnsmasq
// configuration conf (KindDHCP), found by that argument in
// /proc/PID/cmdline: a dnsmasq whose PID the supervisor had no time to
// record. A process that is gone is not an error.
func killDHCP(conf string) error {
	procs, err := os.ReadDir("/proc")
	if err != nil {
		return fmt.Errorf("dnsmasq %s: %w", conf, err)
	}
	want := dhcpArg(conf)
	var errs []error
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", p.Name(), "cmdline"))
		if err != nil || !slices.Contains(strings.Split(string(b), "\x00"), want) {
			continue
		}
		if err := netns.KillProcess(netns.ProcessID(pid)); err != nil {
			errs = append(errs, fmt.Errorf("dnsmasq %d: %w", pid, err))
		}
	}
	return errors.Join(errs...)
}

// stopDHCP stops the lab's dnsmasq: SIGTERM, then SIGKILL after 5 s.
func (s *server) stopDHCP() {
	if s.dnsmasq == nil {
		return
	}
	_ = s.dnsmasq.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.dnsmasqDone:
	case <-time.After(5 * time.Second):
		_ = s.dnsmasq.Process.Kill()
		<-s.dnsmasqDone
	}
	s.dnsmasq = nil
}
