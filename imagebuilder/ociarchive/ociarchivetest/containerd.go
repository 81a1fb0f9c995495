// Package ociarchivetest runs a private containerd for tests that import
// and run image archives: its own root, state and socket under a temporary
// directory, with CRI disabled, stopped by PID when the test ends.
package ociarchivetest

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

	"github.com/kilnhq/kiln/internal/testenv"
)

// Namespace is the containerd namespace the helpers use.
const Namespace = "kiln-test"

// StartContainerd starts a private containerd and returns its socket. It
// skips the test when not root or when containerd, ctr or runc is missing
// (Debian packages containerd and runc).
func StartContainerd(t testing.TB) string {
	t.Helper()
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root to run containerd")
	}
	for _, tool := range []string{"containerd", "ctr", "runc"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "needs %s (Debian packages containerd, runc): %v", tool, err)
		}
	}
	// A short base keeps the socket path under the 108-byte limit.
	dir, err := os.MkdirTemp("", "kiln-ctd-")
	if err != nil {
		t.Fatal(err)
	}
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
	if err := os.WriteFile(filepath.Join(dir, "config.toml"), []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	var log bytes.Buffer
	cmd := exec.Command("containerd", "--config", filepath.Join(dir, "config.toml"))
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("containerd log:\n%s", log.String())
		}
		if err := os.RemoveAll(dir); err != nil {
			t.Errorf("remove containerd dir: %v", err)
		}
	})
	// containerd answers in well under a second; the bound only stops a
	// broken start from hanging the test.
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

// Ctr runs ctr against the private containerd in Namespace and returns its
// combined output; a failure fails the test.
func Ctr(t testing.TB, sock string, args ...string) string {
	t.Helper()
	out, err := CtrErr(sock, args...)
	if err != nil {
		t.Fatalf("ctr %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// CtrErr is Ctr returning the error instead of failing the test.
func CtrErr(sock string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "ctr", append([]string{"--address", sock, "-n", Namespace}, args...)...).CombinedOutput()
	return string(out), err
}
