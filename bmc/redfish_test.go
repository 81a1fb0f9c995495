package bmc_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/bmc"
	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/e2e/lab/redfish"
	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
)

const (
	testUser     = "kiln-admin"
	testPassword = "s3cret-Pa55word!"
)

// fastOpts keep retries and polls short so fault tests finish quickly.
func fastOpts(name string) bmc.Options {
	return bmc.Options{
		Name:           name,
		AttemptTimeout: 2 * time.Second,
		MaxAttempts:    4,
		Backoff:        backoff.Policy{Base: 20 * time.Millisecond, Max: 200 * time.Millisecond, Factor: 2, Jitter: 0.2},
		PollInterval:   20 * time.Millisecond,
	}
}

func startEmulator(t *testing.T, cfg redfish.Config) *redfish.BMC {
	t.Helper()
	if cfg.Username == "" {
		cfg.Username, cfg.Password = testUser, testPassword
	}
	e, err := redfish.New(cfg)
	require.NoError(t, err)
	e.Start()
	t.Cleanup(e.Close)
	return e
}

func oneSystem(m machine.Machine) []redfish.System {
	return []redfish.System{{
		ID: "437XR1138R2", Name: "WebFrontEnd483", Manufacturer: "Contoso", Model: "3500",
		SerialNumber: "437XR1138R2", MACs: []string{"12:44:6A:3B:04:11", "12:44:6a:3b:88:90"}, Machine: m,
	}}
}

func dialEmulator(t *testing.T, e *redfish.BMC, opts bmc.Options) *bmc.BMC {
	t.Helper()
	b, err := bmc.Dial(context.Background(), bmc.Endpoint{
		Protocol: bmc.ProtocolRedfish, Address: e.URL(), Username: testUser, Password: testPassword,
	}, opts)
	require.NoError(t, err)
	return b
}

