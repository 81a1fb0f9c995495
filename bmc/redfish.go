package bmc

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	bmclibredfish "github.com/bmc-toolbox/bmclib/v2/providers/redfish"
	"github.com/go-logr/logr"
	"github.com/stmcginnis/gofish"
	"github.com/stmcginnis/gofish/common"
	rf "github.com/stmcginnis/gofish/redfish"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// redfishDriver drives a Redfish BMC. Power, boot and virtual media go
// through bmclib's gofish provider (pinned: no other provider is
// registered or probed), opened for one operation and closed after it, so
// the provider's HTTP timeout follows each call's deadline. Inventory and
// capabilities are read with gofish directly in one pass.
//
// bmclib v2.3.5 picks a system by Name. A chassis whose systems share one
// Name (a bladed enclosure) cannot be addressed that way, so for such a
// SystemID every operation talks to gofish directly with the system's
// @odata.id.
type redfishDriver struct {
	ep                 Endpoint
	log                *slog.Logger
	scheme, host, port string
	transport          *retryAfterTransport

	mu sync.Mutex
	// auth is the authentication method in use ("session" or "basic"; ""
	// until auto has chosen) and authWhy says why auto chose it.
	auth, authWhy string
	// pickWhy says why a system was chosen without a SystemID among
	// several ("" otherwise).
	pickWhy string
	// targets are the system's BootSourceOverrideTarget AllowableValues
	// (nil when it lists none).
	targets  []string
	resolved bool
	sysName  string // Name passed to bmclib ("" when the BMC has one system)
	sysPath  string // the system's @odata.id
	direct   bool   // use gofish directly for system operations
}

var _ driver = (*redfishDriver)(nil)

