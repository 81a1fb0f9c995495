// Package bmc is Kiln's only door to baseboard management controllers and
// the only package that imports bmclib. It offers a narrow BMC type — power,
// one-time boot device, virtual media, inventory — and adds what a fleet
// controller needs around bmclib: one pinned provider per host (Redfish
// through bmclib's gofish provider, IPMI through its ipmitool provider; no
// probing), a deadline on every call, retries with jittered backoff for
// transient failures, one operation at a time per BMC, a global concurrency
// limit (Manager), a capability cache, and a circuit breaker per BMC that
// the controller shows as the BMCReachable condition.
//
// Passwords never appear in errors or logs: every error leaving this
// package has the endpoint's password redacted where it stands as a
// credential (see redact).
package bmc

import (
	"context"
	"crypto/x509"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Protocols an Endpoint may use.
const (
	ProtocolRedfish = "redfish"
	ProtocolIPMI    = "ipmi"
)

// Redfish authentication methods (Endpoint.Auth).
const (
	// AuthAuto uses a session when the service root links a
	// SessionService (Links.Sessions) and basic authentication otherwise,
	// or when the service refuses session creation as unsupported (404,
	// 405, 501). The default.
	AuthAuto = "auto"
	// AuthSession always logs in through the SessionService.
	AuthSession = "session"
	// AuthBasic sends HTTP basic authentication with every request.
	AuthBasic = "basic"
)

// Normalised power states.
const (
	PowerOn      = "on"
	PowerOff     = "off"
	PowerUnknown = "unknown"
)

// Boot devices SetBootDevice accepts.
const (
	BootPXE   = "pxe"
	BootDisk  = "disk"
	BootCDROM = "cdrom"
)

// Endpoint says how to reach one BMC. It mirrors typesv1.BMCSpec.
type Endpoint struct {
	// Protocol is "redfish" or "ipmi".
	Protocol string
	// Address is a URL for Redfish (https://10.0.0.5, http://127.0.0.1:8000,
	// redfish+http://127.0.0.1:8000; a bare host[:port] means https) and
	// host[:port] for IPMI (port 623 by default).
	Address  string
	Username string
	Password string
	// SystemID selects one system (by Redfish Id) on a BMC with several;
	// empty means the only one.
	SystemID           string
	InsecureSkipVerify bool
	// Auth is the Redfish authentication method: "auto" (or empty),
	// "session" or "basic". Unused for IPMI.
	Auth string
}

// EndpointFromSpec converts a Host's BMC spec. The spec's password must
// already be decrypted by the caller.
func EndpointFromSpec(s *typesv1.BMCSpec) Endpoint {
	return Endpoint{
		Protocol:           s.GetProtocol(),
		Address:            s.GetAddress(),
		Username:           s.GetUsername(),
		Password:           s.GetPassword(),
		SystemID:           s.GetSystemId(),
		InsecureSkipVerify: s.GetInsecureSkipVerify(),
		Auth:               s.GetAuth(),
	}
}

// String describes the endpoint without its credentials.
func (e Endpoint) String() string { return e.Protocol + " " + e.Address }

// Options tune a BMC. The zero value is usable.
type Options struct {
	// Name identifies the BMC in errors, logs and conditions (default: the
	// endpoint address).
	Name string
	// Timeout bounds a call whose ctx has no deadline (default 2m).
	Timeout time.Duration
	// AttemptTimeout bounds one attempt inside a call (default 30s).
	AttemptTimeout time.Duration
	// ConnectTimeout bounds a Redfish TCP connect and TLS handshake
	// (default 5s); ResponseTimeout bounds the wait for a response's
	// headers once a request is sent (default 20s). Both are much shorter
	// than AttemptTimeout so that a BMC that accepts connections and never
	// answers is noticed quickly.
	ConnectTimeout  time.Duration
	ResponseTimeout time.Duration
	// MaxAttempts per call for transient failures (default 4). An attempt
	// that timed out is tried again at most once per call (a hung BMC does
	// not get better in a second), and every timed-out attempt counts
	// toward the circuit breaker at once.
	MaxAttempts int
	// Backoff between attempts (default 250ms doubling to 5s, 20% jitter).
	Backoff backoff.Policy
	// PollInterval is how often power state is read while waiting for a
	// change to show (default 500ms).
	PollInterval time.Duration
	// BreakerThreshold is the number of consecutive failed calls that opens
	// the circuit (default 5); BreakerCooldown is how long it stays open
	// before one trial call is let through (default 1m).
	BreakerThreshold int
	BreakerCooldown  time.Duration
	// RootCAs verifies the Redfish TLS certificate (nil: system roots)
	// unless the endpoint sets InsecureSkipVerify.
	RootCAs *x509.CertPool
	// IpmitoolPath is the ipmitool binary (default: found on PATH).
	IpmitoolPath string
	// Logger receives call failures; nil discards them. Secrets are never
	// logged.
	Logger *slog.Logger
	// Now is the clock (default time.Now).
	Now func() time.Time
	// Observer, when set, is told of every call (metrics).
	Observer CallObserver
}

// CallObserver is told of every BMC call once it ends: the endpoint's
// protocol, the operation (PowerState, PowerOn, SetBootDevice, ...), the
// call's error (nil on success; retries happen inside one call) and how
// long it took, the wait for the BMC's slot included. It must not block.
// Package bmc stays free of any metrics library: the controller passes
// its *metrics.Metrics.
type CallObserver interface {
	ObserveBMCCall(protocol, op string, err error, d time.Duration)
}

func (o Options) withDefaults(ep Endpoint) Options {
	if o.Name == "" {
		o.Name = ep.Address
	}
	if o.Timeout <= 0 {
		o.Timeout = 2 * time.Minute
	}
	if o.AttemptTimeout <= 0 {
		o.AttemptTimeout = 30 * time.Second
	}
	if o.MaxAttempts <= 0 {
		o.MaxAttempts = 4
	}
	if o.ConnectTimeout <= 0 {
		o.ConnectTimeout = 5 * time.Second
	}
	if o.ResponseTimeout <= 0 {
		o.ResponseTimeout = 20 * time.Second
	}
	if o.Backoff.Base <= 0 {
		o.Backoff = backoff.Policy{Base: 250 * time.Millisecond, Max: 5 * time.Second, Factor: 2, Jitter: 0.2}
	}
	if o.PollInterval <= 0 {
		o.PollInterval = 500 * time.Millisecond
	}
	if o.BreakerThreshold <= 0 {
		o.BreakerThreshold = 5
	}
	if o.BreakerCooldown <= 0 {
		o.BreakerCooldown = time.Minute
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return o
}

// Inventory is what a BMC tells about its host.
type Inventory struct {
	Manufacturer string
	Model        string
	SerialNumber string
	// BMCFirmware is the manager's firmware version.
	BMCFirmware string
	// MACs are the host's NIC addresses, lower case.
	MACs []string
	// SystemID is the Redfish Id of the system described.
	SystemID string
	// SystemPicked says why SystemID was chosen when the BMC lists several
	// systems and the endpoint names none (the only Physical one beside
	// DPUs); empty otherwise.
	SystemPicked string
}

// Boot-once behaviours a BMC may show.
const (
	BootOnceUnknown  = "unknown"
	BootOnceHonoured = "honoured"
	BootOnceIgnored  = "ignored"
)

// Capabilities are what a BMC can do, learnt once and cached.
type Capabilities struct {
	// VirtualMedia is true when a CD/DVD virtual media slot accepts
	// InsertMedia.
	VirtualMedia bool
	// MediaSlots are the BMC's virtual media slots.
	MediaSlots []MediaSlot
	// BootOnce says whether a one-time boot override stays one-time:
	// "honoured", "ignored" (the BMC stores it as persistent) or "unknown"
	// (not observed yet, or the protocol cannot tell).
	BootOnce string
	// BootDevices are the SetBootDevice devices the BMC allows ("pxe",
	// "disk", "cdrom"), from the system's
	// BootSourceOverrideTarget@Redfish.AllowableValues (BootTargets); nil
	// when the BMC does not say (IPMI, or a system without the annotation).
	BootDevices []string
	BootTargets []string
	// Auth is the Redfish authentication method in use, "session" or
	// "basic" (empty for IPMI); with Endpoint.Auth "auto" it is the one
	// auto chose.
	Auth string
}

// MediaSlot is one virtual media slot of a BMC.
type MediaSlot struct {
	ID string
	// Types are Redfish media types: CD, DVD, Floppy, USBStick.
	Types []string
	// Insertable is true when the slot offers the InsertMedia action,
	// Ejectable when it offers EjectMedia.
	Insertable bool
	Ejectable  bool
	Inserted   bool
	Image      string
}

// driver is one protocol's way of doing the operations. Implementations
// make one attempt and return raw errors; BMC adds everything else.
type driver interface {
	powerState(ctx context.Context) (string, error)
	// setPower does "on", "off" (hard) or "soft" (graceful).
	setPower(ctx context.Context, action string) error
	setBoot(ctx context.Context, device string, persistent, efi bool) error
	// bootPersistent reads back whether the stored override is persistent.
	bootPersistent(ctx context.Context) (bool, error)
	// setMedia inserts url in the CD slot; "" ejects.
	setMedia(ctx context.Context, url string) error
	inventory(ctx context.Context) (Inventory, error)
	mediaSlots(ctx context.Context) ([]MediaSlot, error)
}

// describer is a driver that can say how it talks to its BMC (the
// Redfish authentication method, the system it picked); the text is
// shown in the BMCReachable condition.
type describer interface {
	describe() string
	authInUse() string
}

// bootTargeter is a driver that knows which boot targets the system
// allows.
type bootTargeter interface {
	bootTargets(ctx context.Context) ([]string, error)
}

// limiter is the global concurrency limit shared by a Manager's BMCs.
type limiter struct {
	sem chan struct{}

	mu          sync.Mutex
	inFlight    int
	maxInFlight int
}

func newLimiter(n int) *limiter {
	return &limiter{sem: make(chan struct{}, n)}
}

func (l *limiter) acquire(ctx context.Context) error {
	select {
	case l.sem <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	l.mu.Lock()
	l.inFlight++
	l.maxInFlight = max(l.maxInFlight, l.inFlight)
	l.mu.Unlock()
	return nil
}

func (l *limiter) release() {
	l.mu.Lock()
	l.inFlight--
	l.mu.Unlock()
	<-l.sem
}

// BMC is one baseboard management controller. Its methods are safe for
// concurrent use; operations on one BMC run one at a time. Every method
// blocks until the operation ends or ctx is done (a ctx without deadline
// gets Options.Timeout) and returns by then.
//
// Errors are classified with errdefs: Unavailable (unreachable, 5xx,
// session limit, timeouts, open circuit; retried and counted by the
// circuit breaker), PermissionDenied (bad credentials, no session after
// login), NotFound (no such system), NotSupported (the protocol or BMC
// cannot do it: no virtual media, a boot target it does not allow),
// InvalidArgument (bad input, several Physical systems and no system
// id), FailedPrecondition (an auth method the service lacks, an
// untrusted TLS certificate, a host not in a state that allows it). Only
// Unavailable is retried and counts toward the breaker; PermissionDenied
// and FailedPrecondition show in the condition as Refused. A call cut short by ctx wraps
// ctx.Err().
type BMC struct {
	ep   Endpoint
	opts Options
	log  *slog.Logger
	drv  driver
	lim  *limiter // nil: no global limit

	slot chan struct{} // one operation at a time

	mu       sync.Mutex
	rng      *rand.Rand
	brk      breaker
	caps     *Capabilities
	bootOnce string
	inFlight int
	stats    Stats
}

// Stats are a BMC's call counters.
type Stats struct {
	Calls    int
	Attempts int
	Failures int
	// MaxInFlight is the most operations seen running at once on this BMC
	// (1 when serialisation works).
	MaxInFlight int
}

// Dial returns a BMC for ep. It does not contact the BMC (the first call
// does), so a BMC that is down still gets a BMC value whose condition
// reports it. It returns InvalidArgument for a malformed endpoint and
// FailedPrecondition when the IPMI tool is missing.
func Dial(ctx context.Context, ep Endpoint, opts Options) (*BMC, error) {
	return dial(ctx, ep, opts, nil)
}

func dial(_ context.Context, ep Endpoint, opts Options, lim *limiter) (*BMC, error) {
	opts = opts.withDefaults(ep)
	var (
		drv driver
		err error
	)
	switch ep.Protocol {
	case ProtocolRedfish:
		drv, err = newRedfishDriver(ep, opts)
	case ProtocolIPMI:
		drv, err = newIPMIDriver(ep, opts)
	case "", "none":
		return nil, errdefs.InvalidArgument("bmc %s: no protocol", opts.Name)
	default:
		return nil, errdefs.InvalidArgument("bmc %s: protocol %q: want redfish or ipmi", opts.Name, ep.Protocol)
	}
	if err != nil {
		return nil, redactErr(err, ep.Username, ep.Password)
	}
	b := &BMC{
		ep:       ep,
		opts:     opts,
		log:      opts.Logger.With("component", "bmc", "bmc", opts.Name),
		drv:      drv,
		lim:      lim,
		slot:     make(chan struct{}, 1),
		rng:      rand.New(rand.NewPCG(uint64(opts.Now().UnixNano()), 0x6b696c6e)),
		brk:      breaker{threshold: opts.BreakerThreshold, cooldown: opts.BreakerCooldown},
		bootOnce: BootOnceUnknown,
	}
	return b, nil
}

// Name is the BMC's name in errors and conditions.
func (b *BMC) Name() string { return b.opts.Name }

// Endpoint returns the endpoint the BMC was dialled with.
func (b *BMC) Endpoint() Endpoint { return b.ep }

// Stats returns a copy of the call counters.
func (b *BMC) Stats() Stats {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.stats
}

// PowerState reads the power state, normalised to "on", "off" or
// "unknown" (IPMI's "Chassis Power is on" and Redfish's "On" are both
// "on").
func (b *BMC) PowerState(ctx context.Context) (string, error) {
	var state string
	err := b.do(ctx, "power state", func(ctx context.Context) error {
		raw, err := b.drv.powerState(ctx)
		state = NormalisePower(raw)
		return err
	})
	return state, err
}

// PowerOn powers the host on and waits until the BMC reports it on. A host
// that is already on is left alone.
func (b *BMC) PowerOn(ctx context.Context) error {
	return b.do(ctx, "power on", func(ctx context.Context) error {
		if err := b.drv.setPower(ctx, "on"); err != nil {
			return err
		}
		return b.waitPower(ctx, PowerOn)
	})
}

// PowerOff cuts power (hard off) and waits until the BMC reports it off.
func (b *BMC) PowerOff(ctx context.Context) error {
	return b.do(ctx, "power off", func(ctx context.Context) error {
		if err := b.drv.setPower(ctx, "off"); err != nil {
			return err
		}
		return b.waitPower(ctx, PowerOff)
	})
}

// PowerSoft asks the host OS to shut down (ACPI/graceful) and waits until
// the BMC reports it off or ctx ends.
func (b *BMC) PowerSoft(ctx context.Context) error {
	return b.do(ctx, "soft power off", func(ctx context.Context) error {
		if err := b.drv.setPower(ctx, "soft"); err != nil {
			return err
		}
		return b.waitPower(ctx, PowerOff)
	})
}

// PowerCycle turns the host off hard, waits until the BMC reports it off,
// and turns it on again (a host that is off is just turned on).
//
// bmclib's own cycle is not used: on v2.3.5 Redfish "cycle" is a
// ForceRestart that fails on a host that is off, and "reset" sends
// PowerCycle and, when refused, falls back to a graceful shutdown, a fixed
// 9 s wait and power on whether or not the host went off.
func (b *BMC) PowerCycle(ctx context.Context) error {
	return b.do(ctx, "power cycle", func(ctx context.Context) error {
		raw, err := b.drv.powerState(ctx)
		if err != nil {
			return err
		}
		if NormalisePower(raw) != PowerOff {
			if err := b.drv.setPower(ctx, "off"); err != nil {
				return err
			}
			if err := b.waitPower(ctx, PowerOff); err != nil {
				return err
			}
		}
		if err := b.drv.setPower(ctx, "on"); err != nil {
			return err
		}
		return b.waitPower(ctx, PowerOn)
	})
}

// waitPower polls until the reported state is want. A BMC that keeps
// reporting another state until ctx ends yields an Unavailable error
// naming both states.
func (b *BMC) waitPower(ctx context.Context, want string) error {
	last := PowerUnknown
	for {
		raw, err := b.drv.powerState(ctx)
		if err == nil {
			last = NormalisePower(raw)
			if last == want {
				return nil
			}
		}
		t := time.NewTimer(b.opts.PollInterval)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return errdefs.Unavailable("power %s accepted but the bmc still reports %s: %w", want, last, ctx.Err())
		}
	}
}

// SetBootDevice sets the next boot device: "pxe", "disk" or "cdrom".
// persistent=false asks for a one-time override; efi selects UEFI boot.
// On Redfish the stored override is read back to learn whether the BMC
// honours one-time overrides (see Capabilities).
func (b *BMC) SetBootDevice(ctx context.Context, device string, persistent, efi bool) error {
	switch device {
	case BootPXE, BootDisk, BootCDROM:
	default:
		return errdefs.InvalidArgument("bmc %s: boot device %q: want pxe, disk or cdrom", b.opts.Name, device)
	}
	return b.do(ctx, "set boot device", func(ctx context.Context) error {
		if err := b.drv.setBoot(ctx, device, persistent, efi); err != nil {
			return err
		}
		if persistent {
			return nil
		}
		stored, err := b.drv.bootPersistent(ctx)
		if err != nil {
			// The override is set; only the observation failed.
			return nil
		}
		b.mu.Lock()
		if stored {
			b.bootOnce = BootOnceIgnored
		} else {
			b.bootOnce = BootOnceHonoured
		}
		b.mu.Unlock()
		return nil
	})
}

// InsertVirtualMedia inserts the image at url in the BMC's virtual CD
// (ejecting what was there). NotSupported on IPMI and on BMCs without
// virtual media.
func (b *BMC) InsertVirtualMedia(ctx context.Context, url string) error {
	if url == "" {
		return errdefs.InvalidArgument("bmc %s: insert virtual media: empty url", b.opts.Name)
	}
	return b.do(ctx, "insert virtual media", func(ctx context.Context) error {
		if err := b.drv.setMedia(ctx, url); err != nil {
			return err
		}
		return b.readBackMedia(ctx, url)
	})
}

// EjectVirtualMedia ejects the virtual CD. NotSupported on IPMI, and
// when a CD slot holds an image but offers no EjectMedia action.
func (b *BMC) EjectVirtualMedia(ctx context.Context) error {
	return b.do(ctx, "eject virtual media", func(ctx context.Context) error {
		if err := b.drv.setMedia(ctx, ""); err != nil {
			return err
		}
		return b.readBackMedia(ctx, "")
	})
}

// readBackMedia reads the slots after an insert of url ("" after an
// eject) and reports the truth: the image in a CD slot, or no CD slot
// holding one. The cached capabilities get the slots read.
func (b *BMC) readBackMedia(ctx context.Context, url string) error {
	slots, err := b.drv.mediaSlots(ctx)
	if err != nil {
		return err
	}
	b.mu.Lock()
	if b.caps != nil {
		b.caps.MediaSlots = slots
	}
	b.mu.Unlock()
	var cds []MediaSlot
	for _, s := range slots {
		if slices.Contains(s.Types, "CD") || slices.Contains(s.Types, "DVD") {
			cds = append(cds, s)
		}
	}
	if url != "" {
		for _, s := range cds {
			if s.Inserted && s.Image == url {
				return nil
			}
		}
		return errdefs.Unavailable("the bmc accepted InsertMedia but no CD slot reports %s inserted (%s)", url, describeSlots(cds))
	}
	for _, s := range cds {
		if s.Inserted {
			if !s.Ejectable {
				return errdefs.NotSupported("virtual media slot %s holds %q and offers no EjectMedia action", s.ID, s.Image)
			}
			return errdefs.Unavailable("the bmc accepted EjectMedia but slot %s still reports %q inserted", s.ID, s.Image)
		}
	}
	return nil
}

func describeSlots(slots []MediaSlot) string {
	if len(slots) == 0 {
		return "no CD slots"
	}
	var out []string
	for _, s := range slots {
		out = append(out, fmt.Sprintf("%s: inserted=%v image=%q", s.ID, s.Inserted, s.Image))
	}
	return strings.Join(out, "; ")
}

// Inventory reads model, serial, BMC firmware and MACs. NotSupported on
// IPMI.
func (b *BMC) Inventory(ctx context.Context) (Inventory, error) {
	var inv Inventory
	err := b.do(ctx, "inventory", func(ctx context.Context) error {
		var err error
		inv, err = b.drv.inventory(ctx)
		return err
	})
	return inv, err
}

// Capabilities returns what the BMC can do. The first call asks the BMC;
// later calls answer from the cache (BootOnce is refreshed by every
// one-time SetBootDevice).
func (b *BMC) Capabilities(ctx context.Context) (Capabilities, error) {
	b.mu.Lock()
	if b.caps != nil {
		c := *b.caps
		c.BootOnce = b.bootOnce
		b.mu.Unlock()
		return c, nil
	}
	b.mu.Unlock()
	var slots []MediaSlot
	err := b.do(ctx, "capabilities", func(ctx context.Context) error {
		var err error
		slots, err = b.drv.mediaSlots(ctx)
		return err
	})
	if err != nil {
		return Capabilities{BootOnce: BootOnceUnknown}, err
	}
	c := Capabilities{MediaSlots: slots}
	if d, ok := b.drv.(describer); ok {
		c.Auth = d.authInUse()
	}
	if bt, ok := b.drv.(bootTargeter); ok {
		// Resolved by mediaSlots above: no request.
		if targets, err := bt.bootTargets(ctx); err == nil && targets != nil {
			c.BootTargets = targets
			for _, dev := range []string{BootPXE, BootDisk, BootCDROM} {
				if slices.Contains(targets, string(redfishTargets[dev])) {
					c.BootDevices = append(c.BootDevices, dev)
				}
			}
		}
	}
	for _, s := range slots {
		if s.Insertable && (slices.Contains(s.Types, "CD") || slices.Contains(s.Types, "DVD")) {
			c.VirtualMedia = true
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.caps = &c
	c.BootOnce = b.bootOnce
	return c, nil
}

// NormalisePower maps a provider's power string to "on", "off" or
// "unknown".
func NormalisePower(raw string) string {
	s := strings.ToLower(strings.TrimSpace(raw))
	s = strings.TrimPrefix(s, "chassis power is ")
	switch s {
	case "on":
		return PowerOn
	case "off":
		return PowerOff
	}
	return PowerUnknown
}

// VerifyBoot checks that a host booted from the device that was asked for.
// asked is a SetBootDevice device ("pxe", "disk", "cdrom"); reported is
// what the booted agent says (Facts.boot_source: "pxe", "disk",
// "virtualmedia"). A mismatch or an unknown value is a FailedPrecondition
// error.
func VerifyBoot(asked, reported string) error {
	canon := func(s string) string {
		switch strings.ToLower(strings.TrimSpace(s)) {
		case "pxe", "network":
			return "pxe"
		case "disk", "hdd":
			return "disk"
		case "cdrom", "cd", "dvd", "virtualmedia":
			return "cdrom"
		}
		return ""
	}
	a, r := canon(asked), canon(reported)
	if a == "" {
		return errdefs.InvalidArgument("verify boot: asked device %q: want pxe, disk or cdrom", asked)
	}
	if r == "" {
		return errdefs.FailedPrecondition("verify boot: asked for %s, host reports unknown boot source %q", a, reported)
	}
	if a != r {
		return errdefs.FailedPrecondition("verify boot: asked for %s, host booted from %s", a, r)
	}
	return nil
}

// splitRedfishAddress turns an Endpoint address into base URL parts:
// scheme://host and port.
func splitRedfishAddress(addr string) (scheme, host, port string, err error) {
	a := strings.TrimPrefix(addr, "redfish+")
	if !strings.Contains(a, "://") {
		a = "https://" + a
	}
	u, err := url.Parse(a)
	if err != nil || u.Hostname() == "" {
		return "", "", "", errdefs.InvalidArgument("redfish address %q: want https://host[:port]", addr)
	}
	if u.User != nil {
		return "", "", "", errdefs.InvalidArgument("redfish address must not carry credentials")
	}
	scheme = u.Scheme
	if scheme != "http" && scheme != "https" {
		return "", "", "", errdefs.InvalidArgument("redfish address %q: scheme %q: want http or https", addr, scheme)
	}
	port = u.Port()
	if port == "" {
		port = "443"
		if scheme == "http" {
			port = "80"
		}
	}
	host = u.Hostname()
	if strings.Contains(host, ":") {
		host = "[" + host + "]"
	}
	return scheme, host, port, nil
}

// splitIPMIAddress returns host and port (default 623).
func splitIPMIAddress(addr string) (host, port string, err error) {
	a := strings.TrimPrefix(addr, "ipmi://")
	if a == "" {
		return "", "", errdefs.InvalidArgument("ipmi address is empty")
	}
	if strings.Contains(a, "/") {
		return "", "", errdefs.InvalidArgument("ipmi address %q: want host[:port]", addr)
	}
	if h, p, err := net.SplitHostPort(a); err == nil {
		return h, p, nil
	}
	return a, "623", nil
}

func (b *BMC) String() string { return fmt.Sprintf("bmc %s (%s)", b.opts.Name, b.ep) }
