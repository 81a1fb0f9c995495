// Package redfish is the lab's Redfish BMC emulator: an HTTP(S) server on
// loopback that answers the subset of Redfish that Kiln (through bmclib and
// gofish) uses — service root, sessions, systems with Reset and boot
// override, managers with virtual media — with resources shaped like the
// DMTF public-rackmount1 mockup. Each emulated system drives a
// machine.Machine, so a power-on through Redfish really starts the lab host.
//
// Faults can be injected per BMC with Go methods or the admin HTTP API
// (AdminPath): added latency, bursts of 5xx answers, a session limit, and a
// power state that lags or lies.
//
// The package also serves the DMTF mockup trees read-only (MockupHandler)
// for parser tests.
package redfish

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"time"

	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// System is one emulated computer system.
type System struct {
	// ID is the Redfish Id (the last path element); required.
	ID string
	// Name is the Redfish Name; defaults to ID. Several systems may share one.
	Name string
	// SystemType is the Redfish SystemType: "Physical" (default), or for
	// example "DPU" for a SmartNIC's SoC that its BMC lists beside the host.
	SystemType string
	// BootTargets are the BootSourceOverrideTarget AllowableValues
	// (default None, Pxe, Cd, Hdd); a PATCH of another target is 400.
	BootTargets  []string
	Manufacturer string
	Model        string
	SerialNumber string
	// MACs are the system's NIC addresses, served as EthernetInterfaces.
	MACs []string
	// Machine is what power and boot actions drive; required.
	Machine machine.Machine
}

// Authentication modes of an emulated BMC (Config.Auth).
const (
	// AuthBoth serves a SessionService and accepts basic authentication
	// too (the default).
	AuthBoth = "both"
	// AuthBasicOnly serves no SessionService (the service root links
	// none), answers a session login with 401 and accepts only HTTP basic
	// authentication, as several BMCs and BMC simulators do.
	AuthBasicOnly = "basic"
	// AuthSessionOnly serves a SessionService and refuses basic
	// authentication with 401.
	AuthSessionOnly = "session"
)

// Config configures one emulated BMC.
type Config struct {
	// Auth is AuthBoth (default when empty), AuthBasicOnly or
	// AuthSessionOnly.
	Auth string
	// Username and Password are the only valid credentials (session login
	// and basic auth).
	Username string
	Password string
	// Systems served by this BMC; at least one. Each gets its own manager.
	Systems []System
	// FirmwareVersion of the managers (default "1.45.455b66-rev4").
	FirmwareVersion string
	// MaxSessions is the session limit (default 16); see also SetMaxSessions.
	MaxSessions int
	// SessionTimeout expires idle sessions (default 60s).
	SessionTimeout time.Duration
	// NoVirtualMedia makes the managers expose no virtual media.
	NoVirtualMedia bool
	// OnceBecomesContinuous emulates BMCs that do not honour a one-time
	// boot override: a PATCH of BootSourceOverrideEnabled=Once is stored as
	// Continuous.
	OnceBecomesContinuous bool
	// TLS serves HTTPS with a self-signed certificate.
	TLS bool
	// Logger receives request and fault messages; nil discards them.
	Logger *slog.Logger
}

// Stats are counters an emulated BMC keeps for tests and benchmarks.
type Stats struct {
	Requests int
	// MaxInFlight is the largest number of requests served at once.
	MaxInFlight int
	// Sessions is the number of open sessions.
	Sessions int
	// Resets counts ComputerSystem.Reset actions by ResetType.
	Resets map[string]int
}

type session struct {
	id       string
	token    string
	lastUsed time.Time
}

type systemState struct {
	cfg       System
	managerID string
	target    string // Pxe, Cd, Hdd, None
	enabled   string // Once, Continuous, Disabled
	mode      string // UEFI, Legacy

	// lastChange and prevOn implement the lagging power state fault.
	lastChange time.Time
	prevOn     bool
	// lieOn is the frozen state while the power state lies.
	lieOn bool
}

// BMC is one emulated Redfish BMC. Methods are safe for concurrent use.
type BMC struct {
	cfg Config
	log *slog.Logger
	mux *http.ServeMux
	srv *httptest.Server

	mu          sync.Mutex
	systems     map[string]*systemState
	order       []string
	managers    map[string]*systemState
	media       map[string]*mediaState // by manager id
	sessions    map[string]*session    // by id
	nextSession int
	latency     time.Duration
	failN       int
	failStatus  int
	maxSessions int
	powerLag    time.Duration
	powerLies   bool
	retryAfter  time.Duration
	inFlight    int
	stats       Stats
	now         func() time.Time
}

