package provision

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/kilnhq/kiln/controller/agentclient"
	"github.com/kilnhq/kiln/internal/pki"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// AgentPool is the production AgentDialer: it dials each host's agent at
// the address of its last heartbeat with the controller's client
// certificate, checks that the agent's certificate names the host, and
// keeps one connection per host until the agent changes: its address, its
// mode or its certificate. A host that rebooted from its boot agent into
// the installed agent keeps its address (DHCP), and the connection to the
// boot agent, dead with the reboot, failed the first call to the
// installed one ("connection reset by peer": TestVMEndToEnd's first
// Prepare).
type AgentPool struct {
	roots func() *x509.CertPool
	cert  func() tls.Certificate

	mu    sync.Mutex
	conns map[string]pooled
}

type pooled struct {
	// agent is the address, mode and certificate serial dialled.
	agent  string
	client agentv1.AgentClient
	conn   *grpc.ClientConn
}

// NewAgentPool returns a pool trusting roots() (the controller's CAs) and
// presenting cert() (controller.Certificate), both asked at each
// handshake: they change when the CA is rotated.
func NewAgentPool(roots func() *x509.CertPool, cert func() tls.Certificate) *AgentPool {
	return &AgentPool{roots: roots, cert: cert, conns: map[string]pooled{}}
}

// Dial is an AgentDialer.
func (p *AgentPool) Dial(_ context.Context, h *typesv1.Host) (agentv1.AgentClient, error) {
	name := h.GetMetadata().GetName()
	a := h.GetStatus().GetAgent()
	addr := a.GetAddress()
	agent := addr + " " + a.GetMode() + " " + a.GetCertificateSerial()
	p.mu.Lock()
	defer p.mu.Unlock()
	if c, ok := p.conns[name]; ok {
		if c.agent == agent {
			return c.client, nil
		}
		c.conn.Close()
		delete(p.conns, name)
	}
	cl, conn, err := agentclient.DialFollowing(addr, name, p.roots, p.cert)
	if err != nil {
		return nil, err
	}
	p.conns[name] = pooled{agent: agent, client: cl, conn: conn}
	return cl, nil
}

// Close closes every connection.
func (p *AgentPool) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for name, c := range p.conns {
		c.conn.Close()
		delete(p.conns, name)
	}
}

// IdentityCA issues installed agents' identities (*pki.CA, or the
// controller's CA as it follows rotations).
type IdentityCA interface {
	Issue(role pki.Role, name string, hosts []string, ttl time.Duration, now time.Time) (certPEM, keyPEM []byte, err error)
	// Hash is the pin of the CA the controller serves with.
	Hash() string
	// CertPEM is every CA the agent is to trust.
	CertPEM() []byte
}

var _ IdentityCA = (*pki.CA)(nil)

// CAIdentity is the production IdentityFunc: a fresh key and an agent
// certificate for the host, valid for ttl, with the CA and the controller
// URL the installed agent reports to. The key travels to the boot agent
// over mutual TLS and is never logged.
func CAIdentity(ca IdentityCA, controllerURL string, ttl time.Duration, clock func() time.Time) IdentityFunc {
	if clock == nil {
		clock = time.Now
	}
	return func(_ context.Context, h *typesv1.Host) (*agentv1.WriteIdentityRequest, error) {
		name := h.GetMetadata().GetName()
		certPEM, keyPEM, err := ca.Issue(pki.RoleAgent, name, []string{name}, ttl, clock())
		if err != nil {
			return nil, err
		}
		return &agentv1.WriteIdentityRequest{
			Hostname:       name,
			ControllerUrl:  controllerURL,
			CaHash:         ca.Hash(),
			CaPem:          ca.CertPEM(),
			CertificatePem: certPEM,
			KeyPem:         keyPEM,
		}, nil
	}
}