func newRedfishDriver(ep Endpoint, opts Options) (*redfishDriver, error) {
	scheme, host, port, err := splitRedfishAddress(ep.Address)
	if err != nil {
		return nil, err
	}
	tr := &http.Transport{
		Proxy:                 nil, // a BMC network is never proxied
		DialContext:           (&net.Dialer{Timeout: opts.ConnectTimeout}).DialContext,
		TLSHandshakeTimeout:   opts.ConnectTimeout,
		ResponseHeaderTimeout: opts.ResponseTimeout,
		TLSClientConfig: &tls.Config{
			InsecureSkipVerify: ep.InsecureSkipVerify, //nolint:gosec // operator's choice per host
			RootCAs:            opts.RootCAs,
			MinVersion:         tls.VersionTLS12,
		},
		MaxIdleConnsPerHost: 1,
		IdleConnTimeout:     30 * time.Second,
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d := &redfishDriver{ep: ep, log: log.With("component", "bmc", "bmc", opts.Name), scheme: scheme, host: host, port: port,
		transport: &retryAfterTransport{base: tr}}
	switch ep.Auth {
	case "", AuthAuto:
	case AuthSession, AuthBasic:
		d.auth = ep.Auth
	default:
		return nil, errdefs.InvalidArgument("redfish auth %q: want auto, session or basic", ep.Auth)
	}
	return d, nil
}

// retryAfterTransport notes the Retry-After of the last 429 or 503
// answer (gofish's errors keep only the status and body).
type retryAfterTransport struct {
	base http.RoundTripper

	mu    sync.Mutex
	after time.Duration
}

func (t *retryAfterTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := t.base.RoundTrip(r)
	if err == nil && (resp.StatusCode == http.StatusServiceUnavailable || resp.StatusCode == http.StatusTooManyRequests) {
		if d := parseRetryAfter(resp.Header.Get("Retry-After"), time.Now()); d > 0 {
			t.mu.Lock()
			t.after = d
			t.mu.Unlock()
		}
	}
	return resp, err
}

// peek returns the noted Retry-After; take also forgets it.
func (t *retryAfterTransport) peek() time.Duration {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.after
}

func (t *retryAfterTransport) take() time.Duration {
	t.mu.Lock()
	defer t.mu.Unlock()
	d := t.after
	t.after = 0
	return d
}

// parseRetryAfter reads a Retry-After value: seconds or an HTTP date.
func parseRetryAfter(v string, now time.Time) time.Duration {
	if v == "" {
		return 0
	}
	if n, err := strconv.Atoi(strings.TrimSpace(v)); err == nil && n > 0 {
		return time.Duration(n) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil {
		return t.Sub(now)
	}
	return 0
}

// retryAfter is how long the BMC asked to wait before the next attempt
// (0: it did not say).
func (d *redfishDriver) retryAfter() time.Duration { return d.transport.take() }

func (d *redfishDriver) base() string { return d.scheme + "://" + d.host + ":" + d.port }

// httpClient is fresh per operation: bmclib sets its Timeout from the
// operation's deadline.
func (d *redfishDriver) httpClient() *http.Client { return &http.Client{Transport: d.transport} }

// connect opens a gofish session; the caller must Logout. Like bmclib's
// provider, each request is bounded by the time left until ctx's deadline
// rather than by ctx itself, so that the Logout after a call cut short by
// its deadline still reaches the BMC instead of leaking the session (BMCs
// allow few). do() returns to the caller at the deadline regardless.
//
// With auth "auto" the first connect reads the service root and picks
// the method (see AuthAuto); a session login that the service refuses as
// unsupported switches to basic authentication for good.
func (d *redfishDriver) connect(ctx context.Context) (*gofish.APIClient, error) {
	method, err := d.authMethod(ctx)
	if err != nil {
		return nil, d.explain(err)
	}
	c, err := d.connectWith(ctx, method)
	var rfe *common.Error
	if err != nil && method == AuthSession && errors.As(err, &rfe) && sessionsUnsupported(rfe.HTTPReturnedStatusCode) {
		if !d.isAuto() {
			return nil, errdefs.FailedPrecondition("redfish service at %s refused session creation as unsupported (%s), so session authentication cannot work: set spec.bmc.auth to basic or auto",
				d.base(), describeAnswer(rfe))
		}
		d.setAuth(AuthBasic, fmt.Sprintf("the service refused session creation with %d", rfe.HTTPReturnedStatusCode))
		c, err = d.connectWith(ctx, AuthBasic)
	}
	if err != nil {
		return nil, d.explain(err)
	}
	return c, nil
}

func (d *redfishDriver) connectWith(ctx context.Context, method string) (*gofish.APIClient, error) {
	hc := d.httpClient()
	if dl, ok := ctx.Deadline(); ok {
		hc.Timeout = max(time.Until(dl), minRequestTimeout)
	}
	return gofish.ConnectContext(context.WithoutCancel(ctx), gofish.ClientConfig{
		Endpoint:   d.base(),
		Username:   d.ep.Username,
		Password:   d.ep.Password,
		Insecure:   d.ep.InsecureSkipVerify,
		HTTPClient: hc,
		BasicAuth:  method == AuthBasic,
	})
}

// sessionsUnsupported reports whether an HTTP status answering a session
// login means the service has no sessions (rather than bad credentials).
func sessionsUnsupported(code int) bool {
	return code == http.StatusNotFound || code == http.StatusMethodNotAllowed || code == http.StatusNotImplemented
}

func (d *redfishDriver) isAuto() bool { return d.ep.Auth == "" || d.ep.Auth == AuthAuto }

func (d *redfishDriver) setAuth(method, why string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.auth, d.authWhy = method, why
}

// authMethod returns the authentication method, choosing it once for
// auto: a session when the service root links a session collection
// (Links.Sessions, which a SessionService brings), else basic.
func (d *redfishDriver) authMethod(ctx context.Context) (string, error) {
	d.mu.Lock()
	method := d.auth
	d.mu.Unlock()
	if method != "" {
		return method, nil
	}
	root, err := d.readRoot(ctx)
	if err != nil {
		return "", err
	}
	switch {
	case root.Links.Sessions.ID != "":
		d.setAuth(AuthSession, "the service root links a SessionService")
	case root.SessionService.ID != "":
		// gofish logs in at Links.Sessions only.
		d.setAuth(AuthBasic, "the service root links a SessionService but no Sessions collection")
	default:
		d.setAuth(AuthBasic, "the service root links no SessionService")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.auth, nil
}

// serviceRoot is the part of the Redfish service root auto needs.
type serviceRoot struct {
	SessionService struct {
		ID string `json:"@odata.id"`
	}
	Links struct {
		Sessions struct {
			ID string `json:"@odata.id"`
		}
	}
}

// readRoot reads the service root without credentials (DSP0266 serves it
// to anyone, and gofish reads it the same way before logging in).
func (d *redfishDriver) readRoot(ctx context.Context) (serviceRoot, error) {
	var root serviceRoot
	hc := d.httpClient()
	if dl, ok := ctx.Deadline(); ok {
		hc.Timeout = max(time.Until(dl), minRequestTimeout)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, d.base()+"/redfish/v1/", nil)
	if err != nil {
		return root, err
	}
	req.Header.Set("Accept", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		return root, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return root, err
	}
	if resp.StatusCode != http.StatusOK {
		return root, common.ConstructError(resp.StatusCode, body)
	}
	if err := json.Unmarshal(body, &root); err != nil {
		return root, errdefs.Unavailable("the service root at %s/redfish/v1/ is not Redfish JSON: %v", d.base(), err)
	}
	return root, nil
}

// describe says how the driver talks to the BMC: the authentication
// method and why, and the system chosen when the BMC has several.
func (d *redfishDriver) describe() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	var parts []string
	if d.auth != "" {
		s := "redfish " + d.auth + " auth"
		if d.authWhy != "" {
			s += " (" + d.authWhy + ")"
		}
		parts = append(parts, s)
	}
	if d.pickWhy != "" {
		parts = append(parts, d.pickWhy)
	}
	return strings.Join(parts, "; ")
}

func (d *redfishDriver) authInUse() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.auth
}

// minRequestTimeout bounds a request (a Logout) sent after the deadline.
const minRequestTimeout = 2 * time.Second

// resolve finds the system to drive, once.
func (d *redfishDriver) resolve(ctx context.Context, c *gofish.APIClient) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.resolved {
		return nil
	}
	systems, err := c.Service.Systems()
	if err != nil {
		return err // explained by the caller: explain takes d.mu
	}
	if len(systems) == 0 {
		return errdefs.NotFound("the bmc lists no systems")
	}
	// gofish reads collection members concurrently: sort for stable
	// messages.
	slices.SortFunc(systems, func(a, b *rf.ComputerSystem) int { return strings.Compare(a.ID, b.ID) })
	var pick *rf.ComputerSystem
	if d.ep.SystemID == "" {
		pick = systems[0]
		if len(systems) > 1 {
			// A BMC may list a SmartNIC's SoC (SystemType DPU) or other
			// non-host systems beside the host: when exactly one system
			// is Physical, that is the host.
			var physical []*rf.ComputerSystem
			for _, s := range systems {
				if s.SystemType == rf.PhysicalSystemType {
					physical = append(physical, s)
				}
			}
			if len(physical) != 1 {
				return errdefs.InvalidArgument("the bmc has %d systems (%s), %d of them Physical: set the host's system id",
					len(systems), describeSystems(systems, nil), len(physical))
			}
			pick = physical[0]
			d.pickWhy = fmt.Sprintf("system %s picked as the only Physical one of %d (others: %s)",
				pick.ID, len(systems), describeSystems(systems, pick))
			d.log.Info("bmc lists several systems: picked the only physical one",
				"system", pick.ID, "others", describeSystems(systems, pick))
		}
	} else {
		for _, s := range systems {
			if s.ID == d.ep.SystemID {
				pick = s
			}
		}
		if pick == nil {
			ids := make([]string, 0, len(systems))
			for _, s := range systems {
				ids = append(ids, s.ID)
			}
			return errdefs.NotFound("no system with id %q (systems: %s)", d.ep.SystemID, strings.Join(ids, ", "))
		}
	}
	sameName := 0
	for _, s := range systems {
		if s.Name == pick.Name {
			sameName++
		}
	}
	d.targets = allowableTargets(pick.RawData)
	d.sysPath = pick.ODataID
	d.direct = sameName > 1
	if len(systems) > 1 {
		d.sysName = pick.Name
	}
	d.resolved = true
	return nil
}