func ctxTimeout(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestRedfishPowerBootMedia(t *testing.T) {
	m := &machine.Memory{}
	e := startEmulator(t, redfish.Config{Systems: oneSystem(m)})
	b := dialEmulator(t, e, fastOpts("rack1-u1"))
	ctx := ctxTimeout(t, 30*time.Second)

	require.Equal(t, conditions.Unknown, b.Condition().GetStatus())

	state, err := b.PowerState(ctx)
	require.NoError(t, err)
	if state != bmc.PowerOff {
		t.Fatalf("PowerState() = %q, want %q", state, bmc.PowerOff)
	}

	require.NoError(t, b.InsertVirtualMedia(ctx, "http://127.0.0.1:9/agent.iso"))
	if got := m.Media(); got != "http://127.0.0.1:9/agent.iso" {
		t.Fatalf("after InsertVirtualMedia machine media = %q", got)
	}
	require.NoError(t, b.SetBootDevice(ctx, bmc.BootCDROM, false, true))
	target, enabled, mode := e.BootOverride("437XR1138R2")
	if target != "Cd" || enabled != "Once" || mode != "UEFI" {
		t.Fatalf("boot override = %s/%s/%s, want Cd/Once/UEFI", target, enabled, mode)
	}

	require.NoError(t, b.PowerOn(ctx))
	if !m.State() || m.BootSource() != machine.BootCD {
		t.Fatalf("after PowerOn machine: %v, want on from cd", m)
	}
	// The one-time override is consumed by the power-on.
	if target, enabled, _ := e.BootOverride("437XR1138R2"); enabled != "Disabled" || target != "None" {
		t.Fatalf("override after power on = %s/%s, want None/Disabled", target, enabled)
	}
	require.NoError(t, bmc.VerifyBoot(bmc.BootCDROM, "virtualmedia"))

	require.NoError(t, b.EjectVirtualMedia(ctx))
	if got := m.Media(); got != "" {
		t.Fatalf("after EjectVirtualMedia machine media = %q, want empty", got)
	}

	// Power cycle: off then on from disk (no override left).
	require.NoError(t, b.PowerCycle(ctx))
	if !m.State() || m.BootSource() != machine.BootDisk {
		t.Fatalf("after PowerCycle machine: %v, want on from disk", m)
	}
	ev := m.Events()
	require.GreaterOrEqual(t, len(ev), 2)
	if got := ev[len(ev)-2].String() + " " + ev[len(ev)-1].String(); got != "off on:disk" {
		t.Fatalf("PowerCycle machine events end with %q, want %q", got, "off on:disk")
	}

	require.NoError(t, b.PowerSoft(ctx))
	if m.State() {
		t.Fatalf("after PowerSoft machine is on")
	}
	require.NoError(t, b.PowerOff(ctx))

	inv, err := b.Inventory(ctx)
	require.NoError(t, err)
	if inv.Model != "3500" || inv.SerialNumber != "437XR1138R2" || inv.BMCFirmware != "1.45.455b66-rev4" {
		t.Fatalf("Inventory() = %+v", inv)
	}
	if strings.Join(inv.MACs, ",") != "12:44:6a:3b:04:11,12:44:6a:3b:88:90" {
		t.Fatalf("Inventory().MACs = %v", inv.MACs)
	}

	caps, err := b.Capabilities(ctx)
	require.NoError(t, err)
	if !caps.VirtualMedia || caps.BootOnce != bmc.BootOnceHonoured {
		t.Fatalf("Capabilities() = %+v, want virtual media and boot once honoured", caps)
	}

	c := b.Condition()
	if c.GetStatus() != conditions.True || c.GetReason() != bmc.ReasonReachable {
		t.Fatalf("Condition() = %v, want True/Reachable", c)
	}
	if st := e.Stats(); st.Sessions != 0 {
		t.Fatalf("emulator has %d open sessions after the calls, want 0 (sessions leak)", st.Sessions)
	}
}

func TestRedfishCapabilities(t *testing.T) {
	t.Run("no virtual media, once becomes continuous", func(t *testing.T) {
		m := &machine.Memory{}
		e := startEmulator(t, redfish.Config{Systems: oneSystem(m), NoVirtualMedia: true, OnceBecomesContinuous: true})
		b := dialEmulator(t, e, fastOpts("odd-bmc"))
		ctx := ctxTimeout(t, 30*time.Second)
		require.NoError(t, b.SetBootDevice(ctx, bmc.BootPXE, false, true))
		caps, err := b.Capabilities(ctx)
		require.NoError(t, err)
		if caps.VirtualMedia || caps.BootOnce != bmc.BootOnceIgnored {
			t.Fatalf("Capabilities() = %+v, want no virtual media, boot once ignored", caps)
		}
		err = b.InsertVirtualMedia(ctx, "http://127.0.0.1:9/a.iso")
		if !errdefs.IsNotSupported(err) || !strings.Contains(err.Error(), "has no virtual media") {
			t.Fatalf("InsertVirtualMedia on a bmc without virtual media = %v, want NotSupported ... has no virtual media", err)
		}
		if st := b.Stats(); st.Attempts != st.Calls {
			t.Fatalf("Stats() = %+v: NotSupported was retried", st)
		}
		if c := b.Condition(); c.GetStatus() != conditions.True {
			t.Fatalf("Condition() after NotSupported = %s %q, want True (the bmc answered)", c.GetStatus(), c.GetMessage())
		}
	})
}

func TestRedfishFaults(t *testing.T) {
	t.Run("5xx burst is retried", func(t *testing.T) {
		m := &machine.Memory{}
		e := startEmulator(t, redfish.Config{Systems: oneSystem(m)})
		b := dialEmulator(t, e, fastOpts("burst"))
		e.FailNext(2, 503)
		require.NoError(t, b.PowerOn(ctxTimeout(t, 20*time.Second)))
		if !m.State() {
			t.Fatalf("machine off after PowerOn through a 5xx burst")
		}
		if st := b.Stats(); st.Attempts < 2 {
			t.Fatalf("Stats().Attempts = %d, want >= 2 (a retry)", st.Attempts)
		}
	})

	t.Run("5xx forever reports unavailable", func(t *testing.T) {
		m := &machine.Memory{}
		e := startEmulator(t, redfish.Config{Systems: oneSystem(m)})
		b := dialEmulator(t, e, fastOpts("broken"))
		e.FailNext(1000, 500)
		_, err := b.PowerState(ctxTimeout(t, 20*time.Second))
		if !errdefs.IsUnavailable(err) {
			t.Fatalf("PowerState() error = %v, want Unavailable", err)
		}
		if st := b.Stats(); st.Attempts != 4 {
			t.Fatalf("Stats().Attempts = %d, want 4", st.Attempts)
		}
		c := b.Condition()
		if c.GetStatus() != conditions.False || c.GetReason() != bmc.ReasonCallFailed {
			t.Fatalf("Condition() = %v, want False/CallFailed", c)
		}
	})

	t.Run("latency past the deadline returns by the deadline", func(t *testing.T) {
		m := &machine.Memory{}
		e := startEmulator(t, redfish.Config{Systems: oneSystem(m)})
		opts := fastOpts("slow")
		opts.AttemptTimeout = 10 * time.Second
		b := dialEmulator(t, e, opts)
		e.SetLatency(time.Minute)
		const deadline = 700 * time.Millisecond
		ctx := ctxTimeout(t, deadline)
		start := time.Now()
		err := b.PowerOn(ctx)
		elapsed := time.Since(start)
		require.Error(t, err)
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("PowerOn() error = %v, want it to wrap context.DeadlineExceeded", err)
		}
		// A bound, not a benchmark: the call must not hang past its deadline.
		if elapsed > deadline+2*time.Second {
			t.Fatalf("PowerOn() returned after %v, deadline was %v", elapsed, deadline)
		}
		c := b.Condition()
		if c.GetStatus() != conditions.False || !strings.Contains(c.GetMessage(), "deadline exceeded") {
			t.Fatalf("Condition() = %v, want False naming the deadline", c)
		}
		if m.State() {
			t.Fatalf("machine powered on although every answer came after the deadline")
		}
	})

	t.Run("caller cancellation does not count against the bmc", func(t *testing.T) {
		m := &machine.Memory{}
		e := startEmulator(t, redfish.Config{Systems: oneSystem(m)})
		b := dialEmulator(t, e, fastOpts("cancelled"))
		e.SetLatency(time.Minute)
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(200*time.Millisecond, cancel)
		err := b.PowerOn(ctx)
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("PowerOn() cancelled: error = %v, want context.Canceled", err)
		}
		if c := b.Condition(); c.GetStatus() != conditions.Unknown {
			t.Fatalf("Condition() after a cancelled call = %v, want Unknown", c)
		}
	})

	t.Run("session limit is transient", func(t *testing.T) {
		m := &machine.Memory{}
		e := startEmulator(t, redfish.Config{Systems: oneSystem(m)})
		b := dialEmulator(t, e, fastOpts("full"))
		e.SetMaxSessions(0)
		_, err := b.PowerState(ctxTimeout(t, 10*time.Second))
		if !errdefs.IsUnavailable(err) || !strings.Contains(err.Error(), "503") {
			t.Fatalf("PowerState() with no free session: error = %v, want Unavailable http 503", err)
		}
		c := b.Condition()
		if c.GetReason() != bmc.ReasonCallFailed || !strings.Contains(c.GetMessage(), "SessionLimitExceeded") {
			t.Fatalf("Condition() = %v, want CallFailed naming SessionLimitExceeded", c)
		}
		e.ClearFaults()
		_, err = b.PowerState(ctxTimeout(t, 10*time.Second))
		require.NoError(t, err)
	})

	t.Run("lagging power state is waited for", func(t *testing.T) {
		m := &machine.Memory{}
		e := startEmulator(t, redfish.Config{Systems: oneSystem(m)})
		b := dialEmulator(t, e, fastOpts("laggy"))
		e.SetPowerLag(300 * time.Millisecond)
		require.NoError(t, b.PowerOn(ctxTimeout(t, 10*time.Second)))
		state, err := b.PowerState(ctxTimeout(t, 10*time.Second))
		require.NoError(t, err)
		if state != bmc.PowerOn {
			t.Fatalf("PowerState() after PowerOn with lag = %q, want on", state)
		}
	})

	t.Run("lying power state is a clear error", func(t *testing.T) {
		m := &machine.Memory{}
		e := startEmulator(t, redfish.Config{Systems: oneSystem(m)})
		b := dialEmulator(t, e, fastOpts("liar"))
		e.SetPowerLies(true)
		err := b.PowerOn(ctxTimeout(t, time.Second))
		if !errdefs.IsUnavailable(err) || !strings.Contains(err.Error(), "still reports off") {
			t.Fatalf("PowerOn() with a lying bmc: error = %v, want Unavailable ... still reports off", err)
		}
		if !m.State() {
			t.Fatalf("machine is off: the power-on did not reach it")
		}
	})

	t.Run("wrong password is permission denied and not retried", func(t *testing.T) {
		m := &machine.Memory{}
		e := startEmulator(t, redfish.Config{Systems: oneSystem(m)})
		b, err := bmc.Dial(context.Background(), bmc.Endpoint{
			Protocol: bmc.ProtocolRedfish, Address: e.URL(), Username: testUser, Password: "wrong-" + testPassword,
		}, fastOpts("badcreds"))
		require.NoError(t, err)
		_, err = b.PowerState(ctxTimeout(t, 10*time.Second))
		if !errdefs.IsPermissionDenied(err) {
			t.Fatalf("PowerState() with a wrong password: error = %v, want PermissionDenied", err)
		}
		if strings.Contains(err.Error(), testPassword) {
			t.Fatalf("error %q contains the password", err)
		}
		if st := b.Stats(); st.Attempts != 1 {
			t.Fatalf("Stats().Attempts = %d, want 1", st.Attempts)
		}
	})
}

