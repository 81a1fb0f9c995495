package trust

import (
	"crypto/tls"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/kilnhq/kiln/internal/pki"
)

// serverCertTTL is the validity of the controller's own certificate.
const serverCertTTL = 365 * 24 * time.Hour

// OwnCert holds the controller's own certificate and re-issues it when a
// third of its lifetime is left, so a long-running controller never serves
// an expired one.
type OwnCert struct {
	ca    *Rotating
	names []string
	clock func() time.Time
	log   *slog.Logger

	mu   sync.Mutex
	cert tls.Certificate
}

// Get returns the current certificate, renewing it first when due.
func (o *OwnCert) Get() (tls.Certificate, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	now := o.clock()
	// Issued by the serving CA: the old one during a CA rotation, which
	// every client still trusts, the new one once the old is retired.
	serving := o.ca.Set().Serving()
	if o.cert.Leaf != nil && now.Before(o.cert.Leaf.NotAfter.Add(-serverCertTTL/3)) && pki.IssuerKeyID(o.cert.Leaf) == serving.KeyID() {
		return o.cert, nil
	}
	certPEM, keyPEM, err := serving.Issue(pki.RoleController, pki.ControllerName, o.names, serverCertTTL, now)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("controller certificate: %w", err)
	}
	// Serve the CA in the chain: an enrolling agent has no roots yet and
	// finds the CA it pinned by hash there (pki.VerifyPinned).
	pair, err := tls.X509KeyPair(append(certPEM, serving.CertPEM()...), keyPEM)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("controller certificate: %w", err)
	}
	if o.cert.Leaf != nil {
		o.log.Info("controller certificate renewed", "not_after", pair.Leaf.NotAfter, "issuer", serving.KeyID())
	}
	o.cert = pair
	return pair, nil
}

// NewOwnCert returns the controller's own certificate for names (DNS
// names and IPs), issued by ca's serving CA on first Get.
func NewOwnCert(ca *Rotating, names []string, clock func() time.Time, log *slog.Logger) *OwnCert {
	return &OwnCert{ca: ca, names: names, clock: clock, log: log}
}

// ServerTLS is the API's server TLS configuration: TLS 1.3, this
// certificate (renewed when due), client certificates verified against
// the trusted CAs when presented (Enrollment is called without). Each
// connection trusts the CAs of the moment (a rotation changes them).
func (o *OwnCert) ServerTLS() *tls.Config {
	cfg := func() *tls.Config {
		return &tls.Config{
			MinVersion: tls.VersionTLS13,
			GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
				cert, err := o.Get()
				return &cert, err
			},
			ClientAuth: tls.VerifyClientCertIfGiven,
			ClientCAs:  o.ca.Pool(),
		}
	}
	tc := cfg()
	tc.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) { return cfg(), nil }
	return tc
}
