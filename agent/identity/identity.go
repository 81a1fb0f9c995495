// Package identity keeps an enrolled agent's identity on disk: its private
// key, the certificate the controller issued for its host, the controller's
// CA and where the controller is. It builds the TLS configurations the agent
// serves and dials with.
//
// Layout under the data directory:
//
//	agent.key        the agent's private key (0600)
//	agent.crt        its certificate, role agent, CommonName = host
//	ca.crt           the controller CAs the agent trusts: the one pinned by
//	                 hash at enrollment, and during a CA rotation
//	                 (kiln-controller rotate-ca) the old and the new CA
//	controller.json  {"address": ..., "caHash": ..., "host": ...}; caHash
//	                 is the hash of one CA in ca.crt
//
// Every file is written atomically (temporary file, fsync, rename).
package identity

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kilnhq/kiln/internal/atomicfile"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
)

// File names under the data directory.
const (
	KeyFile        = "agent.key"
	CertFile       = "agent.crt"
	CAFile         = "ca.crt"
	ControllerFile = "controller.json"
)

// Controller is where the agent's controller is and how it is trusted.
type Controller struct {
	Address string `json:"address"`
	CAHash  string `json:"caHash"`
	Host    string `json:"host"`
}

// Files is an identity as it is stored.
type Files struct {
	KeyPEM, CertPEM, CAPEM []byte
	Controller             Controller
}

// Identity is a loaded identity. Its certificate and the CAs it trusts
// can be replaced while servers and clients use it (renewal, CA
// rotation).
type Identity struct {
	// Controller is as stored; once the agent runs, read its address with
	// Address (SetAddress changes it while heartbeats and renewals dial).
	Controller Controller
	addrMu     sync.RWMutex
	cert       atomic.Pointer[tls.Certificate]
	trust      atomic.Pointer[trust]
}

// trust is a set of CA certificates.
type trust struct {
	certs []*x509.Certificate
	pool  *x509.CertPool
	pem   []byte
}

// parseTrust parses a bundle of CA certificates. It returns
// InvalidArgument when one does not parse or is not a CA.
func parseTrust(bundle []byte) (*trust, error) {
	certs, err := pki.ParseCertificatesPEM(bundle)
	if err != nil {
		return nil, errdefs.InvalidArgument("identity: CA: %v", err)
	}
	t := &trust{pool: x509.NewCertPool()}
	for _, c := range certs {
		if !c.IsCA {
			return nil, errdefs.InvalidArgument("identity: CA certificate %q is not a CA", c.Subject.CommonName)
		}
		t.certs = append(t.certs, c)
		t.pool.AddCert(c)
		t.pem = append(t.pem, pemCert(c)...)
	}
	return t, nil
}

// has reports whether a CA of hash (pki.Hash) is in t.
func (t *trust) has(hash string) bool {
	for _, c := range t.certs {
		if pki.Hash(c) == hash {
			return true
		}
	}
	return false
}

// CAs returns the CA certificates the identity trusts.
func (id *Identity) CAs() []*x509.Certificate {
	return append([]*x509.Certificate(nil), id.trust.Load().certs...)
}

// Save validates f (key matches certificate, certificate is an agent
// certificate for f.Controller.Host issued by the CA) and writes it under
// dir, creating dir (0700) when missing. The controller file is written
// last, so an identity is complete once it exists. Errors: InvalidArgument
// for an inconsistent identity, I/O errors.
func Save(dir string, f Files) (*Identity, error) {
	id, err := parse(f)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("identity: %w", err)
	}
	ctl, err := json.MarshalIndent(f.Controller, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("identity: %w", err)
	}
	for _, w := range []struct {
		name string
		data []byte
		mode os.FileMode
	}{
		{KeyFile, f.KeyPEM, 0o600},
		{CertFile, f.CertPEM, 0o644},
		{CAFile, f.CAPEM, 0o644},
		{ControllerFile, append(ctl, '\n'), 0o644},
	} {
		if err := atomicfile.Write(filepath.Join(dir, w.name), w.data, w.mode); err != nil {
			return nil, fmt.Errorf("identity: %w", err)
		}
	}
	return id, nil
}

