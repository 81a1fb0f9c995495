package bmc_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/bmc"
	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/e2e/lab/redfish"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
)

func dialAuth(t *testing.T, e *redfish.BMC, auth, password string) *bmc.BMC {
	t.Helper()
	b, err := bmc.Dial(context.Background(), bmc.Endpoint{
		Protocol: bmc.ProtocolRedfish, Address: e.URL(), Username: testUser, Password: password, Auth: auth,
	}, fastOpts("rack1-u1"))
	require.NoError(t, err)
	return b
}

// TestRedfishAuthPaths drives power, one-time boot and virtual media
// through every authentication path the emulator offers.
func TestRedfishAuthPaths(t *testing.T) {
	tests := []struct {
		service, auth string
		wantAuth      string
		wantWhy       string
	}{
		{service: redfish.AuthBoth, auth: "", wantAuth: bmc.AuthSession, wantWhy: "the service root links a SessionService"},
		{service: redfish.AuthBoth, auth: bmc.AuthBasic, wantAuth: bmc.AuthBasic},
		{service: redfish.AuthBasicOnly, auth: bmc.AuthAuto, wantAuth: bmc.AuthBasic, wantWhy: "the service root links no SessionService"},
		{service: redfish.AuthBasicOnly, auth: bmc.AuthBasic, wantAuth: bmc.AuthBasic},
		{service: redfish.AuthSessionOnly, auth: bmc.AuthAuto, wantAuth: bmc.AuthSession},
		{service: redfish.AuthSessionOnly, auth: bmc.AuthSession, wantAuth: bmc.AuthSession},
	}
	for _, tc := range tests {
		t.Run(tc.service+"/"+tc.auth, func(t *testing.T) {
			m := &machine.Memory{}
			e := startEmulator(t, redfish.Config{Systems: oneSystem(m), Auth: tc.service})
			b := dialAuth(t, e, tc.auth, testPassword)
			ctx := ctxTimeout(t, 30*time.Second)

			inv, err := b.Inventory(ctx)
			require.NoError(t, err)
			if inv.SerialNumber != "437XR1138R2" {
				t.Fatalf("Inventory().SerialNumber = %q, want 437XR1138R2", inv.SerialNumber)
			}
			caps, err := b.Capabilities(ctx)
			require.NoError(t, err)
			if caps.Auth != tc.wantAuth || !caps.VirtualMedia {
				t.Fatalf("Capabilities() = auth %q, virtual media %v; want %q, true", caps.Auth, caps.VirtualMedia, tc.wantAuth)
			}
			require.NoError(t, b.InsertVirtualMedia(ctx, "http://127.0.0.1:9/agent.iso"))
			require.NoError(t, b.SetBootDevice(ctx, bmc.BootCDROM, false, true))
			require.NoError(t, b.PowerOn(ctx))
			if !m.State() || m.BootSource() != machine.BootCD || m.Media() != "http://127.0.0.1:9/agent.iso" {
				t.Fatalf("after PowerOn machine: %v media %q, want on from cd with the iso", m, m.Media())
			}
			require.NoError(t, b.EjectVirtualMedia(ctx))
			require.NoError(t, b.PowerCycle(ctx))
			require.NoError(t, b.PowerOff(ctx))
			if state, err := b.PowerState(ctx); err != nil || state != bmc.PowerOff {
				t.Fatalf("PowerState() = %q, %v; want off", state, err)
			}

			c := b.Condition()
			want := "redfish " + tc.wantAuth + " auth"
			if c.GetStatus() != conditions.True || !strings.Contains(c.GetMessage(), want) || !strings.Contains(c.GetMessage(), tc.wantWhy) {
				t.Fatalf("Condition() = %s %q, want True naming %q (%s)", c.GetStatus(), c.GetMessage(), want, tc.wantWhy)
			}
			st := e.Stats()
			if tc.wantAuth == bmc.AuthBasic && st.Sessions != 0 {
				t.Fatalf("emulator has %d sessions with basic auth, want 0", st.Sessions)
			}
			if st := b.Stats(); st.Attempts != st.Calls {
				t.Fatalf("Stats() = %+v: some calls were retried", st)
			}
		})
	}
}

