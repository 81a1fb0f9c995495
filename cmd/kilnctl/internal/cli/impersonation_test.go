package cli

import (
	"context"
	"crypto/tls"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/internal/kilnconfig"
	"github.com/kilnhq/kiln/internal/pki"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// fakeController is a gRPC server that presents a certificate of the
// controller's CA and records every call it receives, whatever the method.
type fakeController struct {
	addr string
	mu   sync.Mutex
	hits []string
}

func startFakeController(t *testing.T, cert tls.Certificate) *fakeController {
	t.Helper()
	f := &fakeController{}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	f.addr = lis.Addr().String()
	srv := grpc.NewServer(
		grpc.Creds(credentials.NewTLS(&tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert}, ClientAuth: tls.RequestClientCert})),
		grpc.UnknownServiceHandler(func(_ any, stream grpc.ServerStream) error {
			method, _ := grpc.MethodFromServerStream(stream)
			// Empty keeps the request's fields as unknown fields: the
			// raw request, password included.
			var req emptypb.Empty
			_ = stream.RecvMsg(&req)
			raw, _ := proto.Marshal(&req)
			f.mu.Lock()
			f.hits = append(f.hits, method+" "+string(raw))
			f.mu.Unlock()
			return nil
		}),
	)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return f
}

func (f *fakeController) received() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.hits...)
}

// TestApplyRefusesAnAgentPosingAsTheController is the attack of issue 12,
// hole 2: a server presenting an agent's certificate (issued by the
// controller's CA, with 127.0.0.1 among its names) waits on loopback, and
// an operator's kilnctl is pointed at it to apply a host with a BMC
// password. kilnctl must refuse the server in the TLS handshake and send
// nothing.
func TestApplyRefusesAnAgentPosingAsTheController(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	ctx := context.Background()
	env := controllertest.Start(t)

	// An agent enrolls through the real path, reporting 127.0.0.1 as one
	// of its addresses.
	keyPEM, csr, err := pki.NewKeyAndCSR("rogue")
	require.NoError(t, err)
	resp, err := controllerv1.NewEnrollmentClient(env.DialAnonymous(t)).Enroll(ctx, &controllerv1.EnrollRequest{
		Token:  env.Token(t, "rogue", time.Hour),
		CsrDer: csr,
		Host:   "rogue",
		Facts: &typesv1.Facts{Hostname: "rogue", AgentMode: "boot", BootSource: "pxe", Nics: []*typesv1.NIC{
			{Name: "lo", Addresses: []string{"127.0.0.1/8", "::1/128"}},
			{Name: "eth0", Addresses: []string{"10.0.0.7/24"}},
		}},
	})
	require.NoError(t, err)
	enrolled, err := tls.X509KeyPair(resp.GetCertificatePem(), keyPEM)
	require.NoError(t, err)
	// The controller signs no address the agent reported about itself.
	if ips, dns := enrolled.Leaf.IPAddresses, enrolled.Leaf.DNSNames; len(ips) != 0 || len(dns) != 0 {
		t.Errorf("enrolled agent certificate names IPs %v and DNS names %v, want none (self-reported)", ips, dns)
	}

	// An agent certificate from before the fix, still valid: 127.0.0.1 is
	// among its names, so the address check alone would accept it.
	oldCert, oldKey, err := env.Controller.CA().Issue(pki.RoleAgent, "rogue", []string{"rogue", "127.0.0.1"}, time.Hour, time.Now())
	require.NoError(t, err)
	withSAN, err := tls.X509KeyPair(oldCert, oldKey)
	require.NoError(t, err)

	admin, err := kilnconfig.Load(env.AdminConfigPath)
	require.NoError(t, err)
	hostFile := filepath.Join(t.TempDir(), "host.yaml")
	require.NoError(t, os.WriteFile(hostFile, []byte(`apiVersion: kiln.dev/v1
kind: Host
metadata:
  name: rack9-01
spec:
  bmc:
    protocol: redfish
    address: redfish+http://127.0.0.1:8001
    username: admin
    password: bmc-secret-do-not-send
  bootMac: "52:54:00:00:09:01"
`), 0o600))

	// The controller's own kind of certificate, as a control: the fake
	// and the client are sound, so the refusals below are the checks'.
	ctrlCert, ctrlKey, err := env.Controller.CA().Issue(pki.RoleController, pki.ControllerName, []string{"127.0.0.1"}, time.Hour, time.Now())
	require.NoError(t, err)
	ctrl, err := tls.X509KeyPair(ctrlCert, ctrlKey)
	require.NoError(t, err)

	for _, tc := range []struct {
		name    string
		cert    tls.Certificate
		wantErr string // "" for the control, which must be reached
	}{
		{"controller certificate (control)", ctrl, ""},
		{"enrolled agent certificate", enrolled, "authentication handshake failed"},
		{"agent certificate with a 127.0.0.1 SAN", withSAN, "has role agent, not controller"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fake := startFakeController(t, tc.cert)
			cfg := *admin
			cfg.Server = fake.addr
			cfgPath := filepath.Join(t.TempDir(), "kilnconfig.yaml")
			require.NoError(t, kilnconfig.Write(cfgPath, &cfg))

			out, err := kilnctl(t, cfgPath, "apply", "--request-timeout", "10s", "-f", hostFile)
			t.Logf("kilnctl apply against the fake: out=%q err=%v", out, err)
			hits := fake.received()
			if tc.wantErr == "" {
				if len(hits) != 1 || !strings.Contains(hits[0], "bmc-secret-do-not-send") {
					t.Fatalf("the fake with a controller certificate received %q, want the Apply with the password: the test cannot see an attack", hits)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("kilnctl apply against a server with an agent certificate = %v, want an error containing %q", err, tc.wantErr)
			}
			if len(hits) != 0 {
				t.Errorf("the fake controller received %d calls, want none: %q", len(hits), hits)
			}
		})
	}
}
