// Package sim simulates a fleet of bare-metal hosts for the controller:
// per host a BMC (power, one-time and persistent boot device, virtual
// media) and an agent (boot agent from media, installed agent from a laid
// disk, LayImage with an operation journal, WriteIdentity, Wipe, Reboot)
// with delays and fault injection: BMC latency, BMC failure bursts, a BMC
// that lies about power, failing lays. The simulated agents check in
// through the same code path real agents do (the enrollment service's
// Heartbeat), and the controller drives them through the same executor
// (controller/provision) it drives real hosts with.
//
// It serves tests, the 10,000-host benchmark and `kiln-controller run
// --simulate`.
package sim

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kilnhq/kiln/controller/provision"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/factshash"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// CheckIn records an agent's heartbeat as the controller's Agents service
// does (enrollment.Service.Heartbeat): facts in full (nil when not sent)
// and their hash. It reports whether the controller asks for the facts.
type CheckIn func(ctx context.Context, host, address string, facts *typesv1.Facts, factsSHA256 string) (factsWanted bool, err error)

// Config sets the simulated delays. Zero values mean no delay.
type Config struct {
	// BMCLatency is the time of one BMC call.
	BMCLatency time.Duration
	// BootDelay is from power on (or reboot) to the agent's first
	// check-in.
	BootDelay time.Duration
	// LayDuration is how long LayImage takes.
	LayDuration time.Duration
	// WipeDuration is how long Wipe takes.
	WipeDuration time.Duration
	// HeartbeatInterval is how often a running agent checks in after its
	// first check-in (0: only once per boot).
	HeartbeatInterval time.Duration
	// Jitter adds up to this fraction of each delay at random.
	Jitter float64
}

// Fleet is a set of simulated hosts.
type Fleet struct {
	cfg     Config
	checkIn CheckIn
	ctx     context.Context

	mu    sync.Mutex
	hosts map[string]*Host
	// layGate, when not nil, is closed by ResumeLays: lays end only then.
	layGate chan struct{}
}

// NewFleet returns an empty fleet whose agents check in through checkIn.
// Background work (boots, heartbeats) stops when ctx ends.
func NewFleet(ctx context.Context, cfg Config, checkIn CheckIn) *Fleet {
	return &Fleet{cfg: cfg, checkIn: checkIn, ctx: ctx, hosts: map[string]*Host{}}
}

// Host returns the simulated host name, creating a powered-off one with a
// blank disk.
func (f *Fleet) Host(name string) *Host {
	f.mu.Lock()
	defer f.mu.Unlock()
	h, ok := f.hosts[name]
	if !ok {
		h = &Host{name: name, fleet: f, persistent: "disk"}
		h.bmc = &BMC{host: h}
		h.agent = &Agent{host: h}
		f.hosts[name] = h
	}
	return h
}

// Remove cuts the power of the simulated host name (its agent and
// operations end) and forgets it: a later Host(name) is a new, powered-off
// machine. A sharded controller removes the hosts of a shard it no longer
// holds: their simulation moves to the replica that takes the shard.
func (f *Fleet) Remove(name string) {
	f.mu.Lock()
	h, ok := f.hosts[name]
	delete(f.hosts, name)
	f.mu.Unlock()
	if ok {
		h.powerOff()
	}
}

// PauseLays makes every lay, running or to come, wait before it ends
// until ResumeLays: hosts stay in LayImage for as long as a test needs,
// with no timing involved.
func (f *Fleet) PauseLays() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.layGate == nil {
		f.layGate = make(chan struct{})
	}
}

// ResumeLays lets the lays paused by PauseLays end.
func (f *Fleet) ResumeLays() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.layGate != nil {
		close(f.layGate)
		f.layGate = nil
	}
}

// waitLays waits while lays are paused; false when the fleet stops.
func (f *Fleet) waitLays() bool {
	f.mu.Lock()
	g := f.layGate
	f.mu.Unlock()
	if g == nil {
		return true
	}
	select {
	case <-g:
		return true
	case <-f.ctx.Done():
		return false
	}
}