type mediaState struct {
	image    string
	inserted bool
}

// New returns an emulated BMC; Start makes it listen. It returns
// InvalidArgument for a config without systems or with a system lacking an
// ID or Machine.
func New(cfg Config) (*BMC, error) {
	if len(cfg.Systems) == 0 {
		return nil, errdefs.InvalidArgument("redfish emulator: no systems")
	}
	switch cfg.Auth {
	case "":
		cfg.Auth = AuthBoth
	case AuthBoth, AuthBasicOnly, AuthSessionOnly:
	default:
		return nil, errdefs.InvalidArgument("redfish emulator: auth %q: want both, basic or session", cfg.Auth)
	}
	if cfg.FirmwareVersion == "" {
		cfg.FirmwareVersion = "1.45.455b66-rev4"
	}
	if cfg.MaxSessions <= 0 {
		cfg.MaxSessions = 16
	}
	if cfg.SessionTimeout <= 0 {
		cfg.SessionTimeout = 60 * time.Second
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	b := &BMC{
		cfg:         cfg,
		log:         log.With("component", "redfish-emulator"),
		systems:     map[string]*systemState{},
		managers:    map[string]*systemState{},
		media:       map[string]*mediaState{},
		sessions:    map[string]*session{},
		maxSessions: cfg.MaxSessions,
		stats:       Stats{Resets: map[string]int{}},
		now:         time.Now,
	}
	for _, s := range cfg.Systems {
		if s.ID == "" || s.Machine == nil {
			return nil, errdefs.InvalidArgument("redfish emulator: system needs an ID and a Machine")
		}
		if _, dup := b.systems[s.ID]; dup {
			return nil, errdefs.InvalidArgument("redfish emulator: duplicate system id %q", s.ID)
		}
		if s.Name == "" {
			s.Name = s.ID
		}
		if s.SystemType == "" {
			s.SystemType = "Physical"
		}
		if s.BootTargets == nil {
			s.BootTargets = []string{"None", "Pxe", "Cd", "Hdd"}
		}
		mid := "BMC"
		if len(cfg.Systems) > 1 {
			mid = s.ID + "BMC"
		}
		st := &systemState{cfg: s, managerID: mid, target: "None", enabled: "Disabled", mode: "UEFI"}
		b.systems[s.ID] = st
		b.managers[mid] = st
		b.media[mid] = &mediaState{}
		b.order = append(b.order, s.ID)
	}
	b.routes()
	return b, nil
}

// Start listens on a free loopback port (127.0.0.1) and serves.
func (b *BMC) Start() {
	srv := httptest.NewUnstartedServer(b)
	srv.Config.ErrorLog = nil
	if b.cfg.TLS {
		srv.StartTLS()
	} else {
		srv.Start()
	}
	b.srv = srv
}

// StartOn listens on addr (host:port; port 0 picks a free one) instead
// of a loopback port and serves, for an emulator other machines reach. It
// returns the listen error (Unavailable).
func (b *BMC) StartOn(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return errdefs.Unavailable("redfish emulator: listen on %s: %v", addr, err)
	}
	srv := httptest.NewUnstartedServer(b)
	srv.Listener.Close()
	srv.Listener = ln
	srv.Config.ErrorLog = nil
	if b.cfg.TLS {
		srv.StartTLS()
	} else {
		srv.Start()
	}
	b.srv = srv
	return nil
}

// URL is the base URL (http://127.0.0.1:PORT) once started.
func (b *BMC) URL() string {
	if b.srv == nil {
		return ""
	}
	return b.srv.URL
}

// RootCAs returns a pool that trusts the emulator's certificate (nil
// unless Config.TLS).
func (b *BMC) RootCAs() *x509.CertPool {
	if b.srv == nil || b.srv.Certificate() == nil {
		return nil
	}
	p := x509.NewCertPool()
	p.AddCert(b.srv.Certificate())
	return p
}

// TLSConfig is a client TLS configuration that trusts the emulator.
func (b *BMC) TLSConfig() *tls.Config {
	return &tls.Config{RootCAs: b.RootCAs(), MinVersion: tls.VersionTLS12}
}

// Addr is host:port of the listener once started.
func (b *BMC) Addr() string {
	if b.srv == nil {
		return ""
	}
	return b.srv.Listener.Addr().String()
}

