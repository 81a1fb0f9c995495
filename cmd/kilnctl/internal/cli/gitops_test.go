package cli

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-git/go-git/v5"
	"github.com/go-git/go-git/v5/plumbing"
	"github.com/go-git/go-git/v5/plumbing/object"
	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/internal/errdefs"
)

func edgeCluster(name, env string, workers int) string {
	return fmt.Sprintf(`apiVersion: kiln.dev/v1
kind: Cluster
metadata:
  name: %[1]s
  labels:
    env: %[2]s
spec:
  kubernetesVersion: v1.34.4
  podCidr: 10.244.0.0/16
  serviceCidr: 10.96.0.0/12
  controlPlaneEndpoint: 127.0.0.1:6443
---
apiVersion: kiln.dev/v1
kind: MachineDeployment
metadata:
  name: %[1]s-workers
  labels:
    env: %[2]s
spec:
  cluster: %[1]s
  replicas: %[3]d
  version: v1.34.4
  imageSelector:
    os: debian12
  hostSelector:
    site: %[1]s
`, name, env, workers)
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	require.NoError(t, os.WriteFile(path, []byte(content), 0o644))
}

// TestDiffAndPrune drives kilnctl diff and apply --prune against a real
// controller: diff's exit statuses and output, that diff stores nothing,
// that prune deletes only what the selector matches and the files no
// longer name, and who may prune.
func TestDiffAndPrune(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	env := controllertest.Start(t)
	operator := env.ConfigFor(t, "operator", "olga")
	reader := env.ConfigFor(t, "reader", "rita")
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "edge", "edge-1.yaml"), edgeCluster("edge-1", "edge", 2))
	writeFile(t, filepath.Join(dir, "edge", "edge-2.yaml"), edgeCluster("edge-2", "edge", 2))
	other := filepath.Join(t.TempDir(), "prod-1.yaml")
	writeFile(t, other, edgeCluster("prod-1", "prod", 2))
	mustKilnctl(t, operator, "apply", "-R", "-f", dir)
	mustKilnctl(t, operator, "apply", "-f", other)

	t.Run("diff of applied files is empty, exit 0", func(t *testing.T) {
		out, err := kilnctl(t, operator, "diff", "-R", "-f", dir)
		if err != nil || out != "" {
			t.Fatalf("kilnctl diff = %q, %v (exit %d), want no output, exit 0", out, err, ExitCode(err))
		}
	})

	t.Run("diff shows a change and a creation, exit 1, stores nothing", func(t *testing.T) {
		writeFile(t, filepath.Join(dir, "edge", "edge-2.yaml"), edgeCluster("edge-2", "edge", 3))
		writeFile(t, filepath.Join(dir, "edge", "edge-3.yaml"), edgeCluster("edge-3", "edge", 1))
		before := mustKilnctl(t, operator, "get", "md", "edge-2-workers", "-o", "yaml")
		out, err := kilnctl(t, operator, "diff", "-R", "-f", dir)
		if !errors.Is(err, ErrDiffers) || ExitCode(err) != 1 {
			t.Fatalf("kilnctl diff = %v (exit %d), want ErrDiffers, exit 1", err, ExitCode(err))
		}
		t.Logf("kilnctl diff:\n%s", out)
		for _, want := range []string{
			"--- live/machinedeployment/edge-2-workers\n+++ file/machinedeployment/edge-2-workers\n",
			"-  replicas: 2\n+  replicas: 3\n",
			"+++ file/cluster/edge-3\n",
			"+  name: edge-3\n",
		} {
			require.Contains(t, out, want)
		}
		require.NotContains(t, out, "edge-1", "unchanged objects print nothing")
		// Nothing was stored: the deployment has its old resource version
		// and edge-3 does not exist.
		require.Equal(t, before, mustKilnctl(t, operator, "get", "md", "edge-2-workers", "-o", "yaml"))
		_, err = kilnctl(t, operator, "get", "cluster", "edge-3")
		require.True(t, errdefs.IsNotFound(err), "diff created edge-3: get = %v", err)
	})

	t.Run("diff of a file apply refuses fails, exit 2", func(t *testing.T) {
		bad := filepath.Join(t.TempDir(), "bad.yaml")
		writeFile(t, bad, strings.Replace(edgeCluster("edge-1", "edge", 2), "10.244.0.0/16", "10.250.0.0/16", 1))
		_, err := kilnctl(t, operator, "diff", "-f", bad)
		if ExitCode(err) != 2 || !strings.Contains(err.Error(), "spec.podCidr: cannot change") {
			t.Fatalf("kilnctl diff of a podCidr change = %v (exit %d), want the controller's refusal, exit 2", err, ExitCode(err))
		}
	})

	// edge-1 leaves the directory.
	require.NoError(t, os.Remove(filepath.Join(dir, "edge", "edge-1.yaml")))

	t.Run("--prune without -l is refused and applies nothing", func(t *testing.T) {
		_, err := kilnctl(t, operator, "apply", "-R", "-f", dir, "--prune")
		if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "--prune needs -l SELECTOR") {
			t.Fatalf("apply --prune without -l = %v, want InvalidArgument saying why", err)
		}
		_, err = kilnctl(t, operator, "get", "cluster", "edge-3")
		require.True(t, errdefs.IsNotFound(err))
	})

	t.Run("a reader may not prune; nothing is applied", func(t *testing.T) {
		_, err := kilnctl(t, reader, "apply", "-R", "-f", dir, "--prune", "-l", "env=edge")
		if !errdefs.IsPermissionDenied(err) {
			t.Fatalf("apply --prune as a reader = %v, want PermissionDenied", err)
		}
		_, err = kilnctl(t, operator, "get", "cluster", "edge-3")
		require.True(t, errdefs.IsNotFound(err))
	})

	t.Run("diff --prune and apply --prune --dry-run list the prunes", func(t *testing.T) {
		out, err := kilnctl(t, operator, "diff", "-R", "-f", dir, "--prune", "-l", "env=edge")
		require.ErrorIs(t, err, ErrDiffers)
		require.Contains(t, out, "--- live/cluster/edge-1\n+++ file/cluster/edge-1\n")
		require.Contains(t, out, "-  name: edge-1\n")
		out = mustKilnctl(t, operator, "apply", "-R", "-f", dir, "--prune", "-l", "env=edge", "--dry-run")
		for _, want := range []string{"cluster/edge-1 pruned (dry run)", "machinedeployment/edge-1-workers pruned (dry run)", "cluster/edge-3 created (dry run)", "machinedeployment/edge-2-workers configured (dry run)"} {
			require.Contains(t, out, want)
		}
		require.NotContains(t, out, "prod-1")
		mustKilnctl(t, operator, "get", "cluster", "edge-1")
	})

	t.Run("apply --prune deletes only what the selector matches", func(t *testing.T) {
		out := mustKilnctl(t, operator, "apply", "-R", "-f", dir, "--prune", "-l", "env=edge")
		t.Logf("kilnctl apply --prune:\n%s", out)
		require.Contains(t, out, "cluster/edge-1 pruned\n")
		require.Contains(t, out, "machinedeployment/edge-1-workers pruned\n")
		_, err := kilnctl(t, operator, "get", "cluster", "edge-1")
		require.True(t, errdefs.IsNotFound(err), "edge-1 not pruned: %v", err)
		// prod-1 is not named by the files but has env=prod: untouched.
		mustKilnctl(t, operator, "get", "cluster", "prod-1")
		mustKilnctl(t, operator, "get", "md", "prod-1-workers")
		mustKilnctl(t, operator, "get", "cluster", "edge-3")
		out, err = kilnctl(t, operator, "diff", "-R", "-f", dir, "--prune", "-l", "env=edge")
		require.NoError(t, err, "after apply --prune, diff --prune = %q", out)
	})
}