// Hosts lists the simulated hosts.
func (f *Fleet) Hosts() []*Host {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]*Host, 0, len(f.hosts))
	for _, h := range f.hosts {
		out = append(out, h)
	}
	return out
}

// BMCDialer is the executor's BMCDialer for the fleet.
func (f *Fleet) BMCDialer() provision.BMCDialer {
	return func(_ context.Context, h *typesv1.Host) (provision.BMC, error) {
		return f.Host(h.GetMetadata().GetName()).bmc, nil
	}
}

// AgentDialer is the executor's AgentDialer for the fleet.
func (f *Fleet) AgentDialer() provision.AgentDialer {
	return func(_ context.Context, h *typesv1.Host) (agentClient, error) {
		return f.Host(h.GetMetadata().GetName()).agent, nil
	}
}

// sleep waits d with jitter, or until ctx ends.
func (f *Fleet) sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	if f.cfg.Jitter > 0 {
		d += time.Duration(float64(d) * f.cfg.Jitter * rand.Float64())
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// after runs fn in a goroutine of its own after d with jitter, unless
// the fleet has stopped by then; meanwhile nothing but a timer waits.
func (f *Fleet) after(d time.Duration, fn func()) {
	if f.cfg.Jitter > 0 {
		d += time.Duration(float64(d) * f.cfg.Jitter * rand.Float64())
	}
	time.AfterFunc(d, func() {
		if f.ctx.Err() == nil {
			fn()
		}
	})
}

// Host is one simulated machine.
type Host struct {
	name  string
	fleet *Fleet
	bmc   *BMC
	agent *Agent

	mu         sync.Mutex
	power      bool
	bootOnce   string // one-time boot device, consumed by the next boot
	persistent string // persistent boot device
	media      string // virtual media URL
	diskImage  string // image laid on the disk ("" blank)
	identity   bool   // identity written into the laid image
	running    string // "", "boot" or "installed": the agent that runs
	bootSource string
	gen        int                   // power generation: ends the boots and heartbeats of older ones
	journal    map[string]*operation // the running boot agent's; nil when none runs
	lays       int
	boots      int
	layFaults  int
	slowLays   int           // lays left that take slowLay
	slowLay    time.Duration // instead of LayDuration
	ignoreOnce bool
	lastDevice string

	checkIns atomic.Int64
}

// Name is the host's name.
func (h *Host) Name() string { return h.name }

// BMC is the host's simulated BMC.
func (h *Host) BMC() *BMC { return h.bmc }

// Lays counts the image lays that completed on this host.
func (h *Host) Lays() int { h.mu.Lock(); defer h.mu.Unlock(); return h.lays }

// Boots counts the boots that ran an agent on this host.
func (h *Host) Boots() int { h.mu.Lock(); defer h.mu.Unlock(); return h.boots }

// Running is the agent running on the host: "", "boot" or "installed".
func (h *Host) Running() string { h.mu.Lock(); defer h.mu.Unlock(); return h.running }

// DiskImage is the image laid on the host's disk.
func (h *Host) DiskImage() string { h.mu.Lock(); defer h.mu.Unlock(); return h.diskImage }

// IgnoreBootOverride makes the firmware ignore one-time boot overrides
// (it boots its persistent device), as some do.
func (h *Host) IgnoreBootOverride(v bool) { h.mu.Lock(); defer h.mu.Unlock(); h.ignoreOnce = v }

// RunInstalled makes the host one that was provisioned before: powered
// on, the image laid with its identity, booting (after the boot delay)
// into its installed agent, which then heartbeats. Benchmarks of an idle
// fleet start here.
func (h *Host) RunInstalled() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.power {
		return
	}
	h.power, h.diskImage, h.identity, h.persistent = true, ImageName, true, "disk"
	h.lastDevice = "disk"
	h.startBootLocked("disk")
}