// TestRedfishAuthRefusals checks that authentication failures are
// permanent (PermissionDenied or FailedPrecondition), not retried, not
// counted by the circuit breaker, shown in the condition, and say what to
// change without the password.
func TestRedfishAuthRefusals(t *testing.T) {
	tests := []struct {
		name, service, auth, password string
		isClass                       func(error) bool
		want                          []string
	}{
		{
			name: "session mode without SessionService", service: redfish.AuthBasicOnly, auth: bmc.AuthSession, password: testPassword,
			isClass: errdefs.IsFailedPrecondition,
			want:    []string{"has no SessionService", "set spec.bmc.auth to basic or auto"},
		},
		{
			name: "wrong password, basic-only service, auto", service: redfish.AuthBasicOnly, auth: "", password: "wrong-" + testPassword,
			isClass: errdefs.IsPermissionDenied,
			want:    []string{`refused basic authentication for user "kiln-admin"`, "401 Base.1.8.NoValidSession", "check spec.bmc.username and password"},
		},
		{
			name: "basic mode against a session-only service", service: redfish.AuthSessionOnly, auth: bmc.AuthBasic, password: testPassword,
			isClass: errdefs.IsPermissionDenied,
			want:    []string{`refused basic authentication for user "kiln-admin"`, "or set spec.bmc.auth to auto or session"},
		},
		{
			name: "wrong password, session login", service: redfish.AuthBoth, auth: bmc.AuthAuto, password: "wrong-" + testPassword,
			isClass: errdefs.IsPermissionDenied,
			want:    []string{`refused the session login of user "kiln-admin"`, "401 Base.1.8.InsufficientPrivilege", "check spec.bmc.username and password"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := startEmulator(t, redfish.Config{Systems: oneSystem(&machine.Memory{}), Auth: tc.service})
			b := dialAuth(t, e, tc.auth, tc.password)
			ctx := ctxTimeout(t, 30*time.Second)
			var err error
			for range 7 { // more than the breaker's threshold of 5
				_, err = b.PowerState(ctx)
			}
			if err == nil || !tc.isClass(err) {
				t.Fatalf("PowerState() error = %v, want another class", err)
			}
			t.Logf("PowerState() = %v", err)
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("PowerState() error = %q, want it to contain %q", err, w)
				}
			}
			if strings.Contains(err.Error(), tc.password) || strings.Contains(err.Error(), "unable to execute request") {
				t.Errorf("PowerState() error = %q: carries the password or gofish's raw message", err)
			}
			if st := b.Stats(); st.Attempts != st.Calls {
				t.Errorf("Stats() = %+v, want one attempt per call (not retried)", st)
			}
			if b.CircuitOpen() {
				t.Errorf("CircuitOpen() = true after %d refusals, want false", 7)
			}
			c := b.Condition()
			if c.GetStatus() != conditions.False || c.GetReason() != bmc.ReasonRefused || c.GetMessage() != err.Error() {
				t.Errorf("Condition() = %s/%s %q, want False/%s with the error", c.GetStatus(), c.GetReason(), c.GetMessage(), bmc.ReasonRefused)
			}
		})
	}
}

// TestRedfishRightAndWrongPasswordDiffer: against a basic-only service the
// right password works and a wrong one is refused, in auto mode.
func TestRedfishRightAndWrongPasswordDiffer(t *testing.T) {
	e := startEmulator(t, redfish.Config{Systems: oneSystem(&machine.Memory{}), Auth: redfish.AuthBasicOnly})
	ctx := ctxTimeout(t, 30*time.Second)
	if _, err := dialAuth(t, e, "", testPassword).PowerState(ctx); err != nil {
		t.Fatalf("PowerState() with the right password = %v, want nil", err)
	}
	if _, err := dialAuth(t, e, "", "wrong").PowerState(ctx); !errdefs.IsPermissionDenied(err) {
		t.Fatalf("PowerState() with a wrong password = %v, want PermissionDenied", err)
	}
}

// noLocation drops the Location header of session logins, like services
// whose login answers carry a token but no session URI: gofish is then
// left without a session and bmclib says "client not authenticated".
type noLocation struct{ http.ResponseWriter }

func (w noLocation) WriteHeader(code int) {
	w.Header().Del("Location")
	w.ResponseWriter.WriteHeader(code)
}

