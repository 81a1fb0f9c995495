package cli

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/clusterexec"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/internal/errdefs"
)

const labClusterYAML = "apiVersion: kiln.dev/v1\nkind: Cluster\nmetadata:\n  name: lab\nspec:\n  kubernetesVersion: v1.34.4\n  podCidr: 10.244.0.0/16\n  serviceCidr: 10.96.0.0/12\n"

// testKubeconfig stands in for what kubeadm init returns.
const testKubeconfig = "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster:\n    server: https://10.44.0.10:6443\nusers:\n- name: kubernetes-admin\n  user:\n    client-key-data: S0VZLU1BUktFUi05ZDQx\n"

func TestKubeconfig(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	env := controllertest.Start(t)
	admin := env.AdminConfigPath
	p := filepath.Join(t.TempDir(), "lab.yaml")
	require.NoError(t, os.WriteFile(p, []byte(labClusterYAML), 0o644))
	mustKilnctl(t, admin, "apply", "-f", p)

	t.Run("unknown cluster", func(t *testing.T) {
		_, err := kilnctl(t, admin, "kubeconfig", "nope")
		if !errdefs.IsNotFound(err) || err.Error() != "kubeconfig nope: cluster nope not found" {
			t.Errorf("kilnctl kubeconfig nope = %v, want NotFound \"kubeconfig nope: cluster nope not found\"", err)
		}
	})

	t.Run("before kubeadm init", func(t *testing.T) {
		out, err := kilnctl(t, admin, "kubeconfig", "lab")
		want := "kubeconfig lab: cluster lab has no kubeconfig yet: its first control plane has not finished kubeadm init; see kilnctl describe cluster lab"
		if !errdefs.IsFailedPrecondition(err) || err.Error() != want || out != "" {
			t.Errorf("kilnctl kubeconfig lab (not initialised) = %q, %v, want FailedPrecondition %q", out, err, want)
		}
	})

	// Seal the credentials the way the cluster executor does after init.
	b, err := json.Marshal(clusterexec.Bootstrap{JoinToken: "abcdef.0123456789abcdef", CertificateKey: "00ff", Kubeconfig: testKubeconfig, APIServerEndpoint: "10.44.0.10:6443"})
	require.NoError(t, err)
	require.NoError(t, env.Store().PutSecret(context.Background(), clusterexec.BootstrapSecretPath("lab"), b))

	t.Run("stdout", func(t *testing.T) {
		if out := mustKilnctl(t, admin, "kubeconfig", "lab"); out != testKubeconfig {
			t.Errorf("kilnctl kubeconfig lab =\n%s\nwant the sealed kubeconfig\n%s", out, testKubeconfig)
		}
	})

	t.Run("-o writes the file 0600 and replaces an old one", func(t *testing.T) {
		dir := t.TempDir()
		f := filepath.Join(dir, "lab.kubeconfig")
		require.NoError(t, os.WriteFile(f, []byte("stale\n"), 0o644))
		out, stderr, err := run(t, map[string]string{"KILNCONFIG": admin}, "kubeconfig", "lab", "-o", f)
		require.NoError(t, err)
		if out != "" || !strings.Contains(stderr, "wrote the admin kubeconfig of cluster lab to "+f) {
			t.Errorf("kilnctl kubeconfig lab -o FILE printed stdout %q, stderr %q; want nothing on stdout and a note on stderr", out, stderr)
		}
		got, err := os.ReadFile(f)
		require.NoError(t, err)
		if string(got) != testKubeconfig {
			t.Errorf("%s =\n%s\nwant the sealed kubeconfig", f, got)
		}
		fi, err := os.Stat(f)
		require.NoError(t, err)
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s mode = %v, want 0600", f, fi.Mode().Perm())
		}
		entries, err := os.ReadDir(dir)
		require.NoError(t, err)
		if len(entries) != 1 {
			t.Errorf("%s holds %d entries after kilnctl kubeconfig -o, want only the kubeconfig (no temporary file left)", dir, len(entries))
		}

		_, err = kilnctl(t, admin, "kubeconfig", "lab", "-o", filepath.Join(dir, "missing", "k"))
		if err == nil || !strings.Contains(err.Error(), "no such file or directory") {
			t.Errorf("kilnctl kubeconfig -o <dir missing> = %v, want the write error", err)
		}
	})

	t.Run("readers and operators are refused", func(t *testing.T) {
		for role, article := range map[string]string{"reader": "a", "operator": "an"} {
			cfg := env.ConfigFor(t, role, "alice")
			f := filepath.Join(t.TempDir(), "k")
			out, err := kilnctl(t, cfg, "kubeconfig", "lab", "-o", f)
			if !errdefs.IsPermissionDenied(err) {
				t.Fatalf("kilnctl kubeconfig as %s = %v, want PermissionDenied", role, err)
			}
			for _, want := range []string{"kubeconfig lab: ", "role " + role + " (alice)", "it needs the admin role",
				"hint: kilnconfig " + cfg + " holds " + article + " " + role + ` certificate for "alice"; a cluster's kubeconfig needs an admin certificate`} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("kilnctl kubeconfig as %s = %q, want it to contain %q", role, err, want)
				}
			}
			if out != "" {
				t.Errorf("kilnctl kubeconfig as %s printed %q", role, out)
			}
			if _, err := os.Stat(f); !os.IsNotExist(err) {
				t.Errorf("kilnctl kubeconfig as %s: %s exists (%v), want no file", role, f, err)
			}
		}
	})

	t.Run("describe names who fetched it, never the kubeconfig", func(t *testing.T) {
		out := mustKilnctl(t, admin, "describe", "cluster", "lab")
		if !strings.Contains(out, "KubeconfigFetched") || !strings.Contains(out, "admin kubeconfig fetched by admin") {
			t.Errorf("kilnctl describe cluster lab =\n%s\nwant a KubeconfigFetched event", out)
		}
		if strings.Contains(out, "S0VZLU1BUktFUi05ZDQx") {
			t.Errorf("kilnctl describe cluster lab shows the kubeconfig:\n%s", out)
		}
		if strings.Contains(env.Logs(), "S0VZLU1BUktFUi05ZDQx") {
			t.Errorf("the controller logged the kubeconfig")
		}
	})
}
