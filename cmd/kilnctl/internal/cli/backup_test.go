package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// TestBackupCommand runs kilnctl backup as an admin would: keygen, a
// backup to the printed public key (a 0600 file), and the refusals a
// user can hit: no recipient, a bad one, a reader's certificate, and a
// keygen that would overwrite a key. A refused backup leaves no file.
func TestBackupCommand(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	env := controllertest.Start(t)
	admin := env.AdminConfigPath
	dir := t.TempDir()
	keyFile := filepath.Join(dir, "backup.key")
	pub := strings.TrimSpace(mustKilnctl(t, admin, "backup", "keygen", "-o", keyFile))
	require.True(t, strings.HasPrefix(pub, "age1"), "keygen printed %q, want an age public key", pub)
	fi, err := os.Stat(keyFile)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	_, err = kilnctl(t, admin, "backup", "keygen", "-o", keyFile)
	require.ErrorContains(t, err, "never overwrites a key")

	out := filepath.Join(dir, "kiln.kbak")
	line := mustKilnctl(t, admin, "backup", "-o", out, "--recipient", pub)
	require.Contains(t, line, "wrote "+out+": ")
	require.Contains(t, line, "encrypted to 1 recipient(s)")
	fi, err = os.Stat(out)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	b, err := os.ReadFile(out)
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(string(b), "age-encryption.org/v1\n"), "the backup is not an age file")

	refused := filepath.Join(dir, "refused.kbak")
	_, err = kilnctl(t, admin, "backup", "-o", refused)
	require.True(t, errdefs.IsInvalidArgument(err), "no recipient: %v", err)
	require.ErrorContains(t, err, "kilnctl backup keygen")
	_, err = kilnctl(t, admin, "backup", "-o", refused, "--recipient", "age1nope")
	require.True(t, errdefs.IsInvalidArgument(err), "bad recipient: %v", err)
	_, err = kilnctl(t, env.ConfigFor(t, "reader", "rita"), "backup", "-o", refused, "--recipient", pub)
	require.True(t, errdefs.IsPermissionDenied(err), "reader's backup: %v", err)
	require.ErrorContains(t, err, "needs the admin role")
	_, err = os.Stat(refused)
	require.True(t, os.IsNotExist(err), "a refused backup left a file: %v", err)
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range entries {
		require.False(t, strings.Contains(e.Name(), ".tmp-"), "a temporary file was left: %s", e.Name())
	}
}
