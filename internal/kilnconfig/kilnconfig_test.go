package kilnconfig

import (
	"context"
	"crypto/tls"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
)

func TestResolve(t *testing.T) {
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	tests := []struct {
		flag string
		env  map[string]string
		want string
	}{
		{"/etc/kiln/a.yaml", map[string]string{"KILNCONFIG": "/b.yaml", "HOME": "/root"}, "/etc/kiln/a.yaml"},
		{"", map[string]string{"KILNCONFIG": "/b.yaml", "HOME": "/root"}, "/b.yaml"},
		{"", map[string]string{"HOME": "/home/op"}, "/home/op/.kiln/config"},
	}
	for _, tt := range tests {
		if got := Resolve(tt.flag, env(tt.env)); got != tt.want {
			t.Errorf("Resolve(%q, %v) = %q, want %q", tt.flag, tt.env, got, tt.want)
		}
	}
}

func TestLoadErrors(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(body), 0o600))
		return p
	}
	tests := []struct {
		name  string
		path  string
		class func(error) bool
		want  string
	}{
		{"missing", filepath.Join(dir, "nope.yaml"), errdefs.IsNotFound,
			"no kilnctl config at " + dir + "/nope.yaml: pass --kilnconfig or set KILNCONFIG; the controller writes DATA_DIR/kilnconfig-admin.yaml"},
		{"empty keys", write("empty.yaml", "server: 127.0.0.1:1\n"), errdefs.IsInvalidArgument, "lacks ca, cert, key"},
		{"unknown key", write("unknown.yaml", "server: a:1\nca: x\ncert: x\nkey: x\ntoken: y\n"), errdefs.IsInvalidArgument, `unknown field "token"`},
		{"not yaml", write("bad.yaml", "server: [\n"), errdefs.IsInvalidArgument, "is not a kilnconfig file"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Load(tt.path)
			if err == nil || !tt.class(err) || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Load(%q) = %v, want %q", tt.path, err, tt.want)
			}
		})
	}
}

// testPKI issues a CA, a server certificate for 127.0.0.1 and an operator
// certificate.
type testPKI struct {
	ca                 *pki.CA
	serverCert, srvKey []byte
	userCert, userKey  []byte
}

func newTestPKI(t *testing.T) testPKI {
	t.Helper()
	now := time.Now()
	ca, err := pki.NewCA("kiln test CA", now)
	require.NoError(t, err)
	sc, sk, err := ca.Issue(pki.RoleController, pki.ControllerName, []string{"127.0.0.1"}, time.Hour, now)
	require.NoError(t, err)
	uc, uk, err := ca.Issue(pki.RoleReader, "alice", nil, time.Hour, now)
	require.NoError(t, err)
	return testPKI{ca: ca, serverCert: sc, srvKey: sk, userCert: uc, userKey: uk}
}

// serve runs a gRPC server that requires a client certificate from ca and
// serves the health service.
func serve(t *testing.T, p testPKI) string {
	t.Helper()
	pair, err := tls.X509KeyPair(p.serverCert, p.srvKey)
	require.NoError(t, err)
	tc := &tls.Config{Certificates: []tls.Certificate{pair}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: p.ca.Pool(), MinVersion: tls.VersionTLS13}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(tc)))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

func TestDialMutualTLS(t *testing.T) {
	p := newTestPKI(t)
	addr := serve(t, p)
	dir := t.TempDir()

	path := filepath.Join(dir, "kilnconfig-reader.yaml")
	require.NoError(t, Write(path, &Config{
		Server: addr, CA: string(p.ca.CertPEM()), Cert: string(p.userCert), Key: string(p.userKey),
	}))
	cfg, err := Load(path)
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := Dial(ctx, cfg)
	require.NoError(t, err)
	defer conn.Close()
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("Check() over mTLS = %v, %v, want SERVING", resp, err)
	}

	// A config whose CA is another CA does not trust the server.
	other := newTestPKI(t)
	bad := *cfg
	bad.CA = string(other.ca.CertPEM())
	conn2, err := Dial(ctx, &bad)
	require.NoError(t, err)
	defer conn2.Close()
	if _, err := healthpb.NewHealthClient(conn2).Check(ctx, &healthpb.HealthCheckRequest{}); err == nil {
		t.Errorf("Check() with a foreign CA = nil error, want a certificate error")
	}

	// A client certificate from another CA is refused by the server.
	bad = *cfg
	bad.Cert, bad.Key = string(other.userCert), string(other.userKey)
	conn3, err := Dial(ctx, &bad)
	require.NoError(t, err)
	defer conn3.Close()
	if _, err := healthpb.NewHealthClient(conn3).Check(ctx, &healthpb.HealthCheckRequest{}); err == nil {
		t.Errorf("Check() with a foreign client certificate = nil error, want refusal")
	}
}

func TestTLSErrorsHideKey(t *testing.T) {
	p := newTestPKI(t)
	c := &Config{Path: "x.yaml", Server: "127.0.0.1:1", CA: string(p.ca.CertPEM()), Cert: string(p.userCert), Key: "-----BEGIN EC PRIVATE KEY-----\nc2VjcmV0LWtleS1ieXRlcw==\n-----END EC PRIVATE KEY-----\n"}
	_, err := c.TLS()
	require.Error(t, err)
	if !errdefs.IsInvalidArgument(err) || strings.Contains(err.Error(), "c2VjcmV0") {
		t.Errorf("TLS() = %v, want InvalidArgument without key material", err)
	}
}

func TestWriteLoad(t *testing.T) {
	p := newTestPKI(t)
	path := filepath.Join(t.TempDir(), "kc.yaml")
	want := &Config{Server: "127.0.0.1:7443", CA: string(p.ca.CertPEM()), Cert: string(p.userCert), Key: string(p.userKey)}
	require.NoError(t, Write(path, want))
	st, err := os.Stat(path)
	require.NoError(t, err)
	if st.Mode().Perm() != 0o600 {
		t.Errorf("Write() mode = %v, want 0600", st.Mode().Perm())
	}
	got, err := Load(path)
	require.NoError(t, err)
	want.Path = path
	if *got != *want {
		t.Errorf("Load(Write(c)) = %+v, want %+v", got, want)
	}
}
