package bmc_test

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/bmc"
	"github.com/kilnhq/kiln/e2e/lab/ipmisim"
	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

func requireIPMITools(t testing.TB) {
	t.Helper()
	for _, tool := range []string{"ipmi_sim", "ipmitool"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (Debian packages openipmi and ipmitool)", tool)
		}
	}
}

type ipmiHost struct {
	sim *ipmisim.Sim
	m   *machine.Process
	b   *bmc.BMC
}

// startIPMIHosts starts n ipmi_sim BMCs, each driving a process machine
// running `sleep 3600`.
func startIPMIHosts(t testing.TB, n int, opts bmc.Options) []ipmiHost {
	t.Helper()
	requireIPMITools(t)
	ctx := ctxTimeout(t, 2*time.Minute)
	chassis, err := ipmisim.BuildChassis(ctx, t.TempDir())
	require.NoError(t, err)
	hosts := make([]ipmiHost, n)
	for i := range hosts {
		m, err := machine.NewProcess(machine.ProcessOptions{Command: []string{"sleep", "3600"}, GracePeriod: 2 * time.Second})
		require.NoError(t, err)
		t.Cleanup(func() { _ = m.Close() })
		sim, err := ipmisim.Start(ctx, ipmisim.Options{
			User: "kiln", Password: testPassword, ChassisProgram: chassis, Machine: m, Dir: t.TempDir(),
		})
		require.NoError(t, err)
		t.Cleanup(sim.Stop)
		o := opts
		o.Name = fmt.Sprintf("ipmi-%d", i)
		b, err := bmc.Dial(ctx, bmc.Endpoint{
			Protocol: bmc.ProtocolIPMI, Address: sim.Addr(), Username: "kiln", Password: testPassword,
		}, o)
		require.NoError(t, err)
		hosts[i] = ipmiHost{sim: sim, m: m, b: b}
	}
	return hosts
}

func processAlive(pid int) bool {
	return pid > 0 && syscall.Kill(pid, 0) == nil
}

func TestIPMIThreeSimulators(t *testing.T) {
	opts := fastOpts("")
	opts.AttemptTimeout = 20 * time.Second
	opts.PollInterval = 100 * time.Millisecond
	hosts := startIPMIHosts(t, 3, opts)

	var wg sync.WaitGroup
	errs := make([]error, len(hosts))
	for i, h := range hosts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = exerciseIPMIHost(h)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("host %d: %v\nchassis calls: %s", i, err, strings.Join(hosts[i].sim.Calls(), "; "))
		}
	}
}

// exerciseIPMIHost runs the power and boot operations against one
// simulator and checks the machine's process after each.
func exerciseIPMIHost(h ipmiHost) error {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	b, m := h.b, h.m

	state, err := b.PowerState(ctx)
	if err != nil || state != bmc.PowerOff {
		return fmt.Errorf("PowerState() = %q, %v, want off", state, err)
	}
	if err := b.SetBootDevice(ctx, bmc.BootPXE, false, true); err != nil {
		return fmt.Errorf("SetBootDevice(pxe): %w", err)
	}
	if err := b.PowerOn(ctx); err != nil {
		return fmt.Errorf("PowerOn(): %w", err)
	}
	pid := m.PID()
	if !processAlive(pid) || m.BootSource() != machine.BootPXE {
		return fmt.Errorf("after PowerOn: pid %d alive=%v boot %q, want a live process booted from pxe", pid, processAlive(pid), m.BootSource())
	}
	if state, err := b.PowerState(ctx); err != nil || state != bmc.PowerOn {
		return fmt.Errorf("PowerState() after PowerOn = %q, %v, want on", state, err)
	}
	if err := bmc.VerifyBoot(bmc.BootPXE, "pxe"); err != nil {
		return err
	}

	if err := b.PowerCycle(ctx); err != nil {
		return fmt.Errorf("PowerCycle(): %w", err)
	}
	pid2 := m.PID()
	if processAlive(pid) || !processAlive(pid2) || pid2 == pid {
		return fmt.Errorf("after PowerCycle: old pid %d alive=%v, new pid %d alive=%v: want the process restarted", pid, processAlive(pid), pid2, processAlive(pid2))
	}
	// The pxe override was one-time: the cycle boots from disk.
	if m.BootSource() != machine.BootDisk {
		return fmt.Errorf("after PowerCycle boot source = %q, want disk", m.BootSource())
	}

	if err := b.SetBootDevice(ctx, bmc.BootCDROM, false, true); err != nil {
		return fmt.Errorf("SetBootDevice(cdrom): %w", err)
	}
	if err := b.PowerSoft(ctx); err != nil {
		return fmt.Errorf("PowerSoft(): %w", err)
	}
	if processAlive(pid2) {
		return fmt.Errorf("after PowerSoft pid %d still alive", pid2)
	}
	if err := b.PowerOn(ctx); err != nil {
		return fmt.Errorf("PowerOn() after soft off: %w", err)
	}
	if m.BootSource() != machine.BootCD {
		return fmt.Errorf("boot source = %q, want cd", m.BootSource())
	}
	pid3 := m.PID()
	if err := b.PowerOff(ctx); err != nil {
		return fmt.Errorf("PowerOff(): %w", err)
	}
	if processAlive(pid3) || m.State() {
		return fmt.Errorf("after PowerOff pid %d alive=%v", pid3, processAlive(pid3))
	}
	if err := b.InsertVirtualMedia(ctx, "http://127.0.0.1:9/a.iso"); !errdefs.IsNotSupported(err) {
		return fmt.Errorf("InsertVirtualMedia() over ipmi = %v, want NotSupported", err)
	}
	return nil
}

func TestIPMIWrongPasswordNeverShown(t *testing.T) {
	opts := fastOpts("")
	opts.MaxAttempts = 1
	hosts := startIPMIHosts(t, 1, opts)
	const wrong = "Wr0ng-Pa55word-xyz"
	b, err := bmc.Dial(context.Background(), bmc.Endpoint{
		Protocol: bmc.ProtocolIPMI, Address: hosts[0].sim.Addr(), Username: "kiln", Password: wrong,
	}, opts)
	require.NoError(t, err)
	_, err = b.PowerState(ctxTimeout(t, 30*time.Second))
	require.Error(t, err)
	if strings.Contains(err.Error(), wrong) {
		t.Fatalf("PowerState() error contains the password: %q", err)
	}
	if hosts[0].m.State() {
		t.Fatalf("machine powered on by a call with a wrong password")
	}
}

func TestIPMIUnreachableReturnsByDeadline(t *testing.T) {
	requireIPMITools(t)
	opts := fastOpts("nobody")
	b, err := bmc.Dial(context.Background(), bmc.Endpoint{
		// A loopback port nobody listens on.
		Protocol: bmc.ProtocolIPMI, Address: "127.0.0.1:9", Username: "kiln", Password: testPassword,
	}, opts)
	require.NoError(t, err)
	const deadline = 1500 * time.Millisecond
	start := time.Now()
	_, err = b.PowerState(ctxTimeout(t, deadline))
	elapsed := time.Since(start)
	if !errdefs.IsUnavailable(err) {
		t.Fatalf("PowerState() of an unreachable bmc: error = %v, want Unavailable", err)
	}
	if elapsed > deadline+2*time.Second {
		t.Fatalf("PowerState() returned after %v, deadline was %v", elapsed, deadline)
	}
}
