package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestRunBootServer runs `kiln-controller run --boot-listen` as an operator
// would and fetches from its boot server: a boot media file, an iPXE script
// for a Host of the inventory (with the printed CA hash) and a refusal for
// an unknown host; SIGTERM stops both listeners.
func TestRunBootServer(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs kiln-controller: skipped with -short")
	}
	// The deadline starts after the build: building kiln-controller cold
	// under CI's load can take longer than the whole run.
	bin := build(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dataDir, media := t.TempDir(), t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(media, "vmlinuz"), []byte("kernel"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(media, "initrd.img"), []byte("initrd"), 0o644))

	out, err := exec.Command(bin, "run", "--data-dir", t.TempDir(), "--boot-listen", "127.0.0.1:0").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "--boot-media-dir") {
		t.Errorf("run --boot-listen without --boot-media-dir = %v, %q; want an error naming --boot-media-dir", err, out)
	}

	run := exec.Command(bin, "run", "--data-dir", dataDir, "--listen", "127.0.0.1:0",
		"--boot-listen", "127.0.0.1:0", "--boot-media-dir", media, "--image-dir", t.TempDir())
	stdout, err := run.StdoutPipe()
	require.NoError(t, err)
	stderr, err := os.Create(filepath.Join(t.TempDir(), "stderr"))
	require.NoError(t, err)
	defer stderr.Close()
	run.Stderr = stderr
	require.NoError(t, run.Start())
	exited := make(chan error, 1)
	go func() { exited <- run.Wait() }()
	t.Cleanup(func() {
		_ = run.Process.Kill()
		<-exited
	})
	type printed struct{ hash, boot string }
	lines := make(chan printed, 1)
	go func() {
		var p printed
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if h, ok := strings.CutPrefix(sc.Text(), "CA hash: "); ok {
				p.hash = h
			}
			if b, ok := strings.CutPrefix(sc.Text(), "boot server: "); ok {
				p.boot = b
				lines <- p
			}
		}
	}()
	var p printed
	select {
	case p = <-lines:
	case err := <-exited:
		t.Fatalf("kiln-controller run exited: %v", err)
	case <-ctx.Done():
		t.Fatalf("kiln-controller run printed no boot server address")
	}

	get := func(path string) (int, string) {
		t.Helper()
		resp, err := http.Get(p.boot + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(b)
	}
	if code, body := get("/boot/files/vmlinuz"); code != http.StatusOK || body != "kernel" {
		t.Errorf("GET /boot/files/vmlinuz = %d %q, want 200 \"kernel\"", code, body)
	}
	if code, _ := get("/boot/ipxe/rack9-01"); code != http.StatusNotFound {
		t.Errorf("GET /boot/ipxe/rack9-01 (not in the inventory) = %d, want 404", code)
	}
	_, err = resources(t, filepath.Join(dataDir, "kilnconfig-admin.yaml")).Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{
		{Kind: &controllerv1.Resource_Host{Host: &typesv1.Host{
			ApiVersion: "kiln.dev/v1", Kind: "Host",
			Metadata: &typesv1.ObjectMeta{Name: "rack9-01"},
			Spec:     &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "none"}, BootMac: "52:54:00:00:09:01"},
		}}},
	}})
	require.NoError(t, err)
	code, script := get("/boot/ipxe/rack9-01")
	if code != http.StatusOK || !strings.Contains(script, "kiln.ca_hash="+p.hash+" ") || !strings.Contains(script, "kiln.token=") {
		t.Errorf("GET /boot/ipxe/rack9-01 = %d\n%s\nwant a script with kiln.ca_hash=%s and a token", code, script, p.hash)
	}

	require.NoError(t, run.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-exited:
		require.NoError(t, err, "kiln-controller run after SIGTERM")
		exited <- nil
	case <-ctx.Done():
		t.Fatalf("kiln-controller did not exit after SIGTERM")
	}
	if _, err := http.Get(p.boot + "/boot/files/vmlinuz"); err == nil {
		t.Errorf("the boot server still answers after the controller stopped")
	}
}
