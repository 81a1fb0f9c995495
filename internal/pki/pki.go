// Package pki is Kiln's certificate authority: ECDSA P-256 CA and leaf
// certificates that carry a role and an identity, the kubeadm-style CA hash a
// new agent pins, and the checks that turn a presented certificate back into
// (role, identity).
//
// A leaf's role is the Subject Organization "kiln:<role>" and its identity is
// the Subject CommonName: the host name for agents ("rack1-01"), the user for
// operators, "kiln-controller" for the controller. The CA sets both itself
// when it signs; nothing a CSR asks for is copied into a certificate.
package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"strings"
	"time"
	"unicode"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Role is what a certificate's holder may do.
type Role string

// The roles. Controller and Agent are machine roles; Admin, Operator and
// Reader are the roles of kilnctl users, from most to least privileged.
const (
	RoleController Role = "controller"
	RoleAgent      Role = "agent"
	RoleAdmin      Role = "admin"
	RoleOperator   Role = "operator"
	RoleReader     Role = "reader"
)

// ControllerName is the identity in the controller's certificates.
const ControllerName = "kiln-controller"

// orgPrefix prefixes the role in the Subject Organization.
const orgPrefix = "kiln:"

// Validity defaults.
const (
	// CAValidity is how long a new CA is valid.
	CAValidity = 10 * 365 * 24 * time.Hour
	// clockSkew back-dates NotBefore so a host whose clock is a little
	// behind still accepts a fresh certificate.
	clockSkew = 5 * time.Minute
)

// Valid reports whether r is one of the defined roles.
func (r Role) Valid() bool {
	switch r {
	case RoleController, RoleAgent, RoleAdmin, RoleOperator, RoleReader:
		return true
	}
	return false
}

// ParseRole returns the role named s, or an InvalidArgument error.
func ParseRole(s string) (Role, error) {
	r := Role(s)
	if !r.Valid() {
		return "", errdefs.InvalidArgument("unknown role %q (want controller, agent, admin, operator or reader)", s)
	}
	return r, nil
}

// serves reports whether certificates of role r are also server certificates.
func (r Role) serves() bool { return r == RoleController || r == RoleAgent }

// Identity returns the role and identity a leaf certificate carries.
//
// It returns a PermissionDenied error when the certificate has no kiln role,
// an unknown one, more than one, or an empty identity. It does not verify
// the certificate's chain: do that first (crypto/tls does it for mTLS peers).
func Identity(cert *x509.Certificate) (Role, string, error) {
	if cert == nil {
		return "", "", errdefs.PermissionDenied("no client certificate")
	}
	var roles []string
	for _, o := range cert.Subject.Organization {
		if strings.HasPrefix(o, orgPrefix) {
			roles = append(roles, strings.TrimPrefix(o, orgPrefix))
		}
	}
	switch {
	case len(roles) == 0:
		return "", "", errdefs.PermissionDenied("certificate %q carries no kiln role", cert.Subject.CommonName)
	case len(roles) > 1:
		return "", "", errdefs.PermissionDenied("certificate %q carries %d kiln roles, want exactly one", cert.Subject.CommonName, len(roles))
	}
	role := Role(roles[0])
	if !role.Valid() {
		return "", "", errdefs.PermissionDenied("certificate %q carries unknown role %q", cert.Subject.CommonName, roles[0])
	}
	if cert.Subject.CommonName == "" {
		return "", "", errdefs.PermissionDenied("certificate with role %q has no identity (empty CommonName)", role)
	}
	return role, cert.Subject.CommonName, nil
}

// RequireRole returns nil when cert carries role (and an identity), and a
// PermissionDenied error naming the role it carries otherwise. Like
// Identity, it does not verify the chain: do that first.
func RequireRole(cert *x509.Certificate, role Role) error {
	got, name, err := Identity(cert)
	if err != nil {
		return err
	}
	if got != role {
		return errdefs.PermissionDenied("certificate %q has role %s, not %s", name, got, role)
	}
	return nil
}

