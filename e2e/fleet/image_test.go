package fleet

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/imagebuilder/spec"
	"github.com/kilnhq/kiln/internal/errdefs"
)

func TestImageKey(t *testing.T) {
	s, err := spec.Load(DefaultLabSpec())
	require.NoError(t, err)
	require.NoError(t, s.Validate(kubetools.Pinned().Kubernetes), "examples/images/lab.yaml")
	b, err := os.ReadFile(DefaultLabSpec())
	require.NoError(t, err)
	rel := kubetools.Pinned()
	agent := strings.Repeat("a", 64)
	k := ImageKey(b, s, agent, rel, []byte("{}"))
	if !isKey(k) || ImageKey(b, s, agent, rel, []byte("{}")) != k {
		t.Fatalf("ImageKey = %q, want 16 hex digits, the same for the same inputs", k)
	}
	other := rel
	other.Kubernetes = "v1.34.3"
	s2, err := spec.Parse(b)
	require.NoError(t, err)
	s2.Slim = false // what the builder bakes differs, the file does not
	for name, got := range map[string]string{
		"spec file":      ImageKey(append([]byte("# edited\n"), b...), s, agent, rel, []byte("{}")),
		"agent":          ImageKey(b, s, strings.Repeat("b", 64), rel, []byte("{}")),
		"kubernetes":     ImageKey(b, s, agent, other, []byte("{}")),
		"kube-tools":     ImageKey(b, s, agent, rel, []byte(`{"rebuilt":true}`)),
		"builder digest": ImageKey(b, s2, agent, rel, []byte("{}")),
	} {
		if got == k {
			t.Errorf("ImageKey does not change with the %s", name)
		}
	}
}

func TestLabImageErrors(t *testing.T) {
	ctx := context.Background()
	_, _, err := LabImage(ctx, ImageOptions{Spec: filepath.Join(t.TempDir(), "missing.yaml")})
	if err == nil || !strings.Contains(err.Error(), "missing.yaml") {
		t.Errorf("LabImage(missing spec) = %v, want the file named", err)
	}
	_, _, err = LabImage(ctx, ImageOptions{Agent: filepath.Join(t.TempDir(), "no-agent"), CacheDir: t.TempDir()})
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "no-agent") {
		t.Errorf("LabImage(missing agent) = %v, want InvalidArgument naming it", err)
	}
	agent := filepath.Join(t.TempDir(), "kiln-agent")
	require.NoError(t, os.WriteFile(agent, []byte("#!/bin/sh\n"), 0o755))
	_, _, err = LabImage(ctx, ImageOptions{Agent: agent, CacheDir: t.TempDir(), KubeTools: kubetools.Cache{Dir: t.TempDir()}})
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "make kube-tools") {
		t.Errorf("LabImage(no kube-tools) = %v, want FailedPrecondition saying how to build them", err)
	}
}

func TestPrune(t *testing.T) {
	dir := t.TempDir()
	now := time.Now()
	// Last used 1 h, 2 h, ... 5 h ago; "notakey" and a build in progress
	// are not entries.
	names := []string{"000000000000000a", "000000000000000b", "000000000000000c", "000000000000000d", "000000000000000e"}
	for i, name := range append(names, ".tmp-0123456789abcdef-1", "notakey") {
		require.NoError(t, os.Mkdir(filepath.Join(dir, name), 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, name+".lock"), nil, 0o644))
		used := now.Add(-time.Duration(i+1) * time.Hour)
		require.NoError(t, os.Chtimes(filepath.Join(dir, name), used, used))
	}
	touch(filepath.Join(dir, "000000000000000e")) // used just now
	// Keep 3: the new entry, then the two most recently used (e, a);
	// of the rest, those unused for 150 min go (c, d), b stays.
	removed := prune(dir, "ffffffffffffffff", 3, now.Add(-150*time.Minute))
	var got []string
	for _, r := range removed {
		got = append(got, filepath.Base(r))
	}
	slices.Sort(got)
	if want := []string{"000000000000000c", "000000000000000d"}; !slices.Equal(got, want) {
		t.Errorf("prune removed %v, want %v", got, want)
	}
	for name, want := range map[string]bool{
		"000000000000000a": true, "000000000000000b": true, "000000000000000e": true,
		"000000000000000c": false, "000000000000000c.lock": false, "000000000000000d": false,
		".tmp-0123456789abcdef-1": true, "notakey": true,
	} {
		_, err := os.Stat(filepath.Join(dir, name))
		if (err == nil) != want {
			t.Errorf("after prune %s present = %v, want %v", name, err == nil, want)
		}
	}
}