// RunBootAgent makes a powered-off host one found powered on and running
// its boot agent, booted from dev ("cdrom", from virtual media, or "pxe"),
// with the image already laid on its disk when laid, and the host's
// identity written into it when identity: the state a host is in
// mid-provisioning when the controller process that simulated it hands it
// over (a sharded controller taking a shard; the real machine would have
// kept running). The agent answers and checks in at once, with no boot
// delay: the machine was running all along (booting it again made the
// new holder's first calls meet a refusing agent, and under load a step
// past the lay timed out and laid the image again).
func (h *Host) RunBootAgent(dev string, laid, identity bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.power {
		return
	}
	h.power = true
	if laid {
		h.diskImage = ImageName
		h.identity = identity
	}
	if dev == "cdrom" && h.media == "" {
		h.media = "adopted://" + h.name
	}
	h.lastDevice = dev
	h.startBootAfterLocked(dev, 0)
}

// CheckIns counts the host's successful check-ins.
func (h *Host) CheckIns() int64 { return h.checkIns.Load() }

// PowerCut turns the host off behind the controller's back (a tripped
// PDU): the running agent and its operations end.
func (h *Host) PowerCut() { h.powerOff() }

// FailLays makes the next n lays fail with a checksum mismatch.
func (h *Host) FailLays(n int) { h.mu.Lock(); defer h.mu.Unlock(); h.layFaults = n }

// SlowLays makes the next n lays take d instead of LayDuration (plus the
// fleet's jitter): an agent slowed down by a loaded host or a slow image
// server.
func (h *Host) SlowLays(n int, d time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.slowLays, h.slowLay = n, d
}

// powerOn starts a boot unless the host is on.
func (h *Host) powerOn() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.power {
		return
	}
	h.power = true
	h.startBootLocked(h.firmwareDeviceLocked())
}

// The methods below let an external BMC emulator (the lab's Redfish
// emulator, through a machine.Machine adapter) drive the host instead of
// the simulated BMC: it decides the boot device itself ("pxe", "cdrom" or
// "disk").

// PowerOnFrom powers the host on and boots dev, unless it is on.
func (h *Host) PowerOnFrom(dev string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.power {
		return
	}
	h.power = true
	h.lastDevice = dev
	h.startBootLocked(dev)
}

// ResetFrom restarts a powered host from dev.
func (h *Host) ResetFrom(dev string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.stopLocked()
	h.power = true
	h.lastDevice = dev
	h.startBootLocked(dev)
}

// Powered reports whether the host is on.
func (h *Host) Powered() bool { h.mu.Lock(); defer h.mu.Unlock(); return h.power }

// SetMedia puts url in the virtual CD ("" ejects).
func (h *Host) SetMedia(url string) { h.mu.Lock(); defer h.mu.Unlock(); h.media = url }

// LastDevice is the device of the last boot ("" if it never ran).
func (h *Host) LastDevice() string { h.mu.Lock(); defer h.mu.Unlock(); return h.lastDevice }

// powerOff cuts power: the running agent and its operations end.
func (h *Host) powerOff() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.power {
		return
	}
	h.power = false
	h.stopLocked()
}

// reboot restarts a powered host.
func (h *Host) reboot() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.stopLocked()
	h.power = true
	h.startBootLocked(h.firmwareDeviceLocked())
}

// firmwareDeviceLocked picks the boot device as firmware does: a one-time
// override (consumed) unless ignored, else the persistent device.
func (h *Host) firmwareDeviceLocked() string {
	dev := h.persistent
	if h.bootOnce != "" {
		if !h.ignoreOnce {
			dev = h.bootOnce
		}
		h.bootOnce = ""
	}
	h.lastDevice = dev
	return dev
}

func (h *Host) stopLocked() {
	h.gen++
	h.running = ""
	h.bootSource = ""
	for _, op := range h.journal {
		op.interrupt()
	}
	// The boot agent's journal is in its RAM: gone with it. (A map
	// emptied by deletes keeps its table: 100,000 powered-off hosts held
	// 20 MiB of them.)
	h.journal = nil
}

