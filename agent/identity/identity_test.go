package identity_test

import (
	"crypto/x509"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/agent/identity"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
)

type pair struct{ key, cert []byte }

func issue(t *testing.T, ca *pki.CA, role pki.Role, host string, ttl time.Duration, now time.Time) pair {
	t.Helper()
	key, csr, err := pki.NewKeyAndCSR(host)
	require.NoError(t, err)
	cert, err := ca.SignCSR(csr, role, host, ttl, now)
	require.NoError(t, err)
	return pair{key, cert}
}

func newCA(t *testing.T) *pki.CA {
	ca, err := pki.NewCA("kiln", time.Now())
	require.NoError(t, err)
	return ca
}

func TestSaveRejectsInconsistentIdentities(t *testing.T) {
	ca, other := newCA(t), newCA(t)
	good := issue(t, ca, pki.RoleAgent, "h1", time.Hour, time.Now())
	ctl := identity.Controller{Address: "127.0.0.1:7443", CAHash: ca.Hash(), Host: "h1"}
	tests := []struct {
		name string
		f    identity.Files
	}{
		{"key of another pair", identity.Files{KeyPEM: issue(t, ca, pki.RoleAgent, "h1", time.Hour, time.Now()).key, CertPEM: good.cert, CAPEM: ca.CertPEM(), Controller: ctl}},
		{"certificate of another CA", func() identity.Files {
			p := issue(t, other, pki.RoleAgent, "h1", time.Hour, time.Now())
			return identity.Files{KeyPEM: p.key, CertPEM: p.cert, CAPEM: ca.CertPEM(), Controller: ctl}
		}()},
		{"operator certificate", func() identity.Files {
			p := issue(t, ca, pki.RoleOperator, "h1", time.Hour, time.Now())
			return identity.Files{KeyPEM: p.key, CertPEM: p.cert, CAPEM: ca.CertPEM(), Controller: ctl}
		}()},
		{"certificate of another host", func() identity.Files {
			p := issue(t, ca, pki.RoleAgent, "h2", time.Hour, time.Now())
			return identity.Files{KeyPEM: p.key, CertPEM: p.cert, CAPEM: ca.CertPEM(), Controller: ctl}
		}()},
		{"CA not matching the pin", identity.Files{KeyPEM: good.key, CertPEM: good.cert, CAPEM: ca.CertPEM(), Controller: identity.Controller{CAHash: other.Hash(), Host: "h1"}}},
	}
	for _, tt := range tests {
		dir := t.TempDir()
		_, err := identity.Save(dir, tt.f)
		if !errdefs.IsInvalidArgument(err) {
			t.Errorf("Save(%s) = %v, want InvalidArgument", tt.name, err)
		}
		require.False(t, identity.Exists(dir), "%s: nothing may be stored", tt.name)
	}
}

func TestLoadNotEnrolled(t *testing.T) {
	_, err := identity.Load(t.TempDir())
	if !errdefs.IsNotFound(err) {
		t.Errorf("Load(empty dir) = %v, want NotFound", err)
	}
}

func TestRotate(t *testing.T) {
	ca := newCA(t)
	now := time.Now()
	p := issue(t, ca, pki.RoleAgent, "h1", 3*time.Hour, now)
	dir := t.TempDir()
	id, err := identity.Save(dir, identity.Files{KeyPEM: p.key, CertPEM: p.cert, CAPEM: ca.CertPEM(),
		Controller: identity.Controller{Address: "127.0.0.1:7443", CAHash: ca.Hash(), Host: "h1"}})
	require.NoError(t, err)

	// pki backdates NotBefore by 5 minutes: 3h05m of life, due below a third.
	for _, tt := range []struct {
		at   time.Duration
		want bool
	}{{0, false}, {time.Hour, false}, {2*time.Hour + 5*time.Minute, true}} {
		if got := id.RenewDue(now.Add(tt.at)); got != tt.want {
			t.Errorf("RenewDue(now+%v) = %v, want %v", tt.at, got, tt.want)
		}
	}

	next := issue(t, ca, pki.RoleAgent, "h1", 3*time.Hour, now)
	require.NoError(t, id.Rotate(dir, next.key, next.cert))
	require.Equal(t, id.Certificate().Leaf.Raw, mustLoad(t, dir).Certificate().Leaf.Raw)
	h2 := issue(t, ca, pki.RoleAgent, "h2", time.Hour, now)
	if err := id.Rotate(dir, h2.key, h2.cert); !errdefs.IsInvalidArgument(err) {
		t.Errorf("Rotate() to another host's certificate = %v, want InvalidArgument", err)
	}

	// A crash after the key was moved but before the certificate was:
	// Load completes the rotation.
	third := issue(t, ca, pki.RoleAgent, "h1", 3*time.Hour, now)
	require.NoError(t, os.WriteFile(filepath.Join(dir, identity.KeyFile), third.key, 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "agent.next.crt"), third.cert, 0o644))
	loaded := mustLoad(t, dir)
	require.Equal(t, third.cert, pemOf(t, dir))
	require.NotNil(t, loaded)

	// A crash while writing the next pair (key only): the current pair stays.
	require.NoError(t, os.WriteFile(filepath.Join(dir, "agent.next.key"), next.key, 0o600))
	require.Equal(t, third.cert, pemOf(t, dir))
	mustLoad(t, dir)
	_, err = os.Stat(filepath.Join(dir, "agent.next.key"))
	require.True(t, os.IsNotExist(err), "an unfinished next key is dropped")
}

