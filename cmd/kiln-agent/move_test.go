package main

import (
	"crypto/tls"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kilnhq/kiln/agent/identity"
	"github.com/kilnhq/kiln/internal/pki"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// tlsController serves TLS on loopback with a certificate of role, issued
// by ca, and accepts (and drops) every connection.
func tlsController(t *testing.T, ca *pki.CA, role pki.Role) string {
	t.Helper()
	certPEM, keyPEM, err := ca.Issue(role, "ctl", []string{"127.0.0.1"}, time.Hour, time.Now())
	require.NoError(t, err)
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	require.NoError(t, err)
	lis, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert}, ClientAuth: tls.RequestClientCert})
	require.NoError(t, err)
	t.Cleanup(func() { lis.Close() })
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			go func() {
				_ = c.(*tls.Conn).Handshake()
				c.Close()
			}()
		}
	}()
	return lis.Addr().String()
}

// TestFollowMove: an agent follows a heartbeat answer's moved_to only to
// a controller that holds a certificate of a CA it trusts, with the
// controller role; then it stores the new address (a restart keeps it)
// and dials there. A rogue address (another CA, an agent's certificate,
// nothing listening, not host:port) changes nothing.
func TestFollowMove(t *testing.T) {
	ca, err := pki.NewCA("kiln", time.Now())
	require.NoError(t, err)
	rogueCA, err := pki.NewCA("kiln", time.Now())
	require.NoError(t, err)
	key, csr, err := pki.NewKeyAndCSR("h1")
	require.NoError(t, err)
	cert, err := ca.SignCSR(csr, pki.RoleAgent, "h1", time.Hour, time.Now())
	require.NoError(t, err)
	dir := t.TempDir()
	const old = "127.0.0.1:1"
	id, err := identity.Save(dir, identity.Files{KeyPEM: key, CertPEM: cert, CAPEM: ca.CertPEM(),
		Controller: identity.Controller{Address: old, CAHash: ca.Hash(), Host: "h1"}})
	require.NoError(t, err)

	dials := 0
	ctl, err := newControllerConn(func() (*grpc.ClientConn, error) {
		dials++
		return grpc.NewClient(id.Address(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	})
	require.NoError(t, err)
	defer ctl.Close()
	follow := followMove(id, dir, ctl, probeController(id), slog.New(slog.DiscardHandler))
	stored := func() string {
		l, err := identity.Load(dir)
		require.NoError(t, err)
		return l.Controller.Address
	}
	closed := func() string {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		addr := lis.Addr().String()
		lis.Close()
		return addr
	}()

	for name, to := range map[string]string{
		"a controller of another CA":           tlsController(t, rogueCA, pki.RoleController),
		"an agent certificate of the fleet CA": tlsController(t, ca, pki.RoleAgent),
		"nothing listening":                    closed,
		"not host:port":                        "controller.example",
	} {
		follow(&controllerv1.HeartbeatResponse{MovedTo: to}, nil)
		require.Equal(t, old, id.Address(), "moved_to %s (%s) followed", to, name)
		require.Equal(t, old, stored(), "moved_to %s (%s) stored", to, name)
	}
	require.Equal(t, 1, dials, "redialled for an address not followed")

	// An error answer, or none, changes nothing either.
	target := tlsController(t, ca, pki.RoleController)
	follow(&controllerv1.HeartbeatResponse{MovedTo: target}, os.ErrDeadlineExceeded)
	follow(&controllerv1.HeartbeatResponse{}, nil)
	require.Equal(t, old, id.Address())

	follow(&controllerv1.HeartbeatResponse{MovedTo: target}, nil)
	require.Equal(t, target, id.Address(), "the trusted target")
	require.Equal(t, target, stored(), "the trusted target, as a restart loads it")
	require.Equal(t, 2, dials, "redialled to the target")
	b, err := os.ReadFile(filepath.Join(dir, identity.ControllerFile))
	require.NoError(t, err)
	require.Contains(t, string(b), ca.Hash(), "the CA pin is kept")
	// The same answer again: nothing to do.
	follow(&controllerv1.HeartbeatResponse{MovedTo: target}, nil)
	require.Equal(t, 2, dials)
}
