package qemu_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/bmc"
	"github.com/kilnhq/kiln/controller/bootserver"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/e2e/lab/ipmisim"
	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/e2e/lab/qemu"
	"github.com/kilnhq/kiln/e2e/lab/redfish"
	"github.com/kilnhq/kiln/imagebuilder/bootmedia"
	"github.com/kilnhq/kiln/imagebuilder/bootmedia/bootmediatest"
	"github.com/kilnhq/kiln/internal/testenv"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// bootTimeout bounds one VM boot into the agent under TCG on a loaded
// 2-core machine (a boot takes 10-20 s when idle).
const bootTimeout = 4 * time.Minute

var media struct {
	once sync.Once
	dir  string
}

// bootMedia builds the boot media once per test process.
func bootMedia(t testing.TB) string {
	t.Helper()
	if testing.Short() {
		t.Skip("boots a VM")
	}
	needQEMU(t)
	media.once.Do(func() {
		dir, err := os.MkdirTemp("", "kiln-qemu-media-")
		require.NoError(t, err)
		bootmediatest.Build(t, dir)
		media.dir = dir
	})
	if media.dir == "" {
		testenv.Skip(t, "boot media could not be built (see the first boot test)")
	}
	if _, err := os.Stat(filepath.Join(media.dir, bootmedia.ManifestFile)); err != nil {
		testenv.Skip(t, "boot media could not be built (see the first boot test)")
	}
	return media.dir
}

func TestMain(m *testing.M) {
	code := m.Run()
	if media.dir != "" {
		os.RemoveAll(media.dir)
	}
	os.Exit(code)
}

// staticNet gives hosts a static boot network.
type staticNet map[string]*bootserver.BootNetwork

func (n staticNet) BootNetwork(_ context.Context, host string) (*bootserver.BootNetwork, error) {
	return n[host], nil
}

// nicAddresses lists the addresses of the host's NICs from its facts.
func nicAddresses(h *typesv1.Host) string {
	var addrs []string
	for _, n := range h.GetStatus().GetFacts().GetNics() {
		addrs = append(addrs, n.GetAddresses()...)
	}
	return strings.Join(addrs, " ")
}

// tokens issues real one-time enrollment tokens of the controller, bound
// to the host, as the controller's own TokenIssuer does.
type tokens struct{ env *controllertest.Env }

func (i tokens) BootToken(ctx context.Context, host string) (string, error) {
	tok, _, err := i.env.Controller.CreateToken(ctx, 30*time.Minute, host, "boot media of "+host)
	return tok, err
}

// waitEnrolled waits until the host's boot agent has enrolled and sent a
// heartbeat, and returns the Host.
func waitEnrolled(t testing.TB, env *controllertest.Env, vm *qemu.VM, host string) *typesv1.Host {
	t.Helper()
	deadline := time.Now().Add(bootTimeout)
	for time.Now().Before(deadline) {
		h := &typesv1.Host{}
		if _, err := env.Store().Get(context.Background(), enrollment.HostsKind, host, h); err == nil &&
			h.GetStatus().GetAgent().GetLastHeartbeat() != nil {
			return h
		}
		time.Sleep(500 * time.Millisecond)
	}
	b, _ := os.ReadFile(vm.SerialLog())
	t.Fatalf("host %s did not enroll and check in within %s; serial console:\n%s", host, bootTimeout, tail(string(b), 40))
	return nil
}

func controllerPort(t testing.TB, env *controllertest.Env) string {
	_, port, err := net.SplitHostPort(env.Addr)
	require.NoError(t, err)
	return port
}

// userNetBootServer serves the boot media on loopback for VMs on
// user-mode networking, which reach the host's loopback as 10.0.2.2.
func userNetBootServer(t testing.TB, env *controllertest.Env, dir string, nets bootserver.NetworkSource) *httptest.Server {
	bs, err := bootserver.New(bootserver.Options{
		MediaDir:       dir,
		ControllerAddr: "10.0.2.2:" + controllerPort(t, env),
		CAHash:         env.CAHash,
		Tokens:         tokens{env},
		Networks:       nets,
		ISOCacheDir:    t.TempDir(),
	})
	require.NoError(t, err)
	ts := httptest.NewServer(bs)
	t.Cleanup(func() { ts.Close(); bs.Close() })
	return ts
}