// CA is a certificate authority: its certificate and private key.
type CA struct {
	cert    *x509.Certificate
	certPEM []byte
	key     *ecdsa.PrivateKey
}

// NewCA creates a self-signed ECDSA P-256 CA valid from now for CAValidity.
func NewCA(commonName string, now time.Time) (*CA, error) {
	if commonName == "" {
		return nil, errdefs.InvalidArgument("new CA: empty common name")
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("new CA: generate key: %w", err)
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, fmt.Errorf("new CA: %w", err)
	}
	ski, err := subjectKeyID(key.Public())
	if err != nil {
		return nil, fmt.Errorf("new CA: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: commonName, Organization: []string{"kiln"}},
		NotBefore:             now.Add(-clockSkew),
		NotAfter:              now.Add(CAValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
		SubjectKeyId:          ski,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("new CA: create certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("new CA: parse certificate: %w", err)
	}
	return &CA{cert: cert, certPEM: encodeCert(der), key: key}, nil
}

// LoadCA loads a CA from PEM: a CERTIFICATE block and an EC PRIVATE KEY or
// PRIVATE KEY (PKCS#8, ECDSA) block. It returns an InvalidArgument error when
// either does not parse, the certificate is not a CA, or the key does not
// match it.
func LoadCA(certPEM, keyPEM []byte) (*CA, error) {
	cert, err := ParseCertificatePEM(certPEM)
	if err != nil {
		return nil, fmt.Errorf("load CA: %w", err)
	}
	if !cert.IsCA {
		return nil, errdefs.InvalidArgument("load CA: certificate %q is not a CA", cert.Subject.CommonName)
	}
	key, err := ParsePrivateKeyPEM(keyPEM)
	if err != nil {
		return nil, fmt.Errorf("load CA: %w", err)
	}
	ecKey, ok := key.(*ecdsa.PrivateKey)
	if !ok {
		return nil, errdefs.InvalidArgument("load CA: key is %T, want ECDSA", key)
	}
	pub, ok := cert.PublicKey.(*ecdsa.PublicKey)
	if !ok || !pub.Equal(ecKey.Public()) {
		return nil, errdefs.InvalidArgument("load CA: key does not match certificate %q", cert.Subject.CommonName)
	}
	return &CA{cert: cert, certPEM: encodeCert(cert.Raw), key: ecKey}, nil
}

// Cert returns the CA certificate.
func (ca *CA) Cert() *x509.Certificate { return ca.cert }

// CertPEM returns the CA certificate in PEM.
func (ca *CA) CertPEM() []byte { return append([]byte(nil), ca.certPEM...) }

// KeyPEM returns the CA private key in PEM (EC PRIVATE KEY). It is a secret:
// store it sealed (package seal), never log it.
func (ca *CA) KeyPEM() ([]byte, error) { return marshalKey(ca.key) }

// Hash returns the CA's pin, "sha256:<hex>" (see Hash).
func (ca *CA) Hash() string { return Hash(ca.cert) }

// KeyID returns the CA's key id: the hex of its Subject Key Identifier,
// which every certificate it issues carries as its Authority Key
// Identifier (IssuerKeyID).
func (ca *CA) KeyID() string { return hex.EncodeToString(ca.cert.SubjectKeyId) }

// IssuerKeyID returns the key id of the CA that issued cert (the hex of
// its Authority Key Identifier), "" when it carries none. It matches
// CA.KeyID of the issuer; it is a label, not a verification.
func IssuerKeyID(cert *x509.Certificate) string { return hex.EncodeToString(cert.AuthorityKeyId) }

// Pool returns a certificate pool holding only this CA, for tls.Config
// RootCAs and ClientCAs.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.cert)
	return p
}

// SignOption adjusts a certificate SignCSR issues.
type SignOption func(*signOptions)

type signOptions struct {
	hosts []string
}

// WithHosts adds DNS names or IP addresses as subject alternative names.
func WithHosts(hosts ...string) SignOption {
	return func(o *signOptions) { o.hosts = append(o.hosts, hosts...) }
}

// SignCSR issues a certificate for the public key in a DER-encoded CSR,
// valid from now for ttl, with the given role and identity name.
//
// The CSR's signature must verify; its subject and extensions are ignored,
// so a requester cannot choose its own identity, role or names. Agent and
// controller certificates are usable for both client and server auth; user
// roles get client auth only. Subject alternative names come only from
// WithHosts. It returns InvalidArgument for a bad CSR, role, name or ttl.
func (ca *CA) SignCSR(csrDER []byte, role Role, name string, ttl time.Duration, now time.Time, opts ...SignOption) ([]byte, error) {
	csr, err := x509.ParseCertificateRequest(csrDER)
	if err != nil {
		return nil, errdefs.InvalidArgument("sign CSR: parse: %w", err)
	}
	if err := csr.CheckSignature(); err != nil {
		return nil, errdefs.InvalidArgument("sign CSR: signature does not verify: %w", err)
	}
	if err := checkPublicKey(csr.PublicKey); err != nil {
		return nil, fmt.Errorf("sign CSR: %w", err)
	}
	var o signOptions
	for _, opt := range opts {
		opt(&o)
	}
	der, err := ca.sign(csr.PublicKey, role, name, o.hosts, ttl, now)
	if err != nil {
		return nil, fmt.Errorf("sign CSR: %w", err)
	}
	return encodeCert(der), nil
}

// Issue makes a new key and a certificate for it with the given role,
// identity and subject alternative names (each host is an IP address or a
// DNS name). It is for certificates the controller makes for itself and for
// operators; agents make their own keys and send a CSR (SignCSR).
func (ca *CA) Issue(role Role, name string, hosts []string, ttl time.Duration, now time.Time) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("issue %s %q: generate key: %w", role, name, err)
	}
	der, err := ca.sign(key.Public(), role, name, hosts, ttl, now)
	if err != nil {
		return nil, nil, fmt.Errorf("issue %s %q: %w", role, name, err)
	}
	keyPEM, err = marshalKey(key)
	if err != nil {
		return nil, nil, fmt.Errorf("issue %s %q: %w", role, name, err)
	}
	return encodeCert(der), keyPEM, nil
}