// Close stops serving and closes open connections.
func (b *BMC) Close() {
	if b.srv != nil {
		b.srv.CloseClientConnections()
		b.srv.Close()
	}
}

// --- fault injection

// SetLatency delays every answer by d (0 removes the delay).
func (b *BMC) SetLatency(d time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.latency = d
}

// FailNext answers the next n requests with HTTP status (500 when 0)
// and a Redfish error body.
func (b *BMC) FailNext(n, status int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if status == 0 {
		status = http.StatusInternalServerError
	}
	b.failN, b.failStatus = n, status
}

// SetRetryAfter makes injected 429 and 503 answers carry
// Retry-After: d (in whole seconds; 0 removes the header).
func (b *BMC) SetRetryAfter(d time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.retryAfter = d
}

// SetMaxSessions changes the session limit; logins beyond it get 503
// SessionLimitExceeded. Existing sessions stay.
func (b *BMC) SetMaxSessions(n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.maxSessions = n
}

// SetPowerLag makes the reported PowerState keep its old value for d after
// every change (0 removes the lag).
func (b *BMC) SetPowerLag(d time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.powerLag = d
}

// SetPowerLies freezes the reported PowerState of every system at its
// current value while lie is true; actions still reach the machine.
func (b *BMC) SetPowerLies(lie bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.powerLies = lie
	for _, st := range b.systems {
		st.lieOn = b.reportedOnLocked(st, true)
	}
}

// ClearFaults removes every injected fault and restores the configured
// session limit.
func (b *BMC) ClearFaults() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.latency, b.failN, b.powerLag, b.powerLies, b.retryAfter = 0, 0, 0, false, 0
	b.maxSessions = b.cfg.MaxSessions
}

// Stats returns a copy of the counters.
func (b *BMC) Stats() Stats {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := b.stats
	s.Sessions = len(b.sessions)
	s.Resets = map[string]int{}
	for k, v := range b.stats.Resets {
		s.Resets[k] = v
	}
	return s
}

// BootOverride returns a system's stored override (target, enabled, mode).
func (b *BMC) BootOverride(systemID string) (target, enabled, mode string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	st := b.systems[systemID]
	if st == nil {
		return "", "", ""
	}
	return st.target, st.enabled, st.mode
}

// --- serving

// ServeHTTP applies the injected faults, then routes the request.
func (b *BMC) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == AdminPath {
		b.serveAdmin(w, r)
		return
	}
	b.mu.Lock()
	b.stats.Requests++
	b.inFlight++
	if b.inFlight > b.stats.MaxInFlight {
		b.stats.MaxInFlight = b.inFlight
	}
	latency, retryAfter := b.latency, b.retryAfter
	fail := 0
	if b.failN > 0 {
		b.failN--
		fail = b.failStatus
	}
	b.mu.Unlock()
	defer func() {
		b.mu.Lock()
		b.inFlight--
		b.mu.Unlock()
	}()

	if latency > 0 {
		t := time.NewTimer(latency)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
			return
		}
	}
	if fail != 0 {
		b.log.Debug("injected failure", "status", fail, "path", r.URL.Path)
		if retryAfter > 0 && (fail == http.StatusServiceUnavailable || fail == http.StatusTooManyRequests) {
			w.Header().Set("Retry-After", fmt.Sprint(int(retryAfter.Seconds())))
		}
		writeError(w, fail, "Base.1.8.GeneralError", "injected fault")
		return
	}
	b.mux.ServeHTTP(w, r)
}