// startBootLocked boots dev: after the boot delay it runs the agent dev
// holds (none from a blank disk) and checks it in.
func (h *Host) startBootLocked(dev string) { h.startBootAfterLocked(dev, h.fleet.cfg.BootDelay) }

// startBootAfterLocked is startBootLocked with the boot taking delay: 0
// for a machine found already running (RunBootAgent, RunInstalled).
func (h *Host) startBootAfterLocked(dev string, delay time.Duration) {
	h.gen++
	gen := h.gen
	f := h.fleet
	go func() {
		if f.sleep(f.ctx, delay) != nil {
			return
		}
		h.mu.Lock()
		if h.gen != gen {
			h.mu.Unlock()
			return
		}
		switch {
		case dev == "cdrom" && h.media != "":
			h.running, h.bootSource = "boot", "virtualmedia"
		case dev == "pxe":
			h.running, h.bootSource = "boot", "pxe"
		case h.diskImage != "" && h.identity:
			h.running, h.bootSource = "installed", "disk"
		default:
			h.mu.Unlock()
			return // nothing bootable: the controller must notice
		}
		h.boots++
		h.mu.Unlock()
		h.heartbeats(gen)
	}()
}

// heartbeats checks the agent in now and every HeartbeatInterval while
// generation gen runs. Like agent/heartbeat, it sends the hash of its
// facts every time and the facts themselves on the first check-in of a
// boot and when the controller asks for them. Between two check-ins a
// host holds a timer, not a goroutine: a fleet of 100,000 idle hosts
// would otherwise hold 100,000 sleeping goroutines' stacks (about 0.4
// GiB, docs/scale.md), which real agents, on hosts of their own, do not
// put on the controller's machine.
func (h *Host) heartbeats(gen int) { h.beat(gen, "") }

// beat checks in once (again at once when the controller asks for the
// facts, soon after a failure) and schedules the next check-in;
// delivered is the hash of the facts the controller has.
func (h *Host) beat(gen int, delivered string) {
	f := h.fleet
	for {
		h.mu.Lock()
		if h.gen != gen {
			h.mu.Unlock()
			return
		}
		facts := &typesv1.Facts{Hostname: h.name, AgentMode: h.running, BootSource: h.bootSource, AgentVersion: "sim"}
		h.mu.Unlock()
		sum := factshash.Sum(facts)
		var send *typesv1.Facts
		if sum != delivered {
			send = facts
		}
		wanted, err := f.checkIn(f.ctx, h.name, "sim://"+h.name, send, sum)
		if err == nil {
			h.checkIns.Add(1)
			if send != nil {
				delivered = sum
			}
			if wanted && send == nil {
				delivered = "" // send them now
				continue
			}
		} else if f.ctx.Err() != nil {
			return
		} else {
			// A failed heartbeat is tried again soon, as agents do.
			if f.sleep(f.ctx, 50*time.Millisecond) != nil {
				return
			}
			continue
		}
		if f.cfg.HeartbeatInterval <= 0 {
			return
		}
		f.after(f.cfg.HeartbeatInterval, func() { h.beat(gen, delivered) })
		return
	}
}

// BMC is a host's simulated BMC. Faults: Fail makes calls fail, Lie makes
// the reported power state lie.
type BMC struct {
	host *Host

	mu        sync.Mutex
	failing   bool
	failLeft  int
	lieLeft   int
	calls     int
	failures  int
	contacted bool
	last      string
}

var _ provision.BMC = (*BMC)(nil)

// Fail makes every call fail (connection refused) until Heal.
func (b *BMC) Fail() { b.mu.Lock(); defer b.mu.Unlock(); b.failing = true }

// FailNext makes the next n calls fail.
func (b *BMC) FailNext(n int) { b.mu.Lock(); defer b.mu.Unlock(); b.failLeft = n }

// Heal ends Fail.
func (b *BMC) Heal() { b.mu.Lock(); defer b.mu.Unlock(); b.failing = false; b.failLeft = 0 }