func (ca *CA) sign(pub crypto.PublicKey, role Role, name string, hosts []string, ttl time.Duration, now time.Time) ([]byte, error) {
	if !role.Valid() {
		return nil, errdefs.InvalidArgument("unknown role %q", role)
	}
	if err := checkName(name); err != nil {
		return nil, err
	}
	if ttl <= 0 {
		return nil, errdefs.InvalidArgument("ttl %v: must be positive", ttl)
	}
	notAfter := now.Add(ttl)
	if notAfter.After(ca.cert.NotAfter) {
		notAfter = ca.cert.NotAfter
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, err
	}
	ski, err := subjectKeyID(pub)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: name, Organization: []string{orgPrefix + string(role)}},
		NotBefore:             now.Add(-clockSkew),
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
		SubjectKeyId:          ski,
		AuthorityKeyId:        ca.cert.SubjectKeyId,
	}
	if role.serves() {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
	}
	for _, h := range hosts {
		if h == "" {
			continue
		}
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, pub, ca.key)
	if err != nil {
		return nil, fmt.Errorf("create certificate: %w", err)
	}
	return der, nil
}

// NewKeyAndCSR makes a new ECDSA P-256 key and a CSR for it whose
// CommonName is name. The CA ignores the CSR's subject; name is only a hint
// for humans reading it.
func NewKeyAndCSR(name string) (keyPEM, csrDER []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("new CSR: generate key: %w", err)
	}
	csrDER, err = x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject: pkix.Name{CommonName: name},
	}, key)
	if err != nil {
		return nil, nil, fmt.Errorf("new CSR: %w", err)
	}
	keyPEM, err = marshalKey(key)
	if err != nil {
		return nil, nil, fmt.Errorf("new CSR: %w", err)
	}
	return keyPEM, csrDER, nil
}

