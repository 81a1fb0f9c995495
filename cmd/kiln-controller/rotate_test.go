package main

import (
	"context"
	"encoding/hex"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/internal/seal"
)

// TestRotateSecretKeyCommand runs rotate-secret-key as an operator would
// on a stopped controller's data directory: the phases print what to do
// next, the full run its summary, and neither the output nor the logs
// (at debug level) hold either key.
func TestRotateSecretKeyCommand(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	env := controllertest.Start(t)
	require.NoError(t, env.Store().PutSecret(ctx, "bmc/h1", []byte("pw")))
	env.Stop()
	keyFile := filepath.Join(env.DataDir, "secret.key")
	oldKey, err := seal.ReadKeyFile(keyFile)
	require.NoError(t, err)

	run := func(args ...string) (string, string, error) {
		var out, errOut strings.Builder
		cmd := rootCmd()
		cmd.SetOut(&out)
		cmd.SetErr(&errOut)
		cmd.SetArgs(append([]string{"rotate-secret-key", "--data-dir", env.DataDir, "--log-level", "debug"}, args...))
		err := cmd.ExecuteContext(ctx)
		return out.String(), errOut.String(), err
	}
	var all strings.Builder
	_, _, err = run("--phase", "sideways")
	require.ErrorContains(t, err, "want all, prepare or switch")

	out, logs, err := run("--phase", "prepare")
	require.NoError(t, err, logs)
	all.WriteString(out + logs)
	require.Contains(t, out, "wrote a new next key")
	out, logs, err = run("--phase", "switch")
	require.NoError(t, err, logs)
	all.WriteString(out + logs)
	require.Contains(t, out, "switched to key")
	out, logs, err = run()
	require.NoError(t, err, logs)
	all.WriteString(out + logs)
	t.Logf("output:\n%s", out)
	require.Contains(t, out, "carried on with the rotation already under way")
	require.Contains(t, out, "re-sealed bmc/h1")
	require.Contains(t, out, "2 of 2 secrets re-sealed under key")
	require.Contains(t, out, "take a new backup")

	newKey, err := seal.ReadKeyFile(keyFile)
	require.NoError(t, err)
	for name, k := range map[string][]byte{"old": oldKey, "new": newKey} {
		for _, enc := range []string{string(k), hex.EncodeToString(k), strings.ToUpper(hex.EncodeToString(k))} {
			if strings.Contains(all.String(), enc) {
				t.Errorf("the %s key appears in the command's output or logs", name)
			}
		}
	}

	// The controller started afterwards opens the secret.
	env2 := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) { c.DataDir = env.DataDir }))
	got, err := env2.Store().GetSecret(ctx, "bmc/h1")
	require.NoError(t, err)
	require.Equal(t, "pw", string(got))
}