// describeSystems lists systems as "Id (SystemType)", leaving out skip.
func describeSystems(systems []*rf.ComputerSystem, skip *rf.ComputerSystem) string {
	var out []string
	for _, s := range systems {
		if s == skip {
			continue
		}
		t := string(s.SystemType)
		if t == "" {
			t = "no SystemType"
		}
		out = append(out, s.ID+" ("+t+")")
	}
	return strings.Join(out, ", ")
}

// withGofish runs fn with a gofish session and the resolved system.
func (d *redfishDriver) withGofish(ctx context.Context, fn func(*gofish.APIClient, *rf.ComputerSystem) error) error {
	c, err := d.connect(ctx)
	if err != nil {
		return err
	}
	defer c.Logout()
	if err := d.resolve(ctx, c); err != nil {
		return d.explain(err)
	}
	sys, err := rf.GetComputerSystem(c, d.sysPath)
	if err != nil {
		return d.explain(err)
	}
	return d.explain(fn(c, sys))
}

// ensureResolved resolves the system with a short session of its own
// unless that is done.
func (d *redfishDriver) ensureResolved(ctx context.Context) error {
	d.mu.Lock()
	resolved := d.resolved
	d.mu.Unlock()
	if resolved {
		return nil
	}
	c, err := d.connect(ctx)
	if err != nil {
		return err
	}
	err = d.resolve(ctx, c)
	c.Logout()
	return d.explain(err)
}