func checkBoot(tb testing.TB, r *bootResult, wantSource string) {
	tb.Helper()
	h := r.host
	if got := h.GetStatus().GetAgent().GetBootSource(); got != wantSource {
		tb.Errorf("host %s reports boot source %q, want %q", h.GetMetadata().GetName(), got, wantSource)
	}
	if got := h.GetStatus().GetAgent().GetMode(); got != "boot" {
		tb.Errorf("host %s agent mode %q, want boot", h.GetMetadata().GetName(), got)
	}
	if got := h.GetStatus().GetFacts().GetOsId(); got != "kiln-boot" {
		tb.Errorf("host %s facts os_id %q, want kiln-boot (the boot media's os-release)", h.GetMetadata().GetName(), got)
	}
	if r.agentUp == 0 {
		tb.Errorf("serial console lacks kiln-init: agent up")
	}
	tb.Logf("%s boot: agent up after %.1fs, enrolled and checked in after %.1fs", wantSource, r.agentUp.Seconds(), r.enrolled.Seconds())
}

// bootResult is what a boot into the agent gave.
type bootResult struct {
	env *controllertest.Env
	vm  *qemu.VM
	// host as the controller stored it after the agent checked in.
	host *typesv1.Host
	// agentUp is the time from power on to "kiln-init: agent up" on the
	// serial console; enrolled to the agent's first heartbeat.
	agentUp, enrolled time.Duration
}

