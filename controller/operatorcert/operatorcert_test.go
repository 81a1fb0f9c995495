package operatorcert_test

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/operatorcert"
	"github.com/kilnhq/kiln/controller/trust"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/kilnconfig"
	"github.com/kilnhq/kiln/internal/pki"
)

// TestWriteAdmin follows the admin kilnconfig across starts: written on
// the first, only its server corrected on the next, a new certificate
// when the CAs change (a rotation is prepared) and when it nears its end;
// the bundle files match the kilnconfig and are private.
func TestWriteAdmin(t *testing.T) {
	now := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	oldCA, err := pki.NewCA("old", now)
	require.NoError(t, err)
	newCA, err := pki.NewCA("new", now)
	require.NoError(t, err)
	dir := t.TempDir()
	log := slog.New(slog.DiscardHandler)
	load := func(step string) *kilnconfig.Config {
		t.Helper()
		kc, err := kilnconfig.Load(filepath.Join(dir, operatorcert.AdminConfigName))
		require.NoError(t, err, step)
		cert, err := pki.ParseCertificatePEM([]byte(kc.Cert))
		require.NoError(t, err, step)
		if role, name, err := pki.Identity(cert); err != nil || role != pki.RoleAdmin || name != "admin" {
			t.Errorf("%s: identity = %s %s (%v), want admin admin", step, role, name, err)
		}
		for file, want := range map[string]string{"ca.crt": kc.CA, "admin.crt": kc.Cert, "admin.key": kc.Key} {
			path := filepath.Join(dir, operatorcert.AdminBundleDir, file)
			b, err := os.ReadFile(path)
			require.NoError(t, err, step)
			if string(b) != want {
				t.Errorf("%s: %s differs from the kilnconfig", step, path)
			}
			if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
				t.Errorf("%s: %s mode = %v (%v), want 0600", step, path, fi.Mode().Perm(), err)
			}
		}
		return kc
	}

	idle := &trust.Set{Signer: oldCA}
	require.NoError(t, operatorcert.WriteAdmin(dir, idle, "127.0.0.1:7443", now, log))
	first := load("first start")
	require.Equal(t, "127.0.0.1:7443", first.Server)

	require.NoError(t, operatorcert.WriteAdmin(dir, idle, "10.0.0.1:7443", now.Add(time.Hour), log))
	moved := load("restart on another address")
	require.Equal(t, "10.0.0.1:7443", moved.Server)
	if moved.Cert != first.Cert {
		t.Errorf("restart with the same CA reissued the admin certificate, want it kept")
	}

	prepared := &trust.Set{Signer: oldCA, Next: newCA}
	require.NoError(t, operatorcert.WriteAdmin(dir, prepared, "10.0.0.1:7443", now.Add(2*time.Hour), log))
	rotated := load("rotation prepared")
	if rotated.Cert == moved.Cert || strings.Count(rotated.CA, "BEGIN CERTIFICATE") != 2 {
		t.Errorf("after prepare: certificate kept %v, CAs %d; want a new certificate trusting 2 CAs",
			rotated.Cert == moved.Cert, strings.Count(rotated.CA, "BEGIN CERTIFICATE"))
	}

	late := now.Add(340 * 24 * time.Hour) // within 30 days of the year's end
	require.NoError(t, operatorcert.WriteAdmin(dir, prepared, "10.0.0.1:7443", late, log))
	if renewed := load("near expiry"); renewed.Cert == rotated.Cert {
		t.Errorf("admin certificate 25 days from expiry kept, want it renewed")
	}
}

// TestIssueRefusesNonOperatorRoles: agent and controller certificates are
// never handed out as kilnconfigs.
func TestIssueRefusesNonOperatorRoles(t *testing.T) {
	now := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	ca, err := pki.NewCA("ca", now)
	require.NoError(t, err)
	set := &trust.Set{Signer: ca}
	for _, role := range []pki.Role{pki.RoleAgent, pki.RoleController} {
		if _, err := operatorcert.Issue(set, role, "x", "127.0.0.1:7443", now); !errdefs.IsInvalidArgument(err) {
			t.Errorf("Issue(role %s) = %v, want InvalidArgument", role, err)
		}
	}
	for _, role := range []pki.Role{pki.RoleReader, pki.RoleOperator, pki.RoleAdmin} {
		kc, err := operatorcert.Issue(set, role, "alice", "127.0.0.1:7443", now)
		require.NoError(t, err, "Issue(role %s)", role)
		cert, err := pki.ParseCertificatePEM([]byte(kc.Cert))
		require.NoError(t, err)
		if got, name, _ := pki.Identity(cert); got != role || name != "alice" {
			t.Errorf("Issue(role %s) identity = %s %s, want %s alice", role, got, name, role)
		}
	}
}