// withBmclib runs fn with bmclib's gofish provider opened for this
// operation, unless the system must be driven directly (then it returns
// direct=true and does nothing).
func (d *redfishDriver) withBmclib(ctx context.Context, fn func(*bmclibredfish.Conn) error) (direct bool, err error) {
	if err := d.ensureResolved(ctx); err != nil {
		return false, err
	}
	d.mu.Lock()
	direct, name, method := d.direct, d.sysName, d.auth
	d.mu.Unlock()
	if direct {
		return true, nil
	}
	conn := bmclibredfish.New(d.scheme+"://"+d.host, d.ep.Username, d.ep.Password, logr.Discard(),
		bmclibredfish.WithPort(d.port),
		bmclibredfish.WithHttpClient(d.httpClient()),
		bmclibredfish.WithUseBasicAuth(method == AuthBasic),
		bmclibredfish.WithSystemName(name))
	if err := conn.Open(ctx); err != nil {
		return false, d.explain(err)
	}
	defer conn.Close(ctx)
	return false, d.explain(fn(conn))
}

func (d *redfishDriver) powerState(ctx context.Context) (string, error) {
	var state string
	direct, err := d.withBmclib(ctx, func(c *bmclibredfish.Conn) error {
		var err error
		state, err = c.PowerStateGet(ctx)
		return err
	})
	if direct {
		err = d.withGofish(ctx, func(_ *gofish.APIClient, sys *rf.ComputerSystem) error {
			state = string(sys.PowerState)
			return nil
		})
	}
	return state, err
}

func (d *redfishDriver) setPower(ctx context.Context, action string) error {
	direct, err := d.withBmclib(ctx, func(c *bmclibredfish.Conn) error {
		ok, err := c.PowerSet(ctx, action)
		if err != nil {
			return err
		}
		if !ok && action == "soft" {
			// bmclib v2.3.5 bug: SetPowerState("soft") returns false even
			// when the BMC accepted the GracefulShutdown. The caller
			// verifies by reading the power state (waitPower).
			return nil
		}
		if !ok {
			return errdefs.Unavailable("the bmc did not accept power %s", action)
		}
		return nil
	})
	if !direct {
		return err
	}
	return d.withGofish(ctx, func(_ *gofish.APIClient, sys *rf.ComputerSystem) error {
		switch action {
		case "on":
			if sys.PowerState == rf.OnPowerState {
				return nil
			}
			return sys.Reset(rf.OnResetType)
		case "off":
			if sys.PowerState == rf.OffPowerState {
				return nil
			}
			return sys.Reset(rf.ForceOffResetType)
		case "soft":
			if sys.PowerState == rf.OffPowerState {
				return nil
			}
			return sys.Reset(rf.GracefulShutdownResetType)
		}
		return errdefs.InvalidArgument("power action %q", action)
	})
}