// Exists reports whether dir holds a (complete) identity.
func Exists(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, ControllerFile))
	return err == nil
}

// Load reads the identity under dir, finishing a rotation that a crash
// interrupted. Errors: NotFound when the agent is not enrolled,
// InvalidArgument when the files are inconsistent, I/O errors.
func Load(dir string) (*Identity, error) {
	if err := finishRotation(dir); err != nil {
		return nil, err
	}
	var f Files
	b, err := os.ReadFile(filepath.Join(dir, ControllerFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, errdefs.NotFound("agent is not enrolled: no %s in %s (run kiln-agent enroll)", ControllerFile, dir)
	}
	if err != nil {
		return nil, fmt.Errorf("identity: %w", err)
	}
	if err := json.Unmarshal(b, &f.Controller); err != nil {
		return nil, errdefs.InvalidArgument("identity: %s: %v", filepath.Join(dir, ControllerFile), err)
	}
	for _, r := range []struct {
		name string
		dst  *[]byte
	}{{KeyFile, &f.KeyPEM}, {CertFile, &f.CertPEM}, {CAFile, &f.CAPEM}} {
		data, err := os.ReadFile(filepath.Join(dir, r.name))
		if err != nil {
			return nil, fmt.Errorf("identity: %w", err)
		}
		*r.dst = data
	}
	return parse(f)
}

func parse(f Files) (*Identity, error) {
	tr, err := parseTrust(f.CAPEM)
	if err != nil {
		return nil, err
	}
	if f.Controller.CAHash != "" && !tr.has(f.Controller.CAHash) {
		return nil, errdefs.InvalidArgument("identity: no CA in the bundle matches the pinned %s", f.Controller.CAHash)
	}
	cert, err := tls.X509KeyPair(f.CertPEM, f.KeyPEM)
	if err != nil {
		return nil, errdefs.InvalidArgument("identity: certificate and key: %v", err)
	}
	leaf := cert.Leaf
	if err := verifyLeaf(leaf, tr); err != nil {
		return nil, err
	}
	role, name, err := pki.Identity(leaf)
	if err != nil {
		return nil, errdefs.InvalidArgument("identity: %v", err)
	}
	if role != pki.RoleAgent {
		return nil, errdefs.InvalidArgument("identity: certificate %q has role %s, want agent", name, role)
	}
	if f.Controller.Host != "" && name != f.Controller.Host {
		return nil, errdefs.InvalidArgument("identity: certificate names host %q, want %q", name, f.Controller.Host)
	}
	id := &Identity{Controller: f.Controller}
	id.Controller.Host = name
	id.cert.Store(&cert)
	id.trust.Store(tr)
	return id, nil
}

// verifyLeaf checks that leaf is issued by a CA of t. Expiry is not
// checked: an expired identity still loads, so that kiln-agent run can say
// it expired rather than that it is broken.
func verifyLeaf(leaf *x509.Certificate, t *trust) error {
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: t.pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}, CurrentTime: leaf.NotBefore}); err != nil {
		return errdefs.InvalidArgument("identity: certificate %q is not issued by the controller CA: %v", leaf.Subject.CommonName, err)
	}
	return nil
}

