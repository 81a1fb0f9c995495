package ociarchive

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// startContainerd runs a private containerd (own root, state and socket
// under a temporary directory, CRI disabled) and returns its socket. It is
// stopped by PID when the test ends.
func startContainerd(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to run containerd")
	}
	for _, tool := range []string{"containerd", "ctr", "runc"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (Debian packages containerd, runc): %v", tool, err)
		}
	}
	// A short base keeps the socket path under the 108-byte limit.
	dir, err := os.MkdirTemp("", "kiln-ctd-")
	require.NoError(t, err)
	sock := filepath.Join(dir, "containerd.sock")
	cfg := fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = %q
[ttrpc]
  address = %q
[debug]
  address = ""
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), sock, sock+".ttrpc")
	require.NoError(t, os.WriteFile(filepath.Join(dir, "config.toml"), []byte(cfg), 0o600))
	var log bytes.Buffer
	cmd := exec.Command("containerd", "--config", filepath.Join(dir, "config.toml"))
	cmd.Stdout, cmd.Stderr = &log, &log
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("containerd log:\n%s", log.String())
		}
		require.NoError(t, os.RemoveAll(dir))
	})
	// Wait for the socket to answer (containerd starts in well under a
	// second; the bound only stops a broken start from hanging the test).
	for i := 0; ; i++ {
		if err := exec.Command("ctr", "--address", sock, "version").Run(); err == nil {
			return sock
		}
		if i == 100 {
			t.Fatalf("containerd did not answer on %s:\n%s", sock, log.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func ctr(t *testing.T, sock string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "ctr", append([]string{"--address", sock, "-n", "kiln-test"}, args...)...).CombinedOutput()
	require.NoError(t, err, "ctr %s:\n%s", strings.Join(args, " "), out)
	return string(out)
}

// TestImportAndRun imports an archive into a real containerd and runs its
// entrypoint: the binary must start and read a file from the layer.
func TestImportAndRun(t *testing.T) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("needs the go command to build a static test binary")
	}
	sock := startContainerd(t)

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
	_, err = WriteFile(archive, Image{
		Ref:        ref,
		Entrypoint: []string{"/usr/local/bin/hello"},
		Files: []File{
			{Path: "/usr/local/bin/hello", Source: bin},
			{Path: "/etc/kiln-marker", Data: []byte("kiln")},
		},
	})
	require.NoError(t, err)

	ctr(t, sock, "images", "import", archive)
	if got := ctr(t, sock, "images", "ls", "-q"); !strings.Contains(got, ref) {
		t.Fatalf("ctr images ls after import = %q, want it to list %s", got, ref)
	}
	if got := ctr(t, sock, "run", "--rm", ref, "kiln-hello"); got != "marker=kiln err=<nil>" {
		t.Errorf("ctr run %s = %q, want %q", ref, got, "marker=kiln err=<nil>")
	}
}