// allowableTargets reads Boot.BootSourceOverrideTarget@Redfish.AllowableValues
// from a system's JSON.
func allowableTargets(raw []byte) []string {
	var v struct {
		Boot struct {
			Targets []string `json:"BootSourceOverrideTarget@Redfish.AllowableValues"`
		}
	}
	if json.Unmarshal(raw, &v) != nil {
		return nil
	}
	return v.Boot.Targets
}

// bootTargets returns the Redfish boot targets the system allows (nil
// when it does not say).
func (d *redfishDriver) bootTargets(ctx context.Context) ([]string, error) {
	if err := d.ensureResolved(ctx); err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.targets), nil
}

// checkTarget refuses, before any PATCH, a device whose Redfish target is
// not in the system's AllowableValues.
func (d *redfishDriver) checkTarget(ctx context.Context, device string) error {
	allowed, err := d.bootTargets(ctx)
	if err != nil || allowed == nil {
		return err
	}
	want := string(redfishTargets[device])
	if !slices.Contains(allowed, want) {
		return errdefs.NotSupported("the system does not allow boot target %s for %s (BootSourceOverrideTarget@Redfish.AllowableValues: %s)",
			want, device, strings.Join(allowed, ", "))
	}
	return nil
}

var redfishTargets = map[string]rf.BootSourceOverrideTarget{
	BootPXE:   rf.PxeBootSourceOverrideTarget,
	BootDisk:  rf.HddBootSourceOverrideTarget,
	BootCDROM: rf.CdBootSourceOverrideTarget,
}

func (d *redfishDriver) setBoot(ctx context.Context, device string, persistent, efi bool) error {
	if err := d.checkTarget(ctx, device); err != nil {
		return err
	}
	direct, err := d.withBmclib(ctx, func(c *bmclibredfish.Conn) error {
		ok, err := c.BootDeviceSet(ctx, device, persistent, efi)
		if err == nil && !ok {
			return errdefs.Unavailable("the bmc did not accept boot device %s", device)
		}
		return err
	})
	if !direct {
		return err
	}
	return d.withGofish(ctx, func(_ *gofish.APIClient, sys *rf.ComputerSystem) error {
		b := rf.Boot{
			BootSourceOverrideTarget:  redfishTargets[device],
			BootSourceOverrideEnabled: rf.OnceBootSourceOverrideEnabled,
			BootSourceOverrideMode:    rf.LegacyBootSourceOverrideMode,
		}
		if persistent {
			b.BootSourceOverrideEnabled = rf.ContinuousBootSourceOverrideEnabled
		}
		if efi {
			b.BootSourceOverrideMode = rf.UEFIBootSourceOverrideMode
		}
		return sys.SetBoot(b)
	})
}

func (d *redfishDriver) bootPersistent(ctx context.Context) (bool, error) {
	var persistent bool
	err := d.withGofish(ctx, func(_ *gofish.APIClient, sys *rf.ComputerSystem) error {
		persistent = sys.Boot.BootSourceOverrideEnabled == rf.ContinuousBootSourceOverrideEnabled
		return nil
	})
	return persistent, err
}

