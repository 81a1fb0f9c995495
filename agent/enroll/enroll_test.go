package enroll_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/kilnhq/kiln/agent/enroll"
	"github.com/kilnhq/kiln/agent/identity"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	"github.com/kilnhq/kiln/internal/pki"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// enrollment is a controller Enrollment service over a real CA that
// records every token it receives; refuse makes it refuse them all.
type enrollment struct {
	controllerv1.UnimplementedEnrollmentServer
	ca     *pki.CA
	refuse error

	mu     sync.Mutex
	tokens []string
}

func (e *enrollment) Enroll(ctx context.Context, req *controllerv1.EnrollRequest) (*controllerv1.EnrollResponse, error) {
	e.mu.Lock()
	e.tokens = append(e.tokens, req.GetToken())
	e.mu.Unlock()
	if e.refuse != nil {
		return nil, errgrpc.ToGRPC(e.refuse)
	}
	host := req.GetHost()
	if host == "" {
		host = req.GetFacts().GetHostname()
	}
	certPEM, err := e.ca.SignCSR(req.GetCsrDer(), pki.RoleAgent, host, time.Hour, time.Now())
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &controllerv1.EnrollResponse{CertificatePem: certPEM, CaPem: e.ca.CertPEM(), Host: host}, nil
}

func (e *enrollment) received() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.tokens...)
}

// serve starts e on loopback, presenting a certificate of role issued by
// ca, with ca in the chain (as the controller serves it).
func serve(t *testing.T, e *enrollment, ca *pki.CA, role pki.Role) string {
	t.Helper()
	certPEM, keyPEM, err := ca.Issue(role, "kiln-controller", []string{"127.0.0.1"}, time.Hour, time.Now())
	require.NoError(t, err)
	cert, err := tls.X509KeyPair(append(certPEM, ca.CertPEM()...), keyPEM)
	require.NoError(t, err)
	s := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}})))
	controllerv1.RegisterEnrollmentServer(s, e)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go s.Serve(lis)
	t.Cleanup(s.Stop)
	return lis.Addr().String()
}

const token = "abcdef.0123456789abcdef"

func newCA(t *testing.T) *pki.CA {
	ca, err := pki.NewCA("kiln", time.Now())
	require.NoError(t, err)
	return ca
}

func TestEnroll(t *testing.T) {
	ca := newCA(t)
	e := &enrollment{ca: ca}
	addr := serve(t, e, ca, pki.RoleController)
	dir := filepath.Join(t.TempDir(), "kiln-agent")

	var logs bytes.Buffer
	id, err := enroll.Enroll(context.Background(), enroll.Options{
		ControllerAddr: "https://" + addr, Token: token, CAHash: ca.Hash(), DataDir: dir,
		Facts: &typesv1.Facts{Hostname: "rack1-07"},
		Log:   slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	require.NoError(t, err)
	require.Contains(t, logs.String(), "enrolled")
	require.NotContains(t, logs.String(), "0123456789abcdef", "the token's secret was logged")
	require.Equal(t, "rack1-07", id.Host())
	require.Equal(t, []string{token}, e.received())

	st, err := os.Stat(filepath.Join(dir, identity.KeyFile))
	require.NoError(t, err)
	if st.Mode().Perm() != 0o600 {
		t.Errorf("%s mode = %v, want 0600", identity.KeyFile, st.Mode().Perm())
	}
	loaded, err := identity.Load(dir)
	require.NoError(t, err)
	if loaded.Host() != "rack1-07" || loaded.Controller.Address != addr || loaded.Controller.CAHash != ca.Hash() {
		t.Errorf("identity.Load() = %+v, want host rack1-07 at %s pinned to %s", loaded.Controller, addr, ca.Hash())
	}
	leftovers, _ := filepath.Glob(filepath.Join(dir, ".*"))
	require.Empty(t, leftovers, "temporary files left behind")

	_, err = enroll.Enroll(context.Background(), enroll.Options{ControllerAddr: addr, Token: token, CAHash: ca.Hash(), DataDir: dir})
	if !errdefs.IsAlreadyExists(err) {
		t.Errorf("Enroll() again into %s = %v, want AlreadyExists", dir, err)
	}
}

// TestWrongPinSendsNoToken: an impostor controller (another CA, or an
// agent certificate of the right CA) never receives the token.
func TestWrongPinSendsNoToken(t *testing.T) {
	ca := newCA(t)
	other := newCA(t)
	tests := []struct {
		name    string
		served  *pki.CA
		role    pki.Role
		pin     string
		wantMsg string
	}{
		{"other CA", other, pki.RoleController, ca.Hash(), "CA hash mismatch: controller presented " + other.Hash() + ", expected " + ca.Hash() + " (check --ca-hash)"},
		{"agent certificate of the pinned CA", ca, pki.RoleAgent, ca.Hash(), "has role agent, not controller"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := &enrollment{ca: tt.served}
			addr := serve(t, e, tt.served, tt.role)
			dir := t.TempDir()
			_, err := enroll.Enroll(context.Background(), enroll.Options{ControllerAddr: addr, Token: token, CAHash: tt.pin, DataDir: dir, Host: "h1"})
			require.Error(t, err)
			require.Contains(t, err.Error(), tt.wantMsg)
			if !errdefs.IsPermissionDenied(err) {
				t.Errorf("Enroll() = %v, want PermissionDenied", err)
			}
			require.NotContains(t, err.Error(), token, "the token leaked into an error")
			if got := e.received(); len(got) != 0 {
				t.Errorf("impostor received tokens %q, want none", got)
			}
			require.False(t, identity.Exists(dir), "no identity may be stored")
		})
	}
}

func TestControllerRefuses(t *testing.T) {
	ca := newCA(t)
	tests := []struct {
		name  string
		err   error
		is    func(error) bool
		match string
	}{
		{"used", errdefs.PermissionDenied("enrollment token abcdef was already used: create a new one"), errdefs.IsPermissionDenied, "refused the enrollment: enrollment token abcdef was already used"},
		{"expired", errdefs.PermissionDenied("enrollment token abcdef expired at 2026-01-01T00:00:00Z: create a new one"), errdefs.IsPermissionDenied, "expired at"},
		{"malformed", errdefs.InvalidArgument("enrollment token: malformed"), errdefs.IsInvalidArgument, "rejected the request"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			addr := serve(t, &enrollment{ca: ca, refuse: tt.err}, ca, pki.RoleController)
			dir := t.TempDir()
			_, err := enroll.Enroll(context.Background(), enroll.Options{ControllerAddr: addr, Token: token, CAHash: ca.Hash(), DataDir: dir, Host: "h1"})
			if !tt.is(err) {
				t.Errorf("Enroll() = %v, wrong class", err)
			}
			require.ErrorContains(t, err, tt.match)
			require.False(t, identity.Exists(dir))
		})
	}
}