func TestRedfishNoSessionAfterLogin(t *testing.T) {
	e, err := redfish.New(redfish.Config{Username: testUser, Password: testPassword, Systems: oneSystem(&machine.Memory{})})
	require.NoError(t, err)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.ServeHTTP(noLocation{w}, r) }))
	t.Cleanup(srv.Close)
	ctx := ctxTimeout(t, 30*time.Second)

	dial := func(auth string) *bmc.BMC {
		b, err := bmc.Dial(ctx, bmc.Endpoint{Protocol: bmc.ProtocolRedfish, Address: srv.URL, Username: testUser, Password: testPassword, Auth: auth}, fastOpts("noloc"))
		require.NoError(t, err)
		return b
	}
	b := dial(bmc.AuthSession)
	_, err = b.PowerState(ctx)
	if !errdefs.IsPermissionDenied(err) || !strings.Contains(err.Error(), `did not authenticate user "kiln-admin"`) ||
		!strings.Contains(err.Error(), "set spec.bmc.auth to basic") {
		t.Fatalf("PowerState() = %v, want PermissionDenied naming the user and the fix", err)
	}
	t.Logf("PowerState() = %v", err)
	if st := b.Stats(); st.Attempts != 1 {
		t.Fatalf("Stats().Attempts = %d, want 1 (not retried)", st.Attempts)
	}
	// The fix the message names works.
	if _, err := dial(bmc.AuthBasic).PowerState(ctx); err != nil {
		t.Fatalf("PowerState() with basic auth = %v, want nil", err)
	}
}

// TestRedfishErrorTable pins the class and text of the common Redfish
// failures (the table in docs/bmc.md).
func TestRedfishErrorTable(t *testing.T) {
	closed := httptest.NewServer(http.NotFoundHandler())
	closedURL := closed.URL
	closed.Close()
	locked := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, `{"error":{"code":"Base.1.8.NoValidSession","message":"log in first"}}`, http.StatusUnauthorized)
	}))
	t.Cleanup(locked.Close)

	tests := []struct {
		name     string
		cfg      redfish.Config
		address  string // overrides the emulator's URL
		auth     string
		password string
		systemID string
		setup    func(e *redfish.BMC)
		isClass  func(error) bool
		retried  bool
		want     string
	}{
		{name: "401 on session create", isClass: errdefs.IsPermissionDenied, password: "wrong",
			want: `refused the session login of user "kiln-admin" (401 Base.1.8.InsufficientPrivilege: invalid username or password): check spec.bmc.username and password`},
		{name: "401 on basic", cfg: redfish.Config{Auth: redfish.AuthBasicOnly}, password: "wrong", isClass: errdefs.IsPermissionDenied,
			want: `refused basic authentication for user "kiln-admin" (401 Base.1.8.NoValidSession: no valid session or credentials, on /redfish/v1/Systems): check spec.bmc.username and password`},
		{name: "no SessionService", cfg: redfish.Config{Auth: redfish.AuthBasicOnly}, auth: bmc.AuthSession, isClass: errdefs.IsFailedPrecondition,
			want: "has no SessionService (its service root links no Sessions), so session authentication cannot work: set spec.bmc.auth to basic or auto"},
		{name: "401 on the service root", address: locked.URL, isClass: errdefs.IsPermissionDenied,
			want: "refused to serve its service root /redfish/v1/ without credentials (401 Base.1.8.NoValidSession: log in first)"},
		{name: "404 on the system", systemID: "nope", isClass: errdefs.IsNotFound,
			want: `no system with id "nope" (systems: 437XR1138R2)`},
		{name: "tls certificate unknown", cfg: redfish.Config{TLS: true}, isClass: errdefs.IsFailedPrecondition,
			want: "the bmc's tls certificate is not trusted (set root CAs or insecure skip verify)"},
		{name: "connection refused", address: closedURL, isClass: errdefs.IsUnavailable, retried: true,
			want: "connection refused"},
		{name: "timeout", setup: func(e *redfish.BMC) { e.SetLatency(3 * time.Second) }, isClass: errdefs.IsUnavailable, retried: true,
			want: "attempt timed out: the bmc gave no answer (connect 5s, response headers 700ms, attempt 5s)"},
		{name: "503", setup: func(e *redfish.BMC) { e.FailNext(100, 503) }, isClass: errdefs.IsUnavailable, retried: true,
			want: "is busy or failing (503 Base.1.8.GeneralError: injected fault"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg
			cfg.Systems = oneSystem(&machine.Memory{})
			e := startEmulator(t, cfg)
			if tc.setup != nil {
				tc.setup(e)
			}
			addr := e.URL()
			if tc.address != "" {
				addr = tc.address
			}
			pw := testPassword
			if tc.password != "" {
				pw = tc.password
			}
			opts := fastOpts("r1")
			opts.AttemptTimeout, opts.ResponseTimeout, opts.MaxAttempts = 5*time.Second, 700*time.Millisecond, 2
			b, err := bmc.Dial(context.Background(), bmc.Endpoint{Protocol: bmc.ProtocolRedfish, Address: addr,
				Username: testUser, Password: pw, Auth: tc.auth, SystemID: tc.systemID}, opts)
			require.NoError(t, err)
			_, err = b.PowerState(ctxTimeout(t, 10*time.Second))
			t.Logf("%s: %v", tc.name, err)
			if err == nil || !tc.isClass(err) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("PowerState() = %v, want the right class and %q", err, tc.want)
			}
			if got := b.Stats().Attempts > 1; got != tc.retried {
				t.Fatalf("PowerState() retried = %v, want %v", got, tc.retried)
			}
		})
	}
}