func (d *redfishDriver) setMedia(ctx context.Context, url string) error {
	direct, err := d.withBmclib(ctx, func(c *bmclibredfish.Conn) error {
		ok, err := c.SetVirtualMedia(ctx, string(rf.CDMediaType), url)
		if err == nil && !ok {
			return errdefs.Unavailable("the bmc did not accept the virtual media request")
		}
		return err
	})
	if !direct {
		return err
	}
	return d.withGofish(ctx, func(c *gofish.APIClient, sys *rf.ComputerSystem) error {
		slots, err := mediaSlots(c, sys)
		if err != nil {
			return err
		}
		for _, vm := range slots {
			if !isCD(vm) {
				continue
			}
			if vm.Inserted && vm.SupportsMediaEject {
				if err := vm.EjectMedia(); err != nil {
					return err
				}
			}
			if url == "" {
				return nil
			}
			if !vm.SupportsMediaInsert {
				continue
			}
			return vm.InsertMedia(url, true, true)
		}
		return errdefs.NotSupported("no virtual CD slot accepts InsertMedia")
	})
}

func isCD(vm *rf.VirtualMedia) bool {
	return slices.Contains(vm.MediaTypes, rf.CDMediaType) || slices.Contains(vm.MediaTypes, rf.DVDMediaType)
}

// managersOf returns the managers of sys: its ManagedBy links, else the
// service's only manager.
func managersOf(c *gofish.APIClient, sys *rf.ComputerSystem) ([]*rf.Manager, error) {
	ms, err := sys.ManagedBy()
	if err == nil && len(ms) > 0 {
		return ms, nil
	}
	all, err := c.Service.Managers()
	if err != nil {
		return nil, err
	}
	if len(all) == 1 {
		return all, nil
	}
	return nil, nil
}

// mediaSlots lists virtual media at the manager first, then at the system
// (both are valid Redfish locations; bmclib looks in the same order).
func mediaSlots(c *gofish.APIClient, sys *rf.ComputerSystem) ([]*rf.VirtualMedia, error) {
	ms, err := managersOf(c, sys)
	if err != nil {
		return nil, err
	}
	for _, m := range ms {
		vms, err := m.VirtualMedia()
		if err == nil && len(vms) > 0 {
			return vms, nil
		}
	}
	vms, err := sys.VirtualMedia()
	if err != nil {
		return nil, nil //nolint:nilerr // no virtual media is an answer, not a failure
	}
	return vms, nil
}

func (d *redfishDriver) inventory(ctx context.Context) (Inventory, error) {
	var inv Inventory
	err := d.withGofish(ctx, func(c *gofish.APIClient, sys *rf.ComputerSystem) error {
		inv.Manufacturer, inv.Model, inv.SerialNumber = sys.Manufacturer, sys.Model, sys.SerialNumber
		inv.SystemID = sys.ID
		d.mu.Lock()
		inv.SystemPicked = d.pickWhy
		d.mu.Unlock()
		nics, err := sys.EthernetInterfaces()
		if err != nil {
			return err
		}
		for _, n := range nics {
			mac := strings.ToLower(n.MACAddress)
			if mac != "" && !slices.Contains(inv.MACs, mac) {
				inv.MACs = append(inv.MACs, mac)
			}
		}
		slices.Sort(inv.MACs)
		ms, err := managersOf(c, sys)
		if err != nil {
			return err
		}
		if len(ms) > 0 {
			inv.BMCFirmware = ms[0].FirmwareVersion
		}
		return nil
	})
	return inv, err
}

func (d *redfishDriver) mediaSlots(ctx context.Context) ([]MediaSlot, error) {
	var out []MediaSlot
	err := d.withGofish(ctx, func(c *gofish.APIClient, sys *rf.ComputerSystem) error {
		slots, err := mediaSlots(c, sys)
		if err != nil {
			return err
		}
		for _, vm := range slots {
			ms := MediaSlot{ID: vm.ID, Inserted: vm.Inserted, Insertable: vm.SupportsMediaInsert, Ejectable: vm.SupportsMediaEject, Image: vm.Image}
			for _, t := range vm.MediaTypes {
				ms.Types = append(ms.Types, string(t))
			}
			out = append(out, ms)
		}
		slices.SortFunc(out, func(a, b MediaSlot) int { return strings.Compare(a.ID, b.ID) })
		return nil
	})
	return out, err
}
