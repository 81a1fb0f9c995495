package ociarchive_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/imagebuilder/ociarchive"
	"github.com/kilnhq/kiln/imagebuilder/ociarchive/ociarchivetest"
	"github.com/kilnhq/kiln/internal/testenv"
)

// TestImportAndRun imports an archive into a real containerd and runs its
// entrypoint: the binary must start and read a file from the layer.
func TestImportAndRun(t *testing.T) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		testenv.Skip(t, "needs the go command to build a static test binary")
	}
	sock := ociarchivetest.StartContainerd(t)

	src := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(src, "go.mod"), []byte("module hello\n\ngo 1.24\n"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(src, "main.go"), []byte(`package main

import (
	"fmt"
	"os"
)

func main() {
	b, err := os.ReadFile("/etc/kiln-marker")
	fmt.Printf("marker=%s err=%v", b, err)
}
`), 0o644))
	bin := filepath.Join(src, "hello")
	build := exec.Command(goTool, "build", "-o", bin, ".")
	build.Dir = src
	build.Env = append(os.Environ(), "CGO_ENABLED=0", "GOWORK=off", "GOFLAGS=-mod=mod")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "go build:\n%s", out)

	const ref = "registry.kiln.test/hello:v1.0.0"
	archive := filepath.Join(t.TempDir(), "hello.tar")
	_, err = ociarchive.WriteFile(archive, ociarchive.Image{
		Ref:        ref,
		Entrypoint: []string{"/usr/local/bin/hello"},
		Files: []ociarchive.File{
			{Path: "/usr/local/bin/hello", Source: bin},
			{Path: "/etc/kiln-marker", Data: []byte("kiln")},
		},
	})
	require.NoError(t, err)

	ociarchivetest.Ctr(t, sock, "images", "import", archive)
	if got := ociarchivetest.Ctr(t, sock, "images", "ls", "-q"); !strings.Contains(got, ref) {
		t.Fatalf("ctr images ls after import = %q, want it to list %s", got, ref)
	}
	if got := ociarchivetest.Ctr(t, sock, "run", "--rm", ref, "kiln-hello"); got != "marker=kiln err=<nil>" {
		t.Errorf("ctr run %s = %q, want %q", ref, got, "marker=kiln err=<nil>")
	}
}