func TestOptions(t *testing.T) {
	tests := []struct {
		name string
		o    enroll.Options
	}{
		{"no controller", enroll.Options{Token: token, CAHash: "sha256:" + string(make([]byte, 0)), DataDir: "/tmp/x"}},
		{"no token", enroll.Options{ControllerAddr: "127.0.0.1:1", CAHash: "sha256:00", DataDir: "/tmp/x"}},
		{"bad hash", enroll.Options{ControllerAddr: "127.0.0.1:1", Token: token, CAHash: "md5:abc", DataDir: "/tmp/x"}},
		{"short hash", enroll.Options{ControllerAddr: "127.0.0.1:1", Token: token, CAHash: "sha256:abc", DataDir: "/tmp/x"}},
	}
	for _, tt := range tests {
		_, err := enroll.Enroll(context.Background(), tt.o)
		if !errdefs.IsInvalidArgument(err) {
			t.Errorf("Enroll(%s) = %v, want InvalidArgument", tt.name, err)
		}
	}
}

func TestUnreachable(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := lis.Addr().String()
	lis.Close() // nothing listens there now
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = enroll.Enroll(ctx, enroll.Options{ControllerAddr: addr, Token: token, CAHash: newCA(t).Hash(), DataDir: t.TempDir()})
	if !errdefs.IsUnavailable(err) {
		t.Errorf("Enroll(%q) = %v, want Unavailable", addr, err)
	}
}

func TestFromCmdline(t *testing.T) {
	cmdline := "console=ttyS0 kiln.boot=pxe kiln.controller=https://10.0.0.1:7443 kiln.token=abcdef.0123456789abcdef kiln.ca_hash=sha256:00ff kiln.host=rack1-07 quiet"
	got := enroll.FromCmdline(enroll.Options{Host: "flag-host"}, cmdline)
	want := enroll.Options{ControllerAddr: "https://10.0.0.1:7443", Token: token, CAHash: "sha256:00ff", Host: "flag-host"}
	if got.ControllerAddr != want.ControllerAddr || got.Token != want.Token || got.CAHash != want.CAHash || got.Host != want.Host {
		t.Errorf("FromCmdline(%q) = %+v, want %+v", cmdline, got, want)
	}
	if got := enroll.Address("https://10.0.0.1:7443/"); got != "10.0.0.1:7443" {
		t.Errorf("Address(%q) = %q, want %q", "https://10.0.0.1:7443/", got, "10.0.0.1:7443")
	}
}

// TestRetryAsksWithTheSameKey: an enrollment whose answer is lost is
// retried with the same key (kept in the data directory until the
// identity is stored), which the controller recognises as the token's
// user.
func TestRetryAsksWithTheSameKey(t *testing.T) {
	dir := t.TempDir()
	k1, csr1, err := enroll.PendingKeyForTest(dir, "h1")
	require.NoError(t, err)
	k2, csr2, err := enroll.PendingKeyForTest(dir, "h1")
	require.NoError(t, err)
	if !bytes.Equal(k1, k2) {
		t.Fatalf("second attempt made a new key; want the pending one")
	}
	c1, err := x509.ParseCertificateRequest(csr1)
	require.NoError(t, err)
	c2, err := x509.ParseCertificateRequest(csr2)
	require.NoError(t, err)
	if !bytes.Equal(c1.RawSubjectPublicKeyInfo, c2.RawSubjectPublicKeyInfo) {
		t.Errorf("the two CSRs carry different keys")
	}
	st, err := os.Stat(filepath.Join(dir, enroll.PendingKeyFile))
	require.NoError(t, err)
	if st.Mode().Perm() != 0o600 {
		t.Errorf("pending key mode = %v, want 0600", st.Mode().Perm())
	}
}