func mustLoad(t *testing.T, dir string) *identity.Identity {
	t.Helper()
	id, err := identity.Load(dir)
	require.NoError(t, err)
	return id
}

func pemOf(t *testing.T, dir string) []byte {
	b, err := os.ReadFile(filepath.Join(dir, identity.CertFile))
	require.NoError(t, err)
	return b
}

func TestVerifyController(t *testing.T) {
	ca := newCA(t)
	for _, tt := range []struct {
		role pki.Role
		ok   bool
	}{{pki.RoleController, true}, {pki.RoleAgent, false}} {
		certPEM, _, err := ca.Issue(tt.role, "x", nil, time.Hour, time.Now())
		require.NoError(t, err)
		cert, err := pki.ParseCertificatePEM(certPEM)
		require.NoError(t, err)
		err = identity.VerifyController([]*x509.Certificate{cert}, ca.Pool())
		if (err == nil) != tt.ok {
			t.Errorf("VerifyController(%s) = %v, want ok=%v", tt.role, err, tt.ok)
		}
	}
}

// A CA rotation, as the agent sees it: both CAs, a renewal onto the new
// one, then the new one alone; each step survives a reload, and the
// bundles a rotation never sends are refused with nothing changed.
func TestSetTrustFollowsACARotation(t *testing.T) {
	oldCA, newCA, stranger := newCA(t), newCA(t), newCA(t)
	now := time.Now()
	p := issue(t, oldCA, pki.RoleAgent, "h1", time.Hour, now)
	dir := t.TempDir()
	id, err := identity.Save(dir, identity.Files{KeyPEM: p.key, CertPEM: p.cert, CAPEM: oldCA.CertPEM(),
		Controller: identity.Controller{Address: "127.0.0.1:7443", CAHash: oldCA.Hash(), Host: "h1"}})
	require.NoError(t, err)
	both := append(oldCA.CertPEM(), newCA.CertPEM()...)

	// The new CA alone does not hold the agent's issuer: renew first.
	changed, err := id.SetTrust(dir, newCA.CertPEM())
	require.True(t, errdefs.IsInvalidArgument(err), "SetTrust(new CA only, before renewal) = %v, want InvalidArgument", err)
	require.False(t, changed)

	changed, err = id.SetTrust(dir, both)
	require.NoError(t, err)
	require.True(t, changed)
	changed, err = id.SetTrust(dir, both)
	require.NoError(t, err)
	require.False(t, changed, "SetTrust(same bundle) changed")
	loaded, err := identity.Load(dir)
	require.NoError(t, err)
	require.Len(t, loaded.CAs(), 2, "CAs after reload")

	// A certificate of the new CA is accepted once both are trusted.
	np := issue(t, newCA, pki.RoleAgent, "h1", time.Hour, now)
	require.NoError(t, id.Rotate(dir, np.key, np.cert))

	// A bundle sharing no CA with the trusted ones never comes from a
	// rotation: refused.
	withStranger := append(stranger.CertPEM(), newCA.CertPEM()...)
	_, err = id.SetTrust(dir, stranger.CertPEM())
	require.True(t, errdefs.IsInvalidArgument(err), "SetTrust(a stranger CA) = %v, want InvalidArgument", err)
	_, err = id.SetTrust(dir, withStranger)
	require.NoError(t, err, "a bundle with the agent's issuer and a CA trusted now")

	changed, err = id.SetTrust(dir, newCA.CertPEM())
	require.NoError(t, err)
	require.True(t, changed)
	loaded, err = identity.Load(dir)
	require.NoError(t, err)
	cas := loaded.CAs()
	require.Len(t, cas, 1)
	require.Equal(t, newCA.Hash(), pki.Hash(cas[0]))
	require.Equal(t, newCA.Hash(), loaded.Controller.CAHash, "pin after the old CA is gone")

	// A crash between the two writes (controller.json written, ca.crt
	// not yet) leaves files that load: the pin names a CA of both.
	id2dir := t.TempDir()
	p2 := issue(t, oldCA, pki.RoleAgent, "h2", time.Hour, now)
	id2, err := identity.Save(id2dir, identity.Files{KeyPEM: p2.key, CertPEM: p2.cert, CAPEM: oldCA.CertPEM(),
		Controller: identity.Controller{Address: "127.0.0.1:7443", CAHash: oldCA.Hash(), Host: "h2"}})
	require.NoError(t, err)
	before, err := os.ReadFile(filepath.Join(id2dir, identity.CAFile))
	require.NoError(t, err)
	_, err = id2.SetTrust(id2dir, both)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(id2dir, identity.CAFile), before, 0o644))
	_, err = identity.Load(id2dir)
	require.NoError(t, err, "identity with the new controller.json and the old ca.crt")
}
