// Package agentclient is how the controller (and the lab) dials an agent: mTLS
// with the controller's certificate, trusting only the Kiln CA, and
// checking that the agent at the address is the host it expects. An agent
// certificate names its host (CommonName) and carries the agent role, so an
// agent that took over another host's address is refused, whatever IP
// addresses its certificate lists.
package agentclient

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// TLSConfig returns a client configuration that presents cert (a
// controller certificate) and accepts only an agent certificate for host
// issued by a CA in roots.
func TLSConfig(roots *x509.CertPool, cert tls.Certificate, host string) *tls.Config {
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cert},
		// The name check is VerifyAgent's (the host, not the address).
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			return VerifyAgent(cs.PeerCertificates, roots, host)
		},
	}
}

// VerifyAgent checks that chain's leaf verifies against roots for server
// use, has the agent role and names host. It returns a PermissionDenied
// error saying which check failed.
func VerifyAgent(chain []*x509.Certificate, roots *x509.CertPool, host string) error {
	if len(chain) == 0 {
		return errdefs.PermissionDenied("agent presented no certificate")
	}
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	if _, err := chain[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
		return errdefs.PermissionDenied("agent certificate %q: %v", chain[0].Subject.CommonName, err)
	}
	role, name, err := pki.Identity(chain[0])
	if err != nil {
		return errdefs.PermissionDenied("agent certificate: %v", err)
	}
	if role != pki.RoleAgent {
		return errdefs.PermissionDenied("peer %q has role %s, not agent", name, role)
	}
	if name != host {
		return errdefs.PermissionDenied("the agent at this address is host %q, not %q", name, host)
	}
	return nil
}

// Dial returns a client of the agent of host at addr (host:port). The
// connection is made lazily, on the first call; close it when done.
func Dial(addr, host string, roots *x509.CertPool, cert tls.Certificate, opts ...grpc.DialOption) (agentv1.AgentClient, *grpc.ClientConn, error) {
	return DialFollowing(addr, host, func() *x509.CertPool { return roots }, func() tls.Certificate { return cert }, opts...)
}

// DialFollowing is Dial with the CAs and the certificate asked for at
// every handshake, so that a connection that reconnects after a CA
// rotation (kiln-controller rotate-ca) uses the ones in force then.
func DialFollowing(addr, host string, roots func() *x509.CertPool, cert func() tls.Certificate, opts ...grpc.DialOption) (agentv1.AgentClient, *grpc.ClientConn, error) {
	if addr == "" {
		return nil, nil, errdefs.FailedPrecondition("host %q has no agent address (no heartbeat yet?)", host)
	}
	tc := &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			c := cert()
			return &c, nil
		},
		InsecureSkipVerify: true, // VerifyAgent checks the chain and the host
		VerifyConnection: func(cs tls.ConnectionState) error {
			return VerifyAgent(cs.PeerCertificates, roots(), host)
		},
	}
	opts = append([]grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(tc))}, opts...)
	conn, err := grpc.NewClient(addr, opts...)
	if err != nil {
		return nil, nil, fmt.Errorf("agent of host %q at %s: %w", host, addr, err)
	}
	return agentv1.NewAgentClient(conn), conn, nil
}
