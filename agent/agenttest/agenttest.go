// Package agenttest starts real agent API servers on loopback for tests:
// a throw-away CA, an enrolled agent identity issued by it, and client TLS
// configurations of any role.
package agenttest

import (
	"context"
	"crypto/tls"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/kilnhq/kiln/agent/identity"
	"github.com/kilnhq/kiln/agent/journal"
	"github.com/kilnhq/kiln/agent/server"
	"github.com/kilnhq/kiln/internal/pki"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// NewCA returns a fresh CA.
func NewCA(t testing.TB) *pki.CA {
	t.Helper()
	ca, err := pki.NewCA("kiln-test-ca", time.Now())
	require.NoError(t, err)
	return ca
}

// Enroll issues an agent certificate for host from ca, the way the
// controller does (the agent's own key and CSR), and saves it under dir.
func Enroll(t testing.TB, ca *pki.CA, dir, host, controllerAddr string) *identity.Identity {
	t.Helper()
	keyPEM, csr, err := pki.NewKeyAndCSR(host)
	require.NoError(t, err)
	certPEM, err := ca.SignCSR(csr, pki.RoleAgent, host, time.Hour, time.Now(), pki.WithHosts("127.0.0.1", "localhost"))
	require.NoError(t, err)
	id, err := identity.Save(dir, identity.Files{
		KeyPEM: keyPEM, CertPEM: certPEM, CAPEM: ca.CertPEM(),
		Controller: identity.Controller{Address: controllerAddr, CAHash: ca.Hash(), Host: host},
	})
	require.NoError(t, err)
	return id
}

// ClientTLS returns a client configuration trusting ca and presenting a
// certificate of role for name, issued by issuer (ca itself, or another CA
// to test foreign certificates). A nil issuer presents no certificate.
func ClientTLS(t testing.TB, ca, issuer *pki.CA, role pki.Role, name string) *tls.Config {
	t.Helper()
	c := &tls.Config{RootCAs: ca.Pool(), ServerName: "127.0.0.1", MinVersion: tls.VersionTLS13}
	if issuer != nil {
		certPEM, keyPEM, err := issuer.Issue(role, name, nil, time.Hour, time.Now())
		require.NoError(t, err)
		cert, err := tls.X509KeyPair(certPEM, keyPEM)
		require.NoError(t, err)
		c.Certificates = []tls.Certificate{cert}
	}
	return c
}

// Agent is a running agent API.
type Agent struct {
	Addr     string
	CA       *pki.CA
	Identity *identity.Identity
	Journal  *journal.Journal
}

// Start serves the agent API on a loopback port with o (Journal is created
// in a temporary directory when nil) until the test ends.
func Start(t testing.TB, o server.Options) *Agent {
	t.Helper()
	ca := NewCA(t)
	id := Enroll(t, ca, t.TempDir(), "host-a", "127.0.0.1:1")
	if o.Journal == nil {
		j, err := journal.Open(t.TempDir(), nil)
		require.NoError(t, err)
		t.Cleanup(func() { j.Close() })
		o.Journal = j
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := server.NewGRPCServer(id.ServerTLS(), server.New(o))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = server.Serve(ctx, s, lis)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return &Agent{Addr: lis.Addr().String(), CA: ca, Identity: id, Journal: o.Journal}
}

// Client dials the agent with conf and returns an Agent client; the
// connection closes when the test ends.
func (a *Agent) Client(t testing.TB, conf *tls.Config) agentv1.AgentClient {
	t.Helper()
	conn, err := grpc.NewClient(a.Addr, grpc.WithTransportCredentials(credentials.NewTLS(conf)))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return agentv1.NewAgentClient(conn)
}

// Controller returns a client with a controller certificate of a's CA.
func (a *Agent) Controller(t testing.TB) agentv1.AgentClient {
	return a.Client(t, ClientTLS(t, a.CA, a.CA, pki.RoleController, pki.ControllerName))
}
