package pki

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

var now = time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)

func newCA(t *testing.T) *CA {
	t.Helper()
	ca, err := NewCA("kiln-ca", now)
	require.NoError(t, err)
	return ca
}

func TestHashMatchesOpenSSL(t *testing.T) {
	if _, err := exec.LookPath("openssl"); err != nil {
		testenv.Skip(t, "openssl not installed: cannot cross-check the CA hash")
	}
	ca := newCA(t)
	cmd := exec.Command("sh", "-c", "openssl x509 -pubkey -noout | openssl pkey -pubin -outform der | sha256sum")
	cmd.Stdin = bytes.NewReader(ca.CertPEM())
	out, err := cmd.Output()
	require.NoError(t, err)
	want := "sha256:" + strings.Fields(string(out))[0]
	if got := ca.Hash(); got != want {
		t.Errorf("Hash() = %q, want %q (openssl)", got, want)
	}
	if _, err := ParseHash(ca.Hash()); err != nil {
		t.Errorf("ParseHash(%q) = %v, want nil", ca.Hash(), err)
	}
}

func TestParseHash(t *testing.T) {
	good := "sha256:" + strings.Repeat("ab", 32)
	tests := []struct {
		in     string
		wantOK bool
	}{
		{good, true},
		{strings.ToUpper(good[:7]) + good[7:], false},
		{"sha256:" + strings.Repeat("AB", 32), true},
		{strings.Repeat("ab", 32), false},
		{"sha1:" + strings.Repeat("ab", 20), false},
		{"sha256:" + strings.Repeat("ab", 31), false},
		{"sha256:" + strings.Repeat("zz", 32), false},
		{"", false},
	}
	for _, tt := range tests {
		b, err := ParseHash(tt.in)
		if (err == nil) != tt.wantOK {
			t.Errorf("ParseHash(%q) = %v, want ok=%v", tt.in, err, tt.wantOK)
			continue
		}
		if err != nil && !errdefs.IsInvalidArgument(err) {
			t.Errorf("ParseHash(%q) = %v, want InvalidArgument", tt.in, err)
		}
		if err == nil && len(b) != 32 {
			t.Errorf("ParseHash(%q) = %d bytes, want 32", tt.in, len(b))
		}
	}
}

func TestLoadCARoundTrip(t *testing.T) {
	ca := newCA(t)
	keyPEM, err := ca.KeyPEM()
	require.NoError(t, err)
	loaded, err := LoadCA(ca.CertPEM(), keyPEM)
	require.NoError(t, err)
	if loaded.Hash() != ca.Hash() {
		t.Errorf("LoadCA().Hash() = %q, want %q", loaded.Hash(), ca.Hash())
	}
	// The loaded CA signs certificates the original's pool verifies.
	certPEM, _, err := loaded.Issue(RoleAdmin, "alice", nil, time.Hour, now)
	require.NoError(t, err)
	cert, err := ParseCertificatePEM(certPEM)
	require.NoError(t, err)
	_, err = cert.Verify(x509.VerifyOptions{Roots: ca.Pool(), CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)

	other := newCA(t)
	otherKey, err := other.KeyPEM()
	require.NoError(t, err)
	if _, err := LoadCA(ca.CertPEM(), otherKey); !errdefs.IsInvalidArgument(err) {
		t.Errorf("LoadCA(cert, other key) = %v, want InvalidArgument", err)
	}
	if _, err := LoadCA(certPEM, keyPEM); !errdefs.IsInvalidArgument(err) {
		t.Errorf("LoadCA(leaf cert) = %v, want InvalidArgument", err)
	}
	if _, err := LoadCA([]byte("junk"), keyPEM); !errdefs.IsInvalidArgument(err) {
		t.Errorf("LoadCA(junk) = %v, want InvalidArgument", err)
	}
}

func TestSignCSRIgnoresRequestedIdentity(t *testing.T) {
	ca := newCA(t)
	// An agent asks to be the controller, as admin, with a SAN of its choice.
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	csrDER, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject:  pkix.Name{CommonName: ControllerName, Organization: []string{"kiln:admin", "kiln:controller"}},
		DNSNames: []string{"kiln-controller.example"},
	}, key)
	require.NoError(t, err)

	certPEM, err := ca.SignCSR(csrDER, RoleAgent, "rack1-01", 24*time.Hour, now, WithHosts("10.0.0.7", "rack1-01.lab"))
	require.NoError(t, err)
	cert, err := ParseCertificatePEM(certPEM)
	require.NoError(t, err)

	role, name, err := Identity(cert)
	require.NoError(t, err)
	if role != RoleAgent || name != "rack1-01" {
		t.Errorf("Identity(signed) = (%q, %q), want (agent, rack1-01)", role, name)
	}
	if !slices.Equal(cert.DNSNames, []string{"rack1-01.lab"}) {
		t.Errorf("DNSNames = %v, want [rack1-01.lab] (the CSR's own SANs must be ignored)", cert.DNSNames)
	}
	if len(cert.IPAddresses) != 1 || !cert.IPAddresses[0].Equal(net.ParseIP("10.0.0.7")) {
		t.Errorf("IPAddresses = %v, want [10.0.0.7]", cert.IPAddresses)
	}
	for _, u := range []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth} {
		if !slices.Contains(cert.ExtKeyUsage, u) {
			t.Errorf("agent ExtKeyUsage = %v, missing %v", cert.ExtKeyUsage, u)
		}
	}
	if !cert.NotAfter.Equal(now.Add(24 * time.Hour)) {
		t.Errorf("NotAfter = %v, want %v", cert.NotAfter, now.Add(24*time.Hour))
	}
	if !cert.PublicKey.(*ecdsa.PublicKey).Equal(key.Public()) {
		t.Error("signed certificate does not carry the CSR's public key")
	}
}