// SetTrust replaces the CAs the identity trusts with bundle (PEM), as the
// controller sends them during a CA rotation, and stores them under dir.
// It reports whether anything changed. It refuses (InvalidArgument,
// nothing changed) a bundle that does not hold the CA of the agent's own
// certificate (renew first) or that shares no CA with the current one:
// a rotation always overlaps.
//
// controller.json is written first, naming a CA in both the old and the
// new bundle, then ca.crt: a crash between the two leaves a pair that
// loads.
func (id *Identity) SetTrust(dir string, bundle []byte) (bool, error) {
	next, err := parseTrust(bundle)
	if err != nil {
		return false, fmt.Errorf("set trust: %w", err)
	}
	cur := id.trust.Load()
	if string(next.pem) == string(cur.pem) {
		return false, nil
	}
	if err := verifyLeaf(id.cert.Load().Leaf, next); err != nil {
		return false, fmt.Errorf("set trust: the new CAs do not hold this agent's issuer (renew first): %w", err)
	}
	pin := ""
	for _, c := range next.certs {
		if cur.has(pki.Hash(c)) {
			pin = pki.Hash(c)
			break
		}
	}
	if pin == "" {
		return false, errdefs.InvalidArgument("set trust: the new CAs share none with the ones trusted now")
	}
	id.addrMu.Lock() // the controller file holds the address too
	defer id.addrMu.Unlock()
	ctl := id.Controller
	ctl.CAHash = pin
	if err := writeController(dir, ctl); err != nil {
		return false, fmt.Errorf("set trust: %w", err)
	}
	if err := atomicfile.Write(filepath.Join(dir, CAFile), next.pem, 0o644); err != nil {
		return false, fmt.Errorf("set trust: %w", err)
	}
	id.Controller.CAHash = pin
	id.trust.Store(next)
	return true, nil
}

// SetAddress makes addr (host:port) the controller's address, stored
// under dir, when it differs from the current one, and reports whether
// it did. The caller checks first that a controller there holds a
// certificate of a CA this identity trusts (VerifyController): the
// address comes from a heartbeat answer after a move (kilnctl move).
func (id *Identity) SetAddress(dir, addr string) (bool, error) {
	if addr == "" {
		return false, errdefs.InvalidArgument("set address: empty")
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return false, errdefs.InvalidArgument("set address %q: want host:port: %v", addr, err)
	}
	id.addrMu.Lock()
	defer id.addrMu.Unlock()
	if addr == id.Controller.Address {
		return false, nil
	}
	ctl := id.Controller
	ctl.Address = addr
	if err := writeController(dir, ctl); err != nil {
		return false, fmt.Errorf("set address: %w", err)
	}
	id.Controller.Address = addr
	return true, nil
}

// writeController stores ctl as the controller file under dir, replacing
// it atomically.
func writeController(dir string, ctl Controller) error {
	b, err := json.MarshalIndent(ctl, "", "  ")
	if err != nil {
		return err
	}
	return atomicfile.Write(filepath.Join(dir, ControllerFile), append(b, '\n'), 0o644)
}

// Address is the controller's address (host:port), as SetAddress last
// set it.
func (id *Identity) Address() string {
	id.addrMu.RLock()
	defer id.addrMu.RUnlock()
	return id.Controller.Address
}

// Next-pair file names of a rotation in progress.
const (
	nextKeyFile  = "agent.next.key"
	nextCertFile = "agent.next.crt"
)

// Rotate replaces the stored key and certificate under dir with a new
// pair (after Agents.Renew) and makes connections from then on use it.
// The new pair must be an agent certificate for the same host from the
// CAs it trusts (InvalidArgument otherwise).
//
// The pair is first written next to the old one, then renamed over it,
// key first; Load completes a rotation that a crash cut between the two
// renames, so the stored key and certificate always match.
func (id *Identity) Rotate(dir string, keyPEM, certPEM []byte) error {
	next, err := parse(Files{KeyPEM: keyPEM, CertPEM: certPEM, CAPEM: id.trust.Load().pem, Controller: id.Controller})
	if err != nil {
		return fmt.Errorf("rotate: %w", err)
	}
	if err := atomicfile.Write(filepath.Join(dir, nextKeyFile), keyPEM, 0o600); err != nil {
		return fmt.Errorf("rotate: %w", err)
	}
	if err := atomicfile.Write(filepath.Join(dir, nextCertFile), certPEM, 0o644); err != nil {
		return fmt.Errorf("rotate: %w", err)
	}
	if err := finishRotation(dir); err != nil {
		return err
	}
	id.cert.Store(next.cert.Load())
	return nil
}

