package trust

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/pki"
)

// TestSetPhases checks, at each point of a rotation, which CA serves,
// which are trusted (serving first) and what the bundle holds.
func TestSetPhases(t *testing.T) {
	now := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	oldCA, err := pki.NewCA("old", now)
	require.NoError(t, err)
	newCA, err := pki.NewCA("new", now)
	require.NoError(t, err)
	tests := []struct {
		name    string
		set     *Set
		phase   string
		serving *pki.CA
		trusted []*pki.CA
	}{
		{"idle", &Set{Signer: oldCA}, "idle", oldCA, []*pki.CA{oldCA}},
		{"prepared", &Set{Signer: oldCA, Next: newCA}, "prepared", oldCA, []*pki.CA{oldCA, newCA}},
		{"switched", &Set{Signer: newCA, Prev: oldCA}, "switched", oldCA, []*pki.CA{oldCA, newCA}},
		{"retired", &Set{Signer: newCA}, "idle", newCA, []*pki.CA{newCA}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.set.Phase(); got != tt.phase {
				t.Errorf("Phase() = %q, want %q", got, tt.phase)
			}
			if got := tt.set.Serving(); got != tt.serving {
				t.Errorf("Serving() = %s, want %s", got.KeyID(), tt.serving.KeyID())
			}
			var got, want []string
			for _, ca := range tt.set.Trusted() {
				got = append(got, ca.KeyID())
			}
			for _, ca := range tt.trusted {
				want = append(want, ca.KeyID())
			}
			require.Equal(t, want, got, "Trusted()")
			if n := strings.Count(string(tt.set.BundlePEM()), "BEGIN CERTIFICATE"); n != len(tt.trusted) {
				t.Errorf("BundlePEM() holds %d certificates, want %d", n, len(tt.trusted))
			}
		})
	}
}

// TestOwnCertFollowsServingCA walks a rotation under the controller's own
// certificate: it keeps the certificate while the old CA serves (prepared,
// switched), takes one from the new CA once the old is retired, and
// renews when a third of its year is left.
func TestOwnCertFollowsServingCA(t *testing.T) {
	now := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	oldCA, err := pki.NewCA("old", now)
	require.NoError(t, err)
	newCA, err := pki.NewCA("new", now)
	require.NoError(t, err)
	r := NewRotating(&Set{Signer: oldCA})
	own := NewOwnCert(r, []string{"localhost", "127.0.0.1"}, func() time.Time { return now }, slog.New(slog.DiscardHandler))

	get := func(step string) (serial, issuer string) {
		t.Helper()
		c, err := own.Get()
		require.NoError(t, err, step)
		require.NotNil(t, c.Leaf, step)
		role, name, err := pki.Identity(c.Leaf)
		require.NoError(t, err, step)
		if role != pki.RoleController || name != pki.ControllerName {
			t.Errorf("%s: identity = %s %s, want %s %s", step, role, name, pki.RoleController, pki.ControllerName)
		}
		return c.Leaf.SerialNumber.String(), pki.IssuerKeyID(c.Leaf)
	}
	first, issuer := get("start")
	require.Equal(t, oldCA.KeyID(), issuer, "issuer at start")
	for _, s := range []struct {
		name string
		set  *Set
	}{
		{"prepared", &Set{Signer: oldCA, Next: newCA}},
		{"switched", &Set{Signer: newCA, Prev: oldCA}},
	} {
		r.cur.Store(s.set)
		if serial, _ := get(s.name); serial != first {
			t.Errorf("%s: certificate reissued (serial %s, was %s), want it kept while the old CA serves", s.name, serial, first)
		}
	}
	r.cur.Store(&Set{Signer: newCA})
	retired, issuer := get("retired")
	if retired == first || issuer != newCA.KeyID() {
		t.Errorf("after retire: serial %s issuer %s, want a new certificate from %s", retired, issuer, newCA.KeyID())
	}
	now = now.Add(serverCertTTL * 2 / 3).Add(time.Minute)
	if renewed, _ := get("late"); renewed == retired {
		t.Errorf("with a third of its year left: serial %s kept, want it renewed", renewed)
	}
}