func (b *BMC) routes() {
	m := http.NewServeMux()
	m.HandleFunc("GET /redfish", b.serveVersions)
	m.HandleFunc("GET /redfish/{$}", b.serveVersions)
	m.HandleFunc("GET /redfish/v1", b.serveRoot)
	m.HandleFunc("GET /redfish/v1/{$}", b.serveRoot)
	m.HandleFunc("POST /redfish/v1/SessionService/Sessions", b.login)
	m.HandleFunc("POST /redfish/v1/SessionService/Sessions/{$}", b.login)

	auth := func(h http.HandlerFunc) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if !b.authorized(r) {
				if b.cfg.Auth != AuthSessionOnly {
					w.Header().Set("WWW-Authenticate", `Basic realm="kiln-lab"`)
				}
				writeError(w, http.StatusUnauthorized, "Base.1.8.NoValidSession", "no valid session or credentials")
				return
			}
			h(w, r)
		}
	}
	m.HandleFunc("GET /redfish/v1/SessionService", auth(b.serveSessionService))
	m.HandleFunc("GET /redfish/v1/SessionService/Sessions", auth(b.serveSessions))
	m.HandleFunc("GET /redfish/v1/SessionService/Sessions/{sid}", auth(b.serveSession))
	m.HandleFunc("DELETE /redfish/v1/SessionService/Sessions/{sid}", auth(b.logout))
	m.HandleFunc("GET /redfish/v1/Systems", auth(b.serveSystems))
	m.HandleFunc("GET /redfish/v1/Systems/{id}", auth(b.serveSystem))
	m.HandleFunc("PATCH /redfish/v1/Systems/{id}", auth(b.patchSystem))
	m.HandleFunc("POST /redfish/v1/Systems/{id}/Actions/ComputerSystem.Reset", auth(b.reset))
	m.HandleFunc("GET /redfish/v1/Systems/{id}/EthernetInterfaces", auth(b.serveNICs))
	m.HandleFunc("GET /redfish/v1/Systems/{id}/EthernetInterfaces/{nic}", auth(b.serveNIC))
	m.HandleFunc("GET /redfish/v1/Managers", auth(b.serveManagers))
	m.HandleFunc("GET /redfish/v1/Managers/{mid}", auth(b.serveManager))
	m.HandleFunc("GET /redfish/v1/Managers/{mid}/VirtualMedia", auth(b.serveMediaCollection))
	m.HandleFunc("GET /redfish/v1/Managers/{mid}/VirtualMedia/CD1", auth(b.serveMedia))
	m.HandleFunc("POST /redfish/v1/Managers/{mid}/VirtualMedia/CD1/Actions/VirtualMedia.InsertMedia", auth(b.insertMedia))
	m.HandleFunc("POST /redfish/v1/Managers/{mid}/VirtualMedia/CD1/Actions/VirtualMedia.EjectMedia", auth(b.ejectMedia))
	m.HandleFunc("GET /redfish/v1/Chassis", auth(func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, collection("/redfish/v1/Chassis", "ChassisCollection", "Chassis Collection", nil))
	}))
	m.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "Base.1.8.ResourceMissingAtURI", "no resource at "+r.URL.Path)
	})
	b.mux = m
}

func (b *BMC) authorized(r *http.Request) bool {
	if tok := r.Header.Get("X-Auth-Token"); tok != "" {
		b.mu.Lock()
		defer b.mu.Unlock()
		now := b.now()
		for _, s := range b.sessions {
			if s.token == tok {
				if now.Sub(s.lastUsed) > b.cfg.SessionTimeout {
					delete(b.sessions, s.id)
					return false
				}
				s.lastUsed = now
				return true
			}
		}
		return false
	}
	if b.cfg.Auth == AuthSessionOnly {
		return false
	}
	u, p, ok := r.BasicAuth()
	return ok && u == b.cfg.Username && p == b.cfg.Password
}

func (b *BMC) login(w http.ResponseWriter, r *http.Request) {
	if b.cfg.Auth == AuthBasicOnly {
		w.Header().Set("WWW-Authenticate", `Basic realm="kiln-lab"`)
		writeError(w, http.StatusUnauthorized, "Base.1.8.NoValidSession", "sessions are not supported: use basic authentication")
		return
	}
	var body struct {
		UserName string
		Password string
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		writeError(w, http.StatusBadRequest, "Base.1.8.MalformedJSON", "malformed session request")
		return
	}
	if body.UserName != b.cfg.Username || body.Password != b.cfg.Password {
		writeError(w, http.StatusUnauthorized, "Base.1.8.InsufficientPrivilege", "invalid username or password")
		return
	}
	b.mu.Lock()
	now := b.now()
	for id, s := range b.sessions {
		if now.Sub(s.lastUsed) > b.cfg.SessionTimeout {
			delete(b.sessions, id)
		}
	}
	if len(b.sessions) >= b.maxSessions {
		b.mu.Unlock()
		writeError(w, http.StatusServiceUnavailable, "Base.1.8.SessionLimitExceeded",
			"the session establishment failed due to the number of simultaneous sessions exceeding the limit")
		return
	}
	b.nextSession++
	s := &session{id: fmt.Sprint(b.nextSession), token: randomToken(), lastUsed: now}
	b.sessions[s.id] = s
	b.mu.Unlock()

	loc := "/redfish/v1/SessionService/Sessions/" + s.id
	w.Header().Set("Location", loc)
	w.Header().Set("X-Auth-Token", s.token)
	writeJSON(w, http.StatusCreated, sessionJSON(s.id, body.UserName))
}