func TestRedfishTLS(t *testing.T) {
	m := &machine.Memory{}
	e := startEmulator(t, redfish.Config{Systems: oneSystem(m), TLS: true})
	ep := bmc.Endpoint{Protocol: bmc.ProtocolRedfish, Address: e.URL(), Username: testUser, Password: testPassword}

	trusted := fastOpts("tls-trusted")
	trusted.RootCAs = e.RootCAs()
	b, err := bmc.Dial(context.Background(), ep, trusted)
	require.NoError(t, err)
	require.NoError(t, b.PowerOn(ctxTimeout(t, 20*time.Second)))

	b, err = bmc.Dial(context.Background(), ep, fastOpts("tls-untrusted"))
	require.NoError(t, err)
	_, err = b.PowerState(ctxTimeout(t, 20*time.Second))
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "not trusted") {
		t.Fatalf("PowerState() against an untrusted certificate: error = %v, want FailedPrecondition not trusted", err)
	}

	ep.InsecureSkipVerify = true
	b, err = bmc.Dial(context.Background(), ep, fastOpts("tls-insecure"))
	require.NoError(t, err)
	state, err := b.PowerState(ctxTimeout(t, 20*time.Second))
	require.NoError(t, err)
	if state != bmc.PowerOn {
		t.Fatalf("PowerState() = %q, want on", state)
	}
}