// TestGitSourceAdminOnly: the controller applies a GitSource with its own
// authority, so only an admin may write one; an admin's source is synced
// by the running controller (the leader's executor).
func TestGitSourceAdminOnly(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	repoDir := t.TempDir()
	env := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) { c.GitFileRoots = []string{repoDir} }))
	admin := env.AdminConfigPath
	operator := env.ConfigFor(t, "operator", "olga")

	repo, err := git.PlainInitWithOptions(repoDir, &git.PlainInitOptions{InitOptions: git.InitOptions{DefaultBranch: plumbing.NewBranchReferenceName("main")}})
	require.NoError(t, err)
	writeFile(t, filepath.Join(repoDir, "clusters", "edge-9.yaml"), edgeCluster("edge-9", "edge", 1))
	wt, err := repo.Worktree()
	require.NoError(t, err)
	_, err = wt.Add("clusters/edge-9.yaml")
	require.NoError(t, err)
	commit, err := wt.Commit("edge-9", &git.CommitOptions{Author: &object.Signature{Name: "t", Email: "t@example.com", When: time.Now()}})
	require.NoError(t, err)

	src := filepath.Join(t.TempDir(), "gs.yaml")
	writeFile(t, src, fmt.Sprintf("apiVersion: kiln.dev/v1\nkind: GitSource\nmetadata:\n  name: fleet\nspec:\n  url: file://%s\n  branch: main\n  path: clusters\n  interval: 1s\n", repoDir))

	_, err = kilnctl(t, operator, "apply", "-f", src)
	if !errdefs.IsPermissionDenied(err) || !strings.Contains(err.Error(), "only the admin role") {
		t.Fatalf("apply GitSource as an operator = %v, want PermissionDenied naming the admin role", err)
	}
	_, err = kilnctl(t, operator, "get", "gitsource", "fleet")
	require.True(t, errdefs.IsNotFound(err))

	mustKilnctl(t, admin, "apply", "-f", src)
	require.Eventually(t, func() bool {
		out, err := kilnctl(t, admin, "get", "gitsource", "fleet", "-o", "yaml")
		return err == nil && strings.Contains(out, commit.String())
	}, 30*time.Second, 200*time.Millisecond, "the controller did not apply commit %s", commit)
	t.Logf("kilnctl get gitsources:\n%s", mustKilnctl(t, operator, "get", "gitsources"))
	out := mustKilnctl(t, operator, "get", "cluster", "edge-9", "-o", "yaml")
	require.Contains(t, out, "kiln.dev/gitsource: fleet")

	_, err = kilnctl(t, operator, "delete", "gitsource", "fleet")
	if !errdefs.IsPermissionDenied(err) {
		t.Fatalf("delete GitSource as an operator = %v, want PermissionDenied", err)
	}
	// The audit log names the source as the writer of edge-9.
	out = mustKilnctl(t, admin, "audit", "--kind", "Cluster")
	require.Contains(t, out, "gitsource/fleet")

	// A repository outside --gitsource-file-root is not read, even by an
	// admin's GitSource, and its status says why.
	escape := filepath.Join(t.TempDir(), "escape.yaml")
	writeFile(t, escape, "apiVersion: kiln.dev/v1\nkind: GitSource\nmetadata:\n  name: escape\nspec:\n  url: file:///etc\n  branch: main\n  interval: 1s\n")
	mustKilnctl(t, admin, "apply", "-f", escape)
	require.Eventually(t, func() bool {
		out, err := kilnctl(t, admin, "describe", "gitsource", "escape")
		return err == nil && strings.Contains(out, "--gitsource-file-root")
	}, 30*time.Second, 200*time.Millisecond, "the refusal of file:///etc in the GitSource's status")
	t.Logf("kilnctl describe gitsource escape:\n%s", mustKilnctl(t, admin, "describe", "gitsource", "escape"))
}