// CSRForKey makes a CSR for an existing key (PEM, as NewKeyAndCSR
// returns it): an agent retrying an enrollment asks with the same key.
func CSRForKey(keyPEM []byte, name string) ([]byte, error) {
	key, err := ParsePrivateKeyPEM(keyPEM)
	if err != nil {
		return nil, fmt.Errorf("CSR: %w", err)
	}
	csrDER, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: name}}, key)
	if err != nil {
		return nil, fmt.Errorf("CSR: %w", err)
	}
	return csrDER, nil
}

// Hash returns the pin of a CA certificate: "sha256:" followed by the hex
// SHA-256 of its DER SubjectPublicKeyInfo. It is the same value as kubeadm's
// --discovery-token-ca-cert-hash and as
//
//	openssl x509 -pubkey -noout | openssl pkey -pubin -outform der | sha256sum
func Hash(cert *x509.Certificate) string {
	sum := sha256.Sum256(cert.RawSubjectPublicKeyInfo)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// ParseHash validates a pin of the form "sha256:<64 hex digits>" and
// returns the digest. It returns an InvalidArgument error otherwise.
func ParseHash(s string) ([]byte, error) {
	const prefix = "sha256:"
	alg, digest, ok := strings.Cut(s, ":")
	if !ok {
		return nil, errdefs.InvalidArgument("CA hash %q: want the form sha256:<64 hex digits>", s)
	}
	if alg != "sha256" {
		return nil, errdefs.InvalidArgument("CA hash %q: unsupported algorithm %q, want %q", s, alg, strings.TrimSuffix(prefix, ":"))
	}
	if len(digest) != 2*sha256.Size {
		return nil, errdefs.InvalidArgument("CA hash %q: digest has %d hex digits, want %d", s, len(digest), 2*sha256.Size)
	}
	b, err := hex.DecodeString(digest)
	if err != nil {
		return nil, errdefs.InvalidArgument("CA hash %q: digest is not hex", s)
	}
	return b, nil
}

// VerifyPinned finds, in a chain presented by a peer (leaf first, as in
// tls.ConnectionState.PeerCertificates), the CA certificate whose Hash
// equals pin, verifies the leaf against that CA alone and returns the CA.
//
// It is how a new agent that knows only the pin trusts the controller on
// first contact. It returns InvalidArgument for a malformed pin and
// PermissionDenied when no certificate matches or the leaf does not verify.
func VerifyPinned(chain []*x509.Certificate, pin string) (*x509.Certificate, error) {
	want, err := ParseHash(pin)
	if err != nil {
		return nil, err
	}
	if len(chain) == 0 {
		return nil, errdefs.PermissionDenied("verify pinned: peer presented no certificates")
	}
	var ca *x509.Certificate
	for _, c := range chain {
		sum := sha256.Sum256(c.RawSubjectPublicKeyInfo)
		if subtle.ConstantTimeCompare(sum[:], want) == 1 {
			ca = c
			break
		}
	}
	if ca == nil {
		return nil, errdefs.PermissionDenied("verify pinned: no certificate in the peer's chain matches CA hash %s", pin)
	}
	if !ca.IsCA {
		return nil, errdefs.PermissionDenied("verify pinned: certificate %q matches the pin but is not a CA", ca.Subject.CommonName)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		if c != ca {
			inter.AddCert(c)
		}
	}
	if _, err := chain[0].Verify(x509.VerifyOptions{
		Roots:         roots,
		Intermediates: inter,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageAny},
	}); err != nil {
		return nil, errdefs.PermissionDenied("verify pinned: leaf %q: %w", chain[0].Subject.CommonName, err)
	}
	return ca, nil
}

// ParseCertificatePEM parses the first CERTIFICATE block in data.
func ParseCertificatePEM(data []byte) (*x509.Certificate, error) {
	certs, err := ParseCertificatesPEM(data)
	if err != nil {
		return nil, err
	}
	return certs[0], nil
}