func TestSignCSRRejects(t *testing.T) {
	ca := newCA(t)
	_, csrDER, err := NewKeyAndCSR("rack1-02")
	require.NoError(t, err)
	tampered := bytes.Clone(csrDER)
	tampered[len(tampered)-5] ^= 0xff

	tests := []struct {
		name string
		csr  []byte
		role Role
		id   string
		ttl  time.Duration
	}{
		{"garbage", []byte("not a csr"), RoleAgent, "rack1-02", time.Hour},
		{"bad signature", tampered, RoleAgent, "rack1-02", time.Hour},
		{"unknown role", csrDER, Role("root"), "rack1-02", time.Hour},
		{"empty name", csrDER, RoleAgent, "", time.Hour},
		{"name with slash", csrDER, RoleAgent, "a/b", time.Hour},
		{"zero ttl", csrDER, RoleAgent, "rack1-02", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ca.SignCSR(tt.csr, tt.role, tt.id, tt.ttl, now)
			if !errdefs.IsInvalidArgument(err) {
				t.Errorf("SignCSR(%s) = %v, want InvalidArgument", tt.name, err)
			}
		})
	}
}

func TestIssueRoles(t *testing.T) {
	ca := newCA(t)
	tests := []struct {
		role       Role
		name       string
		wantServer bool
	}{
		{RoleController, ControllerName, true},
		{RoleAgent, "rack1-01", true},
		{RoleAdmin, "alice", false},
		{RoleOperator, "bob", false},
		{RoleReader, "carol", false},
	}
	for _, tt := range tests {
		certPEM, keyPEM, err := ca.Issue(tt.role, tt.name, []string{"127.0.0.1", "localhost"}, time.Hour, now)
		require.NoError(t, err)
		_, err = tls.X509KeyPair(certPEM, keyPEM)
		require.NoError(t, err, "Issue(%q) key pair", tt.role)
		cert, err := ParseCertificatePEM(certPEM)
		require.NoError(t, err)
		role, name, err := Identity(cert)
		if err != nil || role != tt.role || name != tt.name {
			t.Errorf("Identity(Issue(%q, %q)) = (%q, %q, %v), want (%q, %q, nil)", tt.role, tt.name, role, name, err, tt.role, tt.name)
		}
		_, err = cert.Verify(x509.VerifyOptions{Roots: ca.Pool(), CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, DNSName: "localhost"})
		if gotServer := err == nil; gotServer != tt.wantServer {
			t.Errorf("Issue(%q) verifies as server = %v, want %v (err %v)", tt.role, gotServer, tt.wantServer, err)
		}
	}
}

func TestIdentityRejects(t *testing.T) {
	tests := []struct {
		name string
		subj pkix.Name
	}{
		{"no role", pkix.Name{CommonName: "x", Organization: []string{"system:masters"}}},
		{"unknown role", pkix.Name{CommonName: "x", Organization: []string{"kiln:root"}}},
		{"two roles", pkix.Name{CommonName: "x", Organization: []string{"kiln:reader", "kiln:admin"}}},
		{"no identity", pkix.Name{Organization: []string{"kiln:admin"}}},
	}
	for _, tt := range tests {
		_, _, err := Identity(&x509.Certificate{Subject: tt.subj})
		if !errdefs.IsPermissionDenied(err) {
			t.Errorf("Identity(%s) = %v, want PermissionDenied", tt.name, err)
		}
	}
	if _, _, err := Identity(nil); !errdefs.IsPermissionDenied(err) {
		t.Errorf("Identity(nil) = %v, want PermissionDenied", err)
	}
}