func (b *BMC) logout(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("sid")
	b.mu.Lock()
	_, ok := b.sessions[id]
	delete(b.sessions, id)
	b.mu.Unlock()
	if !ok {
		writeError(w, http.StatusNotFound, "Base.1.8.ResourceMissingAtURI", "no session "+id)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func randomToken() string {
	var buf [16]byte
	_, _ = rand.Read(buf[:])
	return hex.EncodeToString(buf[:])
}

func (b *BMC) system(w http.ResponseWriter, r *http.Request) *systemState {
	b.mu.Lock()
	st := b.systems[r.PathValue("id")]
	b.mu.Unlock()
	if st == nil {
		writeError(w, http.StatusNotFound, "Base.1.8.ResourceMissingAtURI", "no system "+r.PathValue("id"))
	}
	return st
}

func (b *BMC) manager(w http.ResponseWriter, r *http.Request) (*systemState, *mediaState) {
	b.mu.Lock()
	st := b.managers[r.PathValue("mid")]
	ms := b.media[r.PathValue("mid")]
	b.mu.Unlock()
	if st == nil {
		writeError(w, http.StatusNotFound, "Base.1.8.ResourceMissingAtURI", "no manager "+r.PathValue("mid"))
	}
	return st, ms
}

// reportedOnLocked is the PowerState the BMC claims, after the lag and lie
// faults; raw ignores the lie.
func (b *BMC) reportedOnLocked(st *systemState, raw bool) bool {
	if b.powerLies && !raw {
		return st.lieOn
	}
	actual := st.cfg.Machine.State()
	if b.powerLag > 0 && !st.lastChange.IsZero() && b.now().Sub(st.lastChange) < b.powerLag {
		return st.prevOn
	}
	return actual
}

// noteChange records the state before a power action, for the lag fault.
func (b *BMC) noteChange(st *systemState, wasOn bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	st.prevOn = wasOn
	st.lastChange = b.now()
}

// NextBootDevice is the device system id boots from when its OS reboots
// it (a one-time override is consumed), for Machine backends whose OS can
// reboot itself; "" for an unknown system.
func (b *BMC) NextBootDevice(id string) string {
	for _, st := range b.systems {
		if st.cfg.ID == id {
			return b.takeBootDevice(st)
		}
	}
	return ""
}

// takeBootDevice returns the device the next power-on boots from and
// consumes a one-time override.
func (b *BMC) takeBootDevice(st *systemState) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	dev := machine.BootDisk
	if st.enabled == "Once" || st.enabled == "Continuous" {
		switch st.target {
		case "Pxe":
			dev = machine.BootPXE
		case "Cd":
			dev = machine.BootCD
		case "Hdd":
			dev = machine.BootDisk
		}
		if st.enabled == "Once" {
			st.enabled, st.target = "Disabled", "None"
		}
	}
	return dev
}

func (b *BMC) reset(w http.ResponseWriter, r *http.Request) {
	st := b.system(w, r)
	if st == nil {
		return
	}
	var body struct{ ResetType string }
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		writeError(w, http.StatusBadRequest, "Base.1.8.MalformedJSON", "malformed reset request")
		return
	}
	b.mu.Lock()
	b.stats.Resets[body.ResetType]++
	b.mu.Unlock()

	m := st.cfg.Machine
	ctx := r.Context()
	wasOn := m.State()
	var err error
	switch body.ResetType {
	case "On", "ForceOn":
		if !wasOn {
			err = m.PowerOn(ctx, b.takeBootDevice(st))
		}
	case "ForceOff":
		err = m.PowerOff(ctx, false)
	case "GracefulShutdown":
		// A real BMC answers at once and the OS shuts down afterwards.
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := m.PowerOff(ctx, true); err != nil {
				b.log.Warn("graceful shutdown failed", "system", st.cfg.ID, "error", err)
			}
		}()
	case "ForceRestart", "GracefulRestart", "PowerCycle":
		if wasOn {
			err = m.PowerOff(ctx, body.ResetType == "GracefulRestart")
		}
		if err == nil {
			err = m.PowerOn(ctx, b.takeBootDevice(st))
		}
	case "PushPowerButton":
		if wasOn {
			err = m.PowerOff(ctx, true)
		} else {
			err = m.PowerOn(ctx, b.takeBootDevice(st))
		}
	case "Nmi":
	default:
		writeError(w, http.StatusBadRequest, "Base.1.8.ActionParameterValueNotInList",
			fmt.Sprintf("ResetType %q is not supported", body.ResetType))
		return
	}
	if err != nil {
		writeError(w, http.StatusInternalServerError, "Base.1.8.InternalError", "machine: "+err.Error())
		return
	}
	b.noteChange(st, wasOn)
	w.WriteHeader(http.StatusNoContent)
}