// watchAgentUp reports the time from t0 until the serial console shows
// the init starting the agent.
func watchAgentUp(vm *qemu.VM, t0 time.Time, stop <-chan struct{}) <-chan time.Duration {
	ch := make(chan time.Duration, 1)
	go func() {
		for {
			b, _ := os.ReadFile(vm.SerialLog())
			if strings.Contains(string(b), "kiln-init: agent up") {
				ch <- time.Since(t0)
				return
			}
			select {
			case <-stop:
				ch <- 0
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	return ch
}

func finish(tb testing.TB, r *bootResult, name string, t0 time.Time) {
	stop := make(chan struct{})
	up := watchAgentUp(r.vm, t0, stop)
	r.host = waitEnrolled(tb, r.env, r.vm, name)
	r.enrolled = time.Since(t0)
	close(stop)
	r.agentUp = <-up
}

// bootISO boots a VM named name from its per-host ISO (virtual media from
// the boot server, on user-mode networking) into the agent.
func bootISO(tb testing.TB, name string) *bootResult { return bootISOFirmware(tb, name, false) }

func bootISOFirmware(tb testing.TB, name string, uefi bool) *bootResult {
	dir := bootMedia(tb)
	env := controllertest.Start(tb)
	ts := userNetBootServer(tb, env, dir, nil)
	vm := newVM(tb, qemu.Options{Name: name, DiskSize: 64 << 20, UEFI: uefi})
	require.NoError(tb, vm.InsertMedia(bootserver.ISOURL(ts.URL, name)))
	t0 := time.Now()
	require.NoError(tb, vm.PowerOn(context.Background(), machine.BootCD))
	r := &bootResult{env: env, vm: vm}
	finish(tb, r, name, t0)
	return r
}

// TestISOBootEnrolls inserts the host's ISO from the boot server as
// virtual media, powers the VM on from CD over QMP, and waits for its boot
// agent to enroll with the controller using the ISO's one-time token and
// report boot source virtualmedia. The VM runs UEFI firmware (OVMF) when
// installed; the Redfish test boots the same kind of ISO under BIOS.
func TestISOBootEnrolls(t *testing.T) {
	_, err := os.Stat("/usr/share/OVMF/OVMF_CODE_4M.fd")
	uefi := err == nil
	if !uefi {
		t.Log("OVMF not installed (apt-get install ovmf): booting the ISO under BIOS")
	}
	r := bootISOFirmware(t, "iso-vm1", uefi)
	checkBoot(t, r, "virtualmedia")
	if b, _ := os.ReadFile(r.vm.SerialLog()); uefi && strings.Contains(string(b), "SeaBIOS") {
		t.Errorf("the UEFI VM booted SeaBIOS")
	}

	// A graceful power off reaches the guest's power button handler.
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	require.NoError(t, r.vm.PowerOff(ctx, true))
	if r.vm.State() {
		t.Errorf("State() after a graceful PowerOff = on")
	}
	b, _ := os.ReadFile(r.vm.SerialLog())
	if !strings.Contains(string(b), "kiln-init: power button") {
		t.Errorf("graceful power off did not reach the guest (no power button message); power was cut")
	}
}

// TestGuestRebootBootsNextDevice: with SetNextBoot, a reboot the guest
// asks for itself boots the device next names (what a host's BMC sets),
// not the one of the last power on. The VM is powered on from its blank
// disk with an empty CD drive: SeaBIOS finds nothing to boot and resets
// the machine (RebootTimeout). Once it said so, the host's ISO goes into
// the drive; the next reset makes the CD first (next says cd) and the
// agent on the ISO enrolls from virtual media.
func TestGuestRebootBootsNextDevice(t *testing.T) {
	dir := bootMedia(t)
	env := controllertest.Start(t)
	ts := userNetBootServer(t, env, dir, nil)
	const name = "reboot-vm1"
	vm := newVM(t, qemu.Options{Name: name, DiskSize: 64 << 20, RebootTimeout: 5 * time.Second,
		Logger: slog.New(slog.NewTextHandler(logWriter{t}, nil))})
	var asked atomic.Int32
	vm.SetNextBoot(func() string { asked.Add(1); return machine.BootCD })
	t0 := time.Now()
	require.NoError(t, vm.PowerOn(context.Background(), machine.BootDisk))
	require.Eventually(t, func() bool {
		b, _ := os.ReadFile(vm.SerialLog())
		return strings.Contains(string(b), "No bootable device")
	}, bootTimeout, 200*time.Millisecond, "SeaBIOS never said it found nothing to boot")
	t.Logf("firmware found nothing to boot after %s", time.Since(t0).Round(time.Second))
	require.NoError(t, vm.InsertMedia(bootserver.ISOURL(ts.URL, name)))
	r := &bootResult{env: env, vm: vm}
	finish(t, r, name, t0)
	t.Logf("power on to the agent enrolled from CD after the firmware's reboot: %s", r.enrolled.Round(time.Second))
	checkBoot(t, r, "virtualmedia")
	var idx int
	err := vm.QMP().Execute(context.Background(), "qom-get", map[string]any{"path": "/machine/peripheral/cd0dev", "property": "bootindex"}, &idx)
	require.NoError(t, err)
	if got := vm.BootSource(); got != machine.BootCD || asked.Load() == 0 || idx != 1 {
		t.Errorf("after the guest's reboot: BootSource() = %q, next asked %d times, CD bootindex %d; want cd, asked, 1", got, asked.Load(), idx)
	}
}

type logWriter struct{ t testing.TB }

func (w logWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// TestRedfishVirtualMediaBoot is the lab rack's QEMU test: a Redfish BMC
// (the lab's emulator) in front of the VM, driven by Kiln's bmc package:
// InsertVirtualMedia(ISO URL) + SetBootDevice(cdrom, once) + PowerOn boot
// the VM into the agent, which enrolls and reports virtualmedia.
func TestRedfishVirtualMediaBoot(t *testing.T) {
	dir := bootMedia(t)
	env := controllertest.Start(t)
	// A rack without DHCP: the ISO carries the host's static address (the
	// user-mode network's DHCP would hand out 10.0.2.15).
	ts := userNetBootServer(t, env, dir, staticNet{"rf-vm1": {Address: "10.0.2.50/24", Gateway: "10.0.2.2", MAC: "52:54:00:4b:69:02"}})
	vm := newVM(t, qemu.Options{Name: "rf-vm1", DiskSize: 64 << 20, MAC: "52:54:00:4b:69:02"})

	emu, err := redfish.New(redfish.Config{
		Username: "admin", Password: "lab-secret",
		Systems: []redfish.System{{ID: "rf-vm1", Machine: vm, MACs: []string{"52:54:00:4b:69:02"}}},
	})
	require.NoError(t, err)
	emu.Start()
	t.Cleanup(emu.Close)
	ctx, cancel := context.WithTimeout(context.Background(), bootTimeout)
	defer cancel()
	b, err := bmc.Dial(ctx, bmc.Endpoint{Protocol: bmc.ProtocolRedfish, Address: emu.URL(), Username: "admin", Password: "lab-secret"}, bmc.Options{Name: "rf-vm1"})
	require.NoError(t, err)

	require.NoError(t, b.InsertVirtualMedia(ctx, bootserver.ISOURL(ts.URL, "rf-vm1")))
	require.NoError(t, b.SetBootDevice(ctx, bmc.BootCDROM, false, false))
	t0 := time.Now()
	require.NoError(t, b.PowerOn(ctx))
	r := &bootResult{env: env, vm: vm}
	finish(t, r, "rf-vm1", t0)
	checkBoot(t, r, "virtualmedia")
	h := r.host
	if err := bmc.VerifyBoot(bmc.BootCDROM, h.GetStatus().GetAgent().GetBootSource()); err != nil {
		t.Errorf("VerifyBoot(cdrom, %q) = %v", h.GetStatus().GetAgent().GetBootSource(), err)
	}
	if vm.BootSource() != machine.BootCD {
		t.Errorf("VM BootSource() = %q, want cd", vm.BootSource())
	}
	if target, enabled, _ := emu.BootOverride("rf-vm1"); enabled != "Disabled" {
		t.Errorf("one-time override after boot = %s/%s, want consumed (Disabled)", target, enabled)
	}
	if st, err := b.PowerState(ctx); err != nil || st != bmc.PowerOn {
		t.Errorf("PowerState() = %q, %v, want on", st, err)
	}
	if got := nicAddresses(h); !strings.Contains(got, "10.0.2.50/24") {
		t.Errorf("agent facts addresses %q, want the static 10.0.2.50/24", got)
	}
	if s, _ := os.ReadFile(vm.SerialLog()); !strings.Contains(string(s), "kiln-init: net static eth0 10.0.2.50/24 gateway 10.0.2.2") {
		t.Errorf("serial console lacks the static network line")
	}
	require.NoError(t, b.PowerOff(ctx))
	if vm.State() {
		t.Errorf("VM still on after a Redfish ForceOff")
	}
}

// TestPXEBootEnrolls boots a VM by PXE on a lab network namespace, powered
// on through an IPMI BMC (ipmi_sim) with a one-time PXE boot: QEMU's
// iPXE ROM gets an address and the host's iPXE script URL from dnsmasq
// (configured by bootserver.DnsmasqConfig), fetches the script, kernel and
// initramfs from the boot server, and the agent enrolls through a forward
// to the controller and reports boot source pxe.
func TestPXEBootEnrolls(t *testing.T) {
	r := bootPXE(t, "pxe-vm1")
	checkBoot(t, r, "pxe")
	if got := nicAddresses(r.host); !strings.Contains(got, "10.77.0.10/") {
		t.Errorf("agent facts addresses %q, want the dnsmasq reservation 10.77.0.10", got)
	}
}

// bootPXE boots a VM named name by PXE on a lab network into the agent.
func bootPXE(t testing.TB, name string) *bootResult {
	dir := bootMedia(t)
	if os.Geteuid() != 0 {
		testenv.Skip(t, "PXE on a lab network namespace needs root")
	}
	env := controllertest.Start(t)
	ctx := context.Background()
	ln, err := qemu.NewLabNet(ctx, qemu.LabNetOptions{Dir: t.TempDir()})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, ln.Close()) })

	ip := ln.IP()
	require.NoError(t, ln.Forward(ip+":7443", env.Addr))
	bs, err := bootserver.New(bootserver.Options{
		MediaDir:       dir,
		ControllerAddr: ip + ":7443",
		CAHash:         env.CAHash,
		Tokens:         tokens{env},
	})
	require.NoError(t, err)
	t.Cleanup(func() { bs.Close() })
	lis, err := ln.Listen(ip + ":8080")
	require.NoError(t, err)
	srv := &http.Server{Handler: bs}
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(func() { srv.Close() })

	const mac = "52:54:00:4b:69:03"
	conf := bootserver.DnsmasqConfig(bootserver.DnsmasqOptions{
		Interface:  ln.Bridge(),
		RangeStart: "10.77.0.100", RangeEnd: "10.77.0.150",
		BootServer: "http://" + ip + ":8080",
		Hosts:      []bootserver.DnsmasqHost{{MAC: mac, IP: "10.77.0.10", Name: name}},
		EnableRA:   true,
		LeaseFile:  filepath.Join(t.TempDir(), "leases"),
	})
	require.NoError(t, ln.StartDnsmasq(ctx, conf))

	vm := newVM(t, qemu.Options{Name: name, DiskSize: 64 << 20, MAC: mac,
		Network: qemu.Network{Netns: ln.Name(), Tap: ln.Tap()}})
	power := ipmiPowerOnPXE(t, vm)
	t0 := time.Now()
	require.NoError(t, power(ctx))
	r := &bootResult{env: env, vm: vm}
	finish(t, r, name, t0)
	if vm.BootSource() != machine.BootPXE {
		t.Errorf("VM BootSource() = %q, want pxe", vm.BootSource())
	}
	return r
}

// ipmiPowerOnPXE returns how the PXE host is powered on: through an
// IPMI BMC (ipmi_sim driving the VM, Kiln's bmc package over ipmitool:
// one-time boot device pxe, power on), as for an IPMI-only rack, or
// directly over QMP when ipmi_sim or ipmitool is not installed.
func ipmiPowerOnPXE(t testing.TB, vm *qemu.VM) func(context.Context) error {
	for _, tool := range []string{"ipmi_sim", "ipmitool"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Logf("%s not installed (openipmi, ipmitool): powering on over QMP instead of IPMI", tool)
			return func(ctx context.Context) error { return vm.PowerOn(ctx, machine.BootPXE) }
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	chassis, err := ipmisim.BuildChassis(ctx, t.TempDir())
	require.NoError(t, err)
	sim, err := ipmisim.Start(ctx, ipmisim.Options{User: "lab", Password: "lab-ipmi-pw", ChassisProgram: chassis, Machine: vm})
	require.NoError(t, err)
	t.Cleanup(sim.Stop)
	return func(ctx context.Context) error {
		b, err := bmc.Dial(ctx, bmc.Endpoint{Protocol: bmc.ProtocolIPMI, Address: sim.Addr(), Username: "lab", Password: "lab-ipmi-pw"}, bmc.Options{Name: "pxe-bmc"})
		if err != nil {
			return err
		}
		if err := b.SetBootDevice(ctx, bmc.BootPXE, false, false); err != nil {
			return err
		}
		return b.PowerOn(ctx)
	}
}

// BenchmarkBoot measures power on to "agent up" on the serial console and
// to the agent's enrollment and first heartbeat, per boot path. Run with
// -benchtime=1x: one boot is 10-40 s under TCG.
func BenchmarkBoot(b *testing.B) {
	for _, tc := range []struct {
		name string
		boot func(testing.TB, string) *bootResult
	}{
		{"iso", bootISO},
		{"iso-uefi", func(tb testing.TB, name string) *bootResult { return bootISOFirmware(tb, name, true) }},
		{"pxe", bootPXE},
	} {
		b.Run(tc.name, func(b *testing.B) {
			var up, enrolled time.Duration
			for i := range b.N {
				r := tc.boot(b, fmt.Sprintf("bench-%s-%d", tc.name, i))
				up += r.agentUp
				enrolled += r.enrolled
				require.NoError(b, r.vm.Close()) // one VM at a time
			}
			b.ReportMetric(up.Seconds()/float64(b.N), "s-to-agent-up")
			b.ReportMetric(enrolled.Seconds()/float64(b.N), "s-to-enrolled")
		})
	}
}

// BenchmarkConcurrentBoot measures what N TCG VMs booted at once cost on
// this machine: each VM boots its own ISO (virtual media from the boot
// server) into the agent, which enrolls with one controller. It reports
// the slowest VM's time to "agent up" and to enrolled, and the CPU the
// QEMU processes used (seconds, user + system, from /proc/PID/stat) up to
// that point. Opt-in, not in make test: KILN_QEMU_CONCURRENT=3,4 go test
// -run XXX -bench ConcurrentBoot -benchtime=1x ./e2e/lab/qemu/ (docs/lab.md,
// "What 3 and 4 TCG hosts cost").
func BenchmarkConcurrentBoot(b *testing.B) {
	spec := os.Getenv("KILN_QEMU_CONCURRENT")
	if spec == "" {
		b.Skip("set KILN_QEMU_CONCURRENT=3,4 (VMs booted at once) to run")
	}
	for _, f := range strings.Split(spec, ",") {
		var n int
		if _, err := fmt.Sscan(f, &n); err != nil || n < 1 {
			b.Fatalf("KILN_QEMU_CONCURRENT=%q: want VM counts such as 3,4", spec)
		}
		// No "=" in the name: it goes into temp dir paths, and xorriso reads
		// "=" in a path as a graft point.
		b.Run(fmt.Sprintf("%dvms", n), func(b *testing.B) {
			for range b.N {
				concurrentBoot(b, n)
			}
		})
	}
}

func concurrentBoot(b *testing.B, n int) {
	dir := bootMedia(b)
	env := controllertest.Start(b)
	ts := userNetBootServer(b, env, dir, nil)
	type vmRun struct {
		name string
		vm   *qemu.VM
		r    *bootResult
	}
	runs := make([]*vmRun, n)
	for i := range runs {
		name := fmt.Sprintf("cc%d-vm%d", n, i+1)
		vm := newVM(b, qemu.Options{Name: name, DiskSize: 64 << 20, MAC: fmt.Sprintf("52:54:00:4b:6a:%02x", i+1)})
		require.NoError(b, vm.InsertMedia(bootserver.ISOURL(ts.URL, name)))
		runs[i] = &vmRun{name: name, vm: vm}
	}
	load0 := loadAvg()
	t0 := time.Now()
	for _, r := range runs {
		require.NoError(b, r.vm.PowerOn(context.Background(), machine.BootCD))
	}
	var wg sync.WaitGroup
	for _, r := range runs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.r = &bootResult{env: env, vm: r.vm}
			finish(b, r.r, r.name, t0)
		}()
	}
	wg.Wait()
	wall := time.Since(t0)
	var maxUp, maxEnrolled time.Duration
	cpu := 0.0
	for _, r := range runs {
		maxUp, maxEnrolled = max(maxUp, r.r.agentUp), max(maxEnrolled, r.r.enrolled)
		c := cpuSeconds(r.vm.PID())
		cpu += c
		// Printed, not logged: a benchmark's log is cut at a few lines and
		// the controller's fill them.
		fmt.Printf("%s: agent up %.1fs, enrolled %.1fs, QEMU CPU %.1fs\n", r.name, r.r.agentUp.Seconds(), r.r.enrolled.Seconds(), c)
	}
	fmt.Printf("%d VMs: all enrolled after %.1fs; QEMU CPU %.1fs in all (%.2f cores busy on average); load average %s before, %s after\n",
		n, wall.Seconds(), cpu, cpu/wall.Seconds(), load0, loadAvg())
	b.ReportMetric(maxUp.Seconds(), "s-slowest-agent-up")
	b.ReportMetric(maxEnrolled.Seconds(), "s-slowest-enrolled")
	b.ReportMetric(cpu, "s-qemu-cpu")
}

// cpuSeconds is the user + system CPU time of process pid (fields 14 and
// 15 of /proc/PID/stat, in clock ticks of 1/100 s on Linux).
func cpuSeconds(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0
	}
	var utime, stime float64
	fmt.Sscan(f[11], &utime)
	fmt.Sscan(f[12], &stime)
	return (utime + stime) / 100
}

func loadAvg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}