func TestRedfishNoSessionLeakAfterDeadline(t *testing.T) {
	m := &machine.Memory{}
	e := startEmulator(t, redfish.Config{Systems: oneSystem(m)})
	opts := fastOpts("leaky")
	opts.MaxAttempts = 1
	b := dialEmulator(t, e, opts)
	_, err := b.Inventory(ctxTimeout(t, 10*time.Second)) // resolve the system first
	require.NoError(t, err)

	e.SetLatency(150 * time.Millisecond)
	for _, call := range []func(context.Context) error{
		func(ctx context.Context) error { _, err := b.Inventory(ctx); return err },
		func(ctx context.Context) error { _, err := b.PowerState(ctx); return err },
	} {
		// The login succeeds, the deadline passes during the next requests.
		err := call(ctxTimeout(t, 250*time.Millisecond))
		require.Error(t, err)
	}
	require.Eventually(t, func() bool { return e.Stats().Sessions == 0 }, 15*time.Second, 50*time.Millisecond,
		"sessions left open on the bmc after calls cut short by their deadline: %d", e.Stats().Sessions)
}

// TestRedfishMultiSystem drives systems of one emulated chassis by id: a
// system with a unique Name goes through bmclib, blades that share a Name
// through gofish directly.
func TestRedfishMultiSystem(t *testing.T) {
	ms := map[string]*machine.Memory{"NODE1": {}, "BLADE1": {}, "BLADE2": {}}
	e := startEmulator(t, redfish.Config{Systems: []redfish.System{
		{ID: "NODE1", Name: "Compute Node", Model: "N1", Machine: ms["NODE1"]},
		{ID: "BLADE1", Name: "Bladed System", Model: "SX1000", Machine: ms["BLADE1"]},
		{ID: "BLADE2", Name: "Bladed System", Model: "SX1000", Machine: ms["BLADE2"]},
	}})
	for _, id := range []string{"NODE1", "BLADE2"} {
		t.Run(id, func(t *testing.T) {
			b, err := bmc.Dial(context.Background(), bmc.Endpoint{
				Protocol: bmc.ProtocolRedfish, Address: e.URL(), Username: testUser, Password: testPassword, SystemID: id,
			}, fastOpts(id))
			require.NoError(t, err)
			ctx := ctxTimeout(t, 30*time.Second)
			require.NoError(t, b.InsertVirtualMedia(ctx, "http://127.0.0.1:9/"+id+".iso"))
			require.NoError(t, b.SetBootDevice(ctx, bmc.BootCDROM, false, true))
			require.NoError(t, b.PowerOn(ctx))
			m := ms[id]
			if !m.State() || m.BootSource() != machine.BootCD || m.Media() != "http://127.0.0.1:9/"+id+".iso" {
				t.Fatalf("system %s after insert, boot cd, power on: %v", id, m)
			}
			caps, err := b.Capabilities(ctx)
			require.NoError(t, err)
			if !caps.VirtualMedia || caps.BootOnce != bmc.BootOnceHonoured {
				t.Fatalf("Capabilities(%s) = %+v", id, caps)
			}
			require.NoError(t, b.EjectVirtualMedia(ctx))
			require.NoError(t, b.PowerCycle(ctx))
			if !m.State() || m.BootSource() != machine.BootDisk || m.Media() != "" {
				t.Fatalf("system %s after eject and power cycle: %v", id, m)
			}
			require.NoError(t, b.PowerSoft(ctx))
			if m.State() {
				t.Fatalf("system %s on after PowerSoft", id)
			}
		})
	}
	for _, id := range []string{"BLADE1"} {
		if ev := ms[id].Events(); len(ev) != 0 {
			t.Fatalf("system %s was never addressed but saw %v", id, ev)
		}
	}
}

