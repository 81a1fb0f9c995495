// Package bootmediatest builds real boot media for tests: a static
// kiln-agent from this repository and the kernel, initramfs and ISO of
// package bootmedia. Tests skip when the kernel package or a tool cannot be
// had.
package bootmediatest

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/kilnhq/kiln/imagebuilder/bootmedia"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

// SkipIfUnavailable skips the test when err says that a kernel package or
// a tool needed to build boot media cannot be had on this machine.
func SkipIfUnavailable(t testing.TB, err error) {
	t.Helper()
	if errdefs.IsNotFound(err) || errdefs.IsUnavailable(err) {
		testenv.Skipf(t, "boot media cannot be built here: %v", err)
	}
}

// BuildAgent builds a static kiln-agent (CGO_ENABLED=0) into dir and
// returns its path.
func BuildAgent(t testing.TB, dir string) string {
	t.Helper()
	if _, err := exec.LookPath("go"); err != nil {
		testenv.Skip(t, "go is not on PATH: cannot build the agent")
	}
	_, file, _, _ := runtime.Caller(0)
	repo := filepath.Join(filepath.Dir(file), "..", "..", "..")
	out := filepath.Join(dir, "kiln-agent")
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", out, "./cmd/kiln-agent")
	cmd.Dir = repo
	cmd.Env = append(cmd.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/kiln-agent: %v\n%s", err, b)
	}
	return out
}

// CacheDir is the kernel cache for tests: the default one
// (${KILN_CACHE:-/var/cache/kiln}/bootmedia) when it is writable, else a
// directory of the test (the kernel is then downloaded again).
func CacheDir(t testing.TB) string {
	t.Helper()
	dir := bootmedia.DefaultCacheDir()
	if err := os.MkdirAll(dir, 0o755); err == nil {
		if f, err := os.CreateTemp(dir, ".probe-"); err == nil {
			f.Close()
			os.Remove(f.Name())
			return dir
		}
	}
	return t.TempDir()
}

// Build builds boot media with a freshly built agent into dir (kernel
// from the default cache) and returns the manifest. It skips the test
// when the media cannot be built here.
func Build(t testing.TB, dir string) *bootmedia.Manifest {
	t.Helper()
	agent := BuildAgent(t, t.TempDir())
	m, err := bootmedia.Build(context.Background(), bootmedia.Spec{AgentBinary: agent, OutDir: dir, CacheDir: CacheDir(t)}, func(l string) { t.Log(l) })
	SkipIfUnavailable(t, err)
	if err != nil {
		t.Fatalf("bootmediatest: %v", err)
	}
	return m
}