var (
	validTargets = map[string]bool{"None": true, "Pxe": true, "Cd": true, "Hdd": true}
	validEnabled = map[string]bool{"Once": true, "Continuous": true, "Disabled": true}
	validModes   = map[string]bool{"UEFI": true, "Legacy": true}
)

func (b *BMC) patchSystem(w http.ResponseWriter, r *http.Request) {
	st := b.system(w, r)
	if st == nil {
		return
	}
	var body struct {
		Boot *struct {
			BootSourceOverrideTarget  string
			BootSourceOverrideEnabled string
			BootSourceOverrideMode    string
		}
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		writeError(w, http.StatusBadRequest, "Base.1.8.MalformedJSON", "malformed PATCH body")
		return
	}
	if body.Boot == nil {
		w.WriteHeader(http.StatusNoContent)
		return
	}
	bt := body.Boot
	targets := map[string]bool{}
	for _, t := range st.cfg.BootTargets {
		targets[t] = validTargets[t]
	}
	for _, c := range []struct {
		name, v string
		ok      map[string]bool
	}{
		{"BootSourceOverrideTarget", bt.BootSourceOverrideTarget, targets},
		{"BootSourceOverrideEnabled", bt.BootSourceOverrideEnabled, validEnabled},
		{"BootSourceOverrideMode", bt.BootSourceOverrideMode, validModes},
	} {
		if c.v != "" && !c.ok[c.v] {
			writeError(w, http.StatusBadRequest, "Base.1.8.PropertyValueNotInList",
				fmt.Sprintf("the value %q for the property %s is not in the list of acceptable values", c.v, c.name))
			return
		}
	}
	b.mu.Lock()
	if bt.BootSourceOverrideTarget != "" {
		st.target = bt.BootSourceOverrideTarget
	}
	if bt.BootSourceOverrideEnabled != "" {
		st.enabled = bt.BootSourceOverrideEnabled
		if st.enabled == "Once" && b.cfg.OnceBecomesContinuous {
			st.enabled = "Continuous"
		}
	}
	if bt.BootSourceOverrideMode != "" {
		st.mode = bt.BootSourceOverrideMode
	}
	b.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
}

func (b *BMC) insertMedia(w http.ResponseWriter, r *http.Request) {
	st, ms := b.manager(w, r)
	if st == nil {
		return
	}
	if b.cfg.NoVirtualMedia {
		writeError(w, http.StatusNotFound, "Base.1.8.ResourceMissingAtURI", "no virtual media")
		return
	}
	var body struct {
		Image string
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil || body.Image == "" {
		writeError(w, http.StatusBadRequest, "Base.1.8.ActionParameterMissing", "InsertMedia needs an Image")
		return
	}
	if err := st.cfg.Machine.InsertMedia(body.Image); err != nil {
		writeError(w, http.StatusInternalServerError, "Base.1.8.InternalError", "machine: "+err.Error())
		return
	}
	b.mu.Lock()
	ms.image, ms.inserted = body.Image, true
	b.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
}

func (b *BMC) ejectMedia(w http.ResponseWriter, r *http.Request) {
	st, ms := b.manager(w, r)
	if st == nil {
		return
	}
	if b.cfg.NoVirtualMedia {
		writeError(w, http.StatusNotFound, "Base.1.8.ResourceMissingAtURI", "no virtual media")
		return
	}
	if err := st.cfg.Machine.InsertMedia(""); err != nil {
		writeError(w, http.StatusInternalServerError, "Base.1.8.InternalError", "machine: "+err.Error())
		return
	}
	b.mu.Lock()
	ms.image, ms.inserted = "", false
	b.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
}

// --- helpers

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.Header().Set("OData-Version", "4.0")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// writeError answers with a Redfish error body (DSP0266 §9.6).
func writeError(w http.ResponseWriter, status int, messageID, msg string) {
	writeJSON(w, status, map[string]any{
		"error": map[string]any{
			"code":    messageID,
			"message": msg,
			"@Message.ExtendedInfo": []any{map[string]any{
				"@odata.type": "#Message.v1_1_1.Message",
				"MessageId":   messageID,
				"Message":     msg,
				"Severity":    "Critical",
			}},
		},
	})
}