// Lie makes the next n power readings report the opposite state.
func (b *BMC) Lie(n int) { b.mu.Lock(); defer b.mu.Unlock(); b.lieLeft = n }

// Calls counts the calls made to the BMC, failed ones included.
func (b *BMC) Calls() int { b.mu.Lock(); defer b.mu.Unlock(); return b.calls }

// call takes the BMC's latency and applies the failure faults.
func (b *BMC) call(ctx context.Context, op string) error {
	if err := b.host.fleet.sleep(ctx, b.host.fleet.cfg.BMCLatency); err != nil {
		return errdefs.Unavailable("bmc %s: %s: %w", b.host.name, op, err)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.calls++
	b.contacted = true
	if b.failing || b.failLeft > 0 {
		if b.failLeft > 0 {
			b.failLeft--
		}
		b.failures++
		b.last = fmt.Sprintf("%s: dial tcp: connection refused", op)
		return errdefs.Unavailable("bmc %s: %s", b.host.name, b.last)
	}
	b.failures = 0
	return nil
}

// reported is the power state the BMC reports.
func (b *BMC) reported() string {
	h := b.host
	h.mu.Lock()
	on := h.power
	h.mu.Unlock()
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.lieLeft > 0 {
		b.lieLeft--
		on = !on
	}
	if on {
		return "on"
	}
	return "off"
}

// PowerState reads the power state.
func (b *BMC) PowerState(ctx context.Context) (string, error) {
	if err := b.call(ctx, "power state"); err != nil {
		return "", err
	}
	return b.reported(), nil
}

// PowerOn powers on and, like bmc.BMC, fails when the BMC does not then
// report the host on.
func (b *BMC) PowerOn(ctx context.Context) error {
	if err := b.call(ctx, "power on"); err != nil {
		return err
	}
	b.host.powerOn()
	if s := b.reported(); s != "on" {
		return b.lied("on", s)
	}
	return nil
}

// PowerOff cuts power.
func (b *BMC) PowerOff(ctx context.Context) error {
	if err := b.call(ctx, "power off"); err != nil {
		return err
	}
	b.host.powerOff()
	if s := b.reported(); s != "off" {
		return b.lied("off", s)
	}
	return nil
}

func (b *BMC) lied(want, got string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.failures++
	b.last = fmt.Sprintf("power %s accepted but the bmc still reports %s", want, got)
	return errdefs.Unavailable("bmc %s: %s", b.host.name, b.last)
}

// SetBootDevice sets the next (or every) boot device.
func (b *BMC) SetBootDevice(ctx context.Context, device string, persistent, _ bool) error {
	switch device {
	case "pxe", "disk", "cdrom":
	default:
		return errdefs.InvalidArgument("bmc %s: boot device %q", b.host.name, device)
	}
	if err := b.call(ctx, "set boot device"); err != nil {
		return err
	}
	h := b.host
	h.mu.Lock()
	defer h.mu.Unlock()
	if persistent {
		h.persistent, h.bootOnce = device, ""
	} else {
		h.bootOnce = device
	}
	return nil
}

// InsertVirtualMedia inserts the ISO at url.
func (b *BMC) InsertVirtualMedia(ctx context.Context, url string) error {
	if err := b.call(ctx, "insert virtual media"); err != nil {
		return err
	}
	h := b.host
	h.mu.Lock()
	defer h.mu.Unlock()
	h.media = url
	return nil
}

// Condition is the BMCReachable condition, as bmc.BMC reports it.
func (b *BMC) Condition() *typesv1.Condition {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case !b.contacted:
		return conditions.New("BMCReachable", conditions.Unknown, "NotContacted", "bmc "+b.host.name+" has not been contacted yet")
	case b.failures == 0:
		return conditions.New("BMCReachable", conditions.True, "Reachable", "bmc "+b.host.name+" answers")
	}
	c := conditions.New("BMCReachable", conditions.False, "CallFailed",
		fmt.Sprintf("bmc %s: %d consecutive failures, last: %s", b.host.name, b.failures, b.last))
	c.Severity = "Warning"
	return c
}