// finishRotation moves a complete next pair over the current one: both
// next files present means the rename has not started; a next
// certificate alone means the key was moved already; a next key alone is
// an unfinished write, dropped (the current pair is intact). The next
// files were written durably with atomicfile; moving a pair is a
// roll-forward of two renames, not a one-file write, so it renames here
// and fsyncs the directory itself.
func finishRotation(dir string) error {
	nk, nc := filepath.Join(dir, nextKeyFile), filepath.Join(dir, nextCertFile)
	haveKey, haveCert := exists(nk), exists(nc)
	switch {
	case haveKey && !haveCert:
		return os.Remove(nk)
	case !haveCert:
		return nil
	}
	if haveKey {
		if err := os.Rename(nk, filepath.Join(dir, KeyFile)); err != nil {
			return fmt.Errorf("identity: finish rotation: %w", err)
		}
	}
	if err := os.Rename(nc, filepath.Join(dir, CertFile)); err != nil {
		return fmt.Errorf("identity: finish rotation: %w", err)
	}
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return nil
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// RenewDue reports whether the certificate has less than a third of its
// validity left at now, the point at which the agent renews it.
func (id *Identity) RenewDue(now time.Time) bool {
	leaf := id.cert.Load().Leaf
	life := leaf.NotAfter.Sub(leaf.NotBefore)
	return leaf.NotAfter.Sub(now) < life/3
}

// Host is the host named by the agent's certificate.
func (id *Identity) Host() string { return id.Controller.Host }

// Certificate returns the current certificate.
func (id *Identity) Certificate() *tls.Certificate { return id.cert.Load() }

// SetCertificate replaces the certificate (after a renewal); connections
// made from then on use it.
func (id *Identity) SetCertificate(c *tls.Certificate) { id.cert.Store(c) }

// ServerTLS is the configuration of the agent API: it presents the agent
// certificate and verifies any client certificate against the controller
// CA. A client without a certificate completes the handshake, so that the
// authorization interceptor can refuse it with a clear error; no method is
// served to it.
func (id *Identity) ServerTLS() *tls.Config {
	cfg := func() *tls.Config {
		return &tls.Config{
			MinVersion: tls.VersionTLS13,
			GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
				return id.cert.Load(), nil
			},
			ClientAuth: tls.VerifyClientCertIfGiven,
			ClientCAs:  id.trust.Load().pool,
		}
	}
	c := cfg()
	// Each connection verifies against the CAs trusted when it starts
	// (SetTrust).
	c.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) { return cfg(), nil }
	return c
}

// ClientTLS is the configuration for calling the controller: it presents
// the agent certificate and accepts only a server certificate issued by the
// controller CA with the controller role. The server's name is not checked
// against the dialled address (the CA is private to Kiln and pinned; the
// role is what proves it is the controller).
func (id *Identity) ClientTLS() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return id.cert.Load(), nil
		},
		InsecureSkipVerify: true, // verified below, against the pinned CA only
		VerifyConnection: func(cs tls.ConnectionState) error {
			return VerifyController(cs.PeerCertificates, id.trust.Load().pool)
		},
	}
}

// VerifyController checks that chain's leaf is issued by a CA in roots for
// server use and carries the controller role. It returns a
// PermissionDenied error otherwise.
func VerifyController(chain []*x509.Certificate, roots *x509.CertPool) error {
	if len(chain) == 0 {
		return errdefs.PermissionDenied("controller presented no certificate")
	}
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	if _, err := chain[0].Verify(x509.VerifyOptions{
		Roots:         roots,
		Intermediates: inter,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}); err != nil {
		return errdefs.PermissionDenied("controller certificate %q: %v", chain[0].Subject.CommonName, err)
	}
	role, name, err := pki.Identity(chain[0])
	if err != nil {
		return errdefs.PermissionDenied("controller certificate: %v", err)
	}
	if role != pki.RoleController {
		return errdefs.PermissionDenied("peer %q has role %s, not controller", name, role)
	}
	return nil
}

func pemCert(c *x509.Certificate) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})
}