// TestRedfishDPUBesideHost: a BMC that lists a SmartNIC's SoC (SystemType
// DPU) beside the host drives the host without a system id, and says so;
// several Physical systems still need one.
func TestRedfishDPUBesideHost(t *testing.T) {
	host, dpu := &machine.Memory{}, &machine.Memory{}
	e := startEmulator(t, redfish.Config{Systems: []redfish.System{
		{ID: "Bluefield", Name: "SmartNIC SoC", SystemType: "DPU", Model: "BlueField-3", Machine: dpu},
		{ID: "437XR1138R2", Name: "WebFrontEnd483", Model: "3500", SerialNumber: "437XR1138R2", Machine: host},
	}})
	b := dialEmulator(t, e, fastOpts("dpu-host"))
	ctx := ctxTimeout(t, 30*time.Second)

	inv, err := b.Inventory(ctx)
	require.NoError(t, err)
	if inv.SystemID != "437XR1138R2" || inv.SystemPicked != "system 437XR1138R2 picked as the only Physical one of 2 (others: Bluefield (DPU))" {
		t.Fatalf("Inventory() = system %q picked %q, want 437XR1138R2 with the reason", inv.SystemID, inv.SystemPicked)
	}
	require.NoError(t, b.InsertVirtualMedia(ctx, "http://127.0.0.1:9/agent.iso"))
	require.NoError(t, b.SetBootDevice(ctx, bmc.BootCDROM, false, true))
	require.NoError(t, b.PowerOn(ctx))
	if !host.State() || host.BootSource() != machine.BootCD {
		t.Fatalf("host after PowerOn: %v, want on from cd", host)
	}
	if ev := dpu.Events(); len(ev) != 0 {
		t.Fatalf("the DPU was driven: %v", ev)
	}
	if c := b.Condition(); !strings.Contains(c.GetMessage(), "system 437XR1138R2 picked as the only Physical one of 2") {
		t.Fatalf("Condition() = %q, want it to name the picked system", c.GetMessage())
	}

	// Two Physical systems and a DPU: ambiguous, refused with the ids.
	e2 := startEmulator(t, redfish.Config{Systems: []redfish.System{
		{ID: "A", Machine: &machine.Memory{}}, {ID: "B", Machine: &machine.Memory{}},
		{ID: "Bluefield", SystemType: "DPU", Machine: &machine.Memory{}},
	}})
	_, err = dialEmulator(t, e2, fastOpts("two-hosts")).PowerState(ctx)
	want := "the bmc has 3 systems (A (Physical), B (Physical), Bluefield (DPU)), 2 of them Physical: set the host's system id"
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), want) {
		t.Fatalf("PowerState() with two Physical systems = %v, want InvalidArgument %q", err, want)
	}
}