// ParseCertificatesPEM parses every CERTIFICATE block in data, in order. It
// returns an InvalidArgument error when there is none or one does not parse.
func ParseCertificatesPEM(data []byte) ([]*x509.Certificate, error) {
	var certs []*x509.Certificate
	for {
		var block *pem.Block
		block, data = pem.Decode(data)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, errdefs.InvalidArgument("parse certificate: %w", err)
		}
		certs = append(certs, c)
	}
	if len(certs) == 0 {
		return nil, errdefs.InvalidArgument("parse certificate: no CERTIFICATE PEM block")
	}
	return certs, nil
}

// ParsePrivateKeyPEM parses an EC PRIVATE KEY, PRIVATE KEY (PKCS#8) or RSA
// PRIVATE KEY block. It returns an InvalidArgument error otherwise; the
// error never contains key material.
func ParsePrivateKeyPEM(data []byte) (crypto.Signer, error) {
	for {
		var block *pem.Block
		block, data = pem.Decode(data)
		if block == nil {
			return nil, errdefs.InvalidArgument("parse private key: no private key PEM block")
		}
		switch block.Type {
		case "EC PRIVATE KEY":
			k, err := x509.ParseECPrivateKey(block.Bytes)
			if err != nil {
				return nil, errdefs.InvalidArgument("parse private key: malformed EC key")
			}
			return k, nil
		case "RSA PRIVATE KEY":
			k, err := x509.ParsePKCS1PrivateKey(block.Bytes)
			if err != nil {
				return nil, errdefs.InvalidArgument("parse private key: malformed RSA key")
			}
			return k, nil
		case "PRIVATE KEY":
			k, err := x509.ParsePKCS8PrivateKey(block.Bytes)
			if err != nil {
				return nil, errdefs.InvalidArgument("parse private key: malformed PKCS#8 key")
			}
			s, ok := k.(crypto.Signer)
			if !ok {
				return nil, errdefs.InvalidArgument("parse private key: %T is not a signing key", k)
			}
			return s, nil
		}
	}
}

func checkPublicKey(pub crypto.PublicKey) error {
	switch k := pub.(type) {
	case *ecdsa.PublicKey:
		if k.Curve != elliptic.P256() && k.Curve != elliptic.P384() {
			return errdefs.InvalidArgument("ECDSA curve %s not accepted, want P-256 or P-384", k.Curve.Params().Name)
		}
	case *rsa.PublicKey:
		if k.N.BitLen() < 2048 {
			return errdefs.InvalidArgument("RSA key of %d bits not accepted, want at least 2048", k.N.BitLen())
		}
	case ed25519.PublicKey:
	default:
		return errdefs.InvalidArgument("public key type %T not accepted", pub)
	}
	return nil
}

// checkName accepts identities that are printable, without spaces or
// slashes, and at most 253 bytes: host names, user names, service names.
func checkName(name string) error {
	if name == "" {
		return errdefs.InvalidArgument("empty identity name")
	}
	if len(name) > 253 {
		return errdefs.InvalidArgument("identity name of %d bytes is too long (max 253)", len(name))
	}
	for _, r := range name {
		if !unicode.IsPrint(r) || unicode.IsSpace(r) || r == '/' || r == ',' {
			return errdefs.InvalidArgument("identity name %q: character %q not allowed", name, r)
		}
	}
	return nil
}

func randomSerial() (*big.Int, error) {
	s, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("random serial: %w", err)
	}
	return s.Add(s, big.NewInt(1)), nil
}

func subjectKeyID(pub crypto.PublicKey) ([]byte, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return nil, fmt.Errorf("marshal public key: %w", err)
	}
	sum := sha256.Sum256(der)
	return sum[:20], nil
}

func marshalKey(key *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, errors.New("marshal private key")
	}
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), nil
}

func encodeCert(der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}