func TestVerifyPinned(t *testing.T) {
	ca := newCA(t)
	other := newCA(t)
	leafPEM, _, err := ca.Issue(RoleController, ControllerName, []string{"127.0.0.1"}, time.Hour, time.Now())
	require.NoError(t, err)
	leaf, err := ParseCertificatePEM(leafPEM)
	require.NoError(t, err)
	// A forged leaf: signed by another CA that the attacker presents in
	// place of ours.
	forgedPEM, _, err := other.Issue(RoleController, ControllerName, []string{"127.0.0.1"}, time.Hour, time.Now())
	require.NoError(t, err)
	forged, err := ParseCertificatePEM(forgedPEM)
	require.NoError(t, err)

	got, err := VerifyPinned([]*x509.Certificate{leaf, ca.Cert()}, ca.Hash())
	require.NoError(t, err)
	if Hash(got) != ca.Hash() {
		t.Errorf("VerifyPinned() CA hash = %q, want %q", Hash(got), ca.Hash())
	}

	tests := []struct {
		name  string
		chain []*x509.Certificate
		pin   string
		class func(error) bool
	}{
		{"wrong CA presented", []*x509.Certificate{forged, other.Cert()}, ca.Hash(), errdefs.IsPermissionDenied},
		{"forged leaf with our CA", []*x509.Certificate{forged, ca.Cert()}, ca.Hash(), errdefs.IsPermissionDenied},
		{"no CA in chain", []*x509.Certificate{leaf}, ca.Hash(), errdefs.IsPermissionDenied},
		{"pin is the leaf", []*x509.Certificate{leaf, ca.Cert()}, Hash(leaf), errdefs.IsPermissionDenied},
		{"empty chain", nil, ca.Hash(), errdefs.IsPermissionDenied},
		{"malformed pin", []*x509.Certificate{leaf, ca.Cert()}, "sha256:abc", errdefs.IsInvalidArgument},
	}
	for _, tt := range tests {
		if _, err := VerifyPinned(tt.chain, tt.pin); !tt.class(err) {
			t.Errorf("VerifyPinned(%s) = %v, want error of the expected class", tt.name, err)
		}
	}
}

// TestMTLSWithRoles runs a real TLS handshake on loopback: the controller
// serves with its certificate, an agent connects with a CSR-signed
// certificate, and the server reads the agent's identity from it.
func TestMTLSWithRoles(t *testing.T) {
	ca := newCA(t)
	srvCert, srvKey, err := ca.Issue(RoleController, ControllerName, []string{"127.0.0.1"}, time.Hour, time.Now())
	require.NoError(t, err)
	srvPair, err := tls.X509KeyPair(srvCert, srvKey)
	require.NoError(t, err)
	agentKey, csr, err := NewKeyAndCSR("whatever-i-like")
	require.NoError(t, err)
	agentCert, err := ca.SignCSR(csr, RoleAgent, "rack1-03", time.Hour, time.Now())
	require.NoError(t, err)
	agentPair, err := tls.X509KeyPair(agentCert, agentKey)
	require.NoError(t, err)

	l, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{srvPair},
		ClientCAs:    ca.Pool(),
		ClientAuth:   tls.RequireAndVerifyClientCert,
		MinVersion:   tls.VersionTLS13,
	})
	require.NoError(t, err)
	defer l.Close()
	type result struct {
		role Role
		name string
		err  error
	}
	done := make(chan result, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			done <- result{err: err}
			return
		}
		defer c.Close()
		tc := c.(*tls.Conn)
		if err := tc.Handshake(); err != nil {
			done <- result{err: err}
			return
		}
		r, n, err := Identity(tc.ConnectionState().PeerCertificates[0])
		done <- result{r, n, err}
	}()
	c, err := tls.Dial("tcp", l.Addr().String(), &tls.Config{
		Certificates: []tls.Certificate{agentPair},
		RootCAs:      ca.Pool(),
		ServerName:   "127.0.0.1",
		MinVersion:   tls.VersionTLS13,
	})
	require.NoError(t, err)
	require.NoError(t, c.Handshake())
	c.Close()
	r := <-done
	require.NoError(t, r.err)
	if r.role != RoleAgent || r.name != "rack1-03" {
		t.Errorf("server saw identity (%q, %q), want (agent, rack1-03)", r.role, r.name)
	}
}

func TestKeyPEMWritesAndReads(t *testing.T) {
	// The CA survives a trip through files, as the controller stores it.
	ca := newCA(t)
	dir := t.TempDir()
	keyPEM, err := ca.KeyPEM()
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "ca.crt"), ca.CertPEM(), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "ca.key"), keyPEM, 0o600))
	c, err := os.ReadFile(filepath.Join(dir, "ca.crt"))
	require.NoError(t, err)
	k, err := os.ReadFile(filepath.Join(dir, "ca.key"))
	require.NoError(t, err)
	loaded, err := LoadCA(c, k)
	require.NoError(t, err)
	if !loaded.Cert().Equal(ca.Cert()) {
		t.Error("LoadCA(files).Cert() differs from the original")
	}
}