// TestRedfishBootTargets: a target outside the system's AllowableValues is
// refused before any PATCH, and Capabilities lists what is allowed.
func TestRedfishBootTargets(t *testing.T) {
	sys := oneSystem(&machine.Memory{})
	sys[0].BootTargets = []string{"None", "Pxe", "Usb", "Hdd"}
	e := startEmulator(t, redfish.Config{Systems: sys})
	b := dialEmulator(t, e, fastOpts("no-cd"))
	ctx := ctxTimeout(t, 30*time.Second)

	caps, err := b.Capabilities(ctx)
	require.NoError(t, err)
	if strings.Join(caps.BootDevices, ",") != "pxe,disk" || strings.Join(caps.BootTargets, ",") != "None,Pxe,Usb,Hdd" {
		t.Fatalf("Capabilities() = boot devices %v targets %v, want [pxe disk] [None Pxe Usb Hdd]", caps.BootDevices, caps.BootTargets)
	}
	before := e.Stats().Requests
	err = b.SetBootDevice(ctx, bmc.BootCDROM, false, true)
	want := "does not allow boot target Cd for cdrom (BootSourceOverrideTarget@Redfish.AllowableValues: None, Pxe, Usb, Hdd)"
	if !errdefs.IsNotSupported(err) || !strings.Contains(err.Error(), want) {
		t.Fatalf("SetBootDevice(cdrom) = %v, want NotSupported %q", err, want)
	}
	if target, _, _ := e.BootOverride("437XR1138R2"); target != "None" {
		t.Fatalf("boot override target = %q after a refused SetBootDevice, want None", target)
	}
	t.Logf("SetBootDevice(cdrom) = %v (%d requests)", err, e.Stats().Requests-before)
	require.NoError(t, b.SetBootDevice(ctx, bmc.BootPXE, false, true))
}
