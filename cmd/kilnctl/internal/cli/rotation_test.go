package cli

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/datadir"
	"github.com/kilnhq/kiln/controller/trust"
	"github.com/kilnhq/kiln/internal/pki"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// kilnctl apply prints the controller's warnings on stderr, naming the
// object, and still reports it stored (issue 12, hole 6: a route an agent
// reports warns, never refuses).
func TestApplyPrintsWarnings(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	ctx := context.Background()
	env := controllertest.Start(t)
	_, csr, err := pki.NewKeyAndCSR("evil-01")
	require.NoError(t, err)
	_, err = controllerv1.NewEnrollmentClient(env.DialAnonymous(t)).Enroll(ctx, &controllerv1.EnrollRequest{
		Token: env.Token(t, "evil-01", time.Hour), CsrDer: csr, Host: "evil-01",
		Facts: &typesv1.Facts{Routes: []*typesv1.Route{{Destination: "0.0.0.0/1"}, {Destination: "128.0.0.0/1"}}},
	})
	require.NoError(t, err)
	f := filepath.Join(t.TempDir(), "cluster.yaml")
	require.NoError(t, os.WriteFile(f, []byte(`apiVersion: kiln.dev/v1
kind: Cluster
metadata:
  name: prod
spec:
  kubernetesVersion: v1.34.4
  podCidr: 10.244.0.0/16
  serviceCidr: 10.96.0.0/12
`), 0o600))
	out, errOut, err := run(t, map[string]string{"KILNCONFIG": env.AdminConfigPath, "HOME": t.TempDir()}, "apply", "-f", f)
	require.NoError(t, err)
	if out != "cluster/prod created\n" {
		t.Errorf("kilnctl apply stdout = %q, want %q", out, "cluster/prod created\n")
	}
	for _, want := range []string{"Warning: cluster/prod: spec.podCidr 10.244.0.0/16 overlaps network 0.0.0.0/1 (host \"evil-01\")", "Warning: cluster/prod: spec.serviceCidr"} {
		if !strings.Contains(errOut, want) {
			t.Errorf("kilnctl apply stderr = %q, want it to contain %q", errOut, want)
		}
	}
}

// After kiln-controller rotate-ca retires the CA a kilnconfig names,
// kilnctl says so and how to get a new one, rather than only that it
// cannot reach the controller.
func TestRetiredCAKilnconfigIsExplained(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	ctx := context.Background()
	env := controllertest.Start(t)
	old := env.ConfigFor(t, "reader", "rita")
	_, err := kilnctl(t, old, "get", "hosts")
	require.NoError(t, err)
	cfg := datadir.Config{DataDir: env.DataDir}
	for _, p := range []trust.Phase{trust.Prepare, trust.Switch, trust.Retire} {
		_, err := trust.Rotate(ctx, cfg, trust.RotateRequest{Phase: p}, nil)
		require.NoError(t, err, "rotate-ca --phase %s", p)
	}
	require.Eventually(t, func() bool {
		_, err := kilnctl(t, old, "get", "hosts")
		return err != nil
	}, 10*time.Second, 50*time.Millisecond, "a kilnconfig of the retired CA still works")
	_, err = kilnctl(t, old, "get", "hosts")
	for _, want := range []string{"presents a certificate of a CA this kilnconfig does not trust", "kiln-controller rotate-ca", "kiln-controller operator-cert"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("kilnctl get hosts with a retired CA's kilnconfig = %v, want it to say %q", err, want)
		}
	}
}