// TestRedfishAutoFallsBackWhenSessionsRefused: a service root that links
// sessions but refuses a login as unsupported (405) gets basic auth in
// auto mode, and a clear error in session mode.
func TestRedfishAutoFallsBackWhenSessionsRefused(t *testing.T) {
	e, err := redfish.New(redfish.Config{Username: testUser, Password: testPassword, Systems: oneSystem(&machine.Memory{})})
	require.NoError(t, err)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && strings.HasPrefix(r.URL.Path, "/redfish/v1/SessionService/Sessions") {
			http.Error(w, `{"error":{"code":"Base.1.8.OperationNotAllowed","message":"sessions are disabled"}}`, http.StatusMethodNotAllowed)
			return
		}
		e.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	ctx := ctxTimeout(t, 30*time.Second)
	dial := func(auth string) *bmc.BMC {
		b, err := bmc.Dial(ctx, bmc.Endpoint{Protocol: bmc.ProtocolRedfish, Address: srv.URL, Username: testUser, Password: testPassword, Auth: auth}, fastOpts("nosess"))
		require.NoError(t, err)
		return b
	}
	b := dial("")
	require.NoError(t, b.PowerOn(ctx))
	caps, err := b.Capabilities(ctx)
	require.NoError(t, err)
	if c := b.Condition(); caps.Auth != bmc.AuthBasic || !strings.Contains(c.GetMessage(), "redfish basic auth (the service refused session creation with 405)") {
		t.Fatalf("auto against refused sessions: auth %q, condition %q; want basic, naming the 405", caps.Auth, c.GetMessage())
	}
	_, err = dial(bmc.AuthSession).PowerState(ctx)
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "refused session creation as unsupported (405 Base.1.8.OperationNotAllowed: sessions are disabled), so session authentication cannot work: set spec.bmc.auth to basic or auto") {
		t.Fatalf("session mode against refused sessions = %v, want FailedPrecondition naming the 405 and the fix", err)
	}
	t.Logf("session mode: %v", err)
}

// TestRedfishRetryAfter: a 503 with Retry-After is waited out (not the
// 20 ms backoff) and named in the error.
func TestRedfishRetryAfter(t *testing.T) {
	e := startEmulator(t, redfish.Config{Systems: oneSystem(&machine.Memory{})})
	e.SetRetryAfter(time.Second)
	b := dialEmulator(t, e, fastOpts("busy"))
	ctx := ctxTimeout(t, 30*time.Second)

	e.FailNext(1, 503)
	start := time.Now()
	_, err := b.PowerState(ctx)
	require.NoError(t, err)
	if took := time.Since(start); took < time.Second {
		t.Fatalf("PowerState() after a 503 with Retry-After: 1 took %v, want at least 1s", took)
	}

	opts := fastOpts("busy-once")
	opts.MaxAttempts = 1
	b = dialEmulator(t, e, opts)
	e.FailNext(1, 503)
	_, err = b.PowerState(ctx)
	if !errdefs.IsUnavailable(err) || !strings.Contains(err.Error(), "(503 Base.1.8.GeneralError: injected fault; Retry-After 1s)") {
		t.Fatalf("PowerState() = %v, want Unavailable naming the 503 and its Retry-After", err)
	}
}
