// Package containerdtest runs a real containerd (Debian's, 1.6 or later)
// for a test, laid out like a host under a temporary root:
// ROOT/etc/containerd/config.toml, ROOT/run/containerd/containerd.sock,
// ROOT/var/lib/containerd. It skips the test when containerd is not
// installed or the test is not root, and stops the daemon (by its PID)
// and removes the root when the test ends.
package containerdtest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/kilnhq/kiln/host/containerd"
	"github.com/kilnhq/kiln/internal/testenv"
)

// Daemon is a containerd owned by one test.
type Daemon struct {
	t testing.TB
	// Root is the host root the daemon lives under.
	Root string
	// Config and Socket are the config file and CRI socket paths.
	Config, Socket string
	bin            string
	cmd            *exec.Cmd
	done           chan struct{}
}

// New writes a containerd config under a fresh root (its CRI plugin set up
// as these machines need: restrict_oom_score_adj, CNI in /usr/lib/cni)
// without starting the daemon. The test then edits the config and calls
// Start.
func New(t testing.TB) *Daemon {
	t.Helper()
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root to run containerd")
	}
	bin, err := exec.LookPath("containerd")
	if err != nil {
		testenv.Skip(t, "containerd not installed (Debian package containerd)")
	}
	root, err := os.MkdirTemp("", "kiln-ctd") // short: unix socket paths are limited
	if err != nil {
		t.Fatalf("MkdirTemp() error = %v", err)
	}
	d := &Daemon{
		t:      t,
		Root:   root,
		Config: filepath.Join(root, containerd.DefaultConfig),
		Socket: filepath.Join(root, containerd.DefaultSocket),
		bin:    bin,
	}
	t.Cleanup(func() {
		d.Stop()
		os.RemoveAll(root)
	})
	cfg := fmt.Sprintf(`version = 2
root = %[1]q
state = %[2]q

[grpc]
  address = %[3]q

[ttrpc]
  address = "%[3]s.ttrpc"

[debug]
  address = ""

[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    restrict_oom_score_adj = true
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = %[4]q
  [plugins."io.containerd.internal.v1.opt"]
    path = %[5]q
`, filepath.Join(root, "var/lib/containerd"), filepath.Join(root, "run/containerd"), d.Socket,
		filepath.Join(root, "etc/cni/net.d"), filepath.Join(root, "var/lib/containerd/opt"))
	for _, dir := range []string{filepath.Dir(d.Config), filepath.Dir(d.Socket), filepath.Join(root, "etc/cni/net.d")} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatalf("MkdirAll(%q) error = %v", dir, err)
		}
	}
	if err := os.WriteFile(d.Config, []byte(cfg), 0o644); err != nil {
		t.Fatalf("write containerd config: %v", err)
	}
	return d
}

// Start starts containerd with Config and waits until its CRI service
// answers.
func (d *Daemon) Start() {
	d.t.Helper()
	log, err := os.Create(filepath.Join(d.Root, "containerd.log"))
	if err != nil {
		d.t.Fatalf("create containerd log: %v", err)
	}
	defer log.Close()
	d.cmd = exec.Command(d.bin, "--config", d.Config)
	d.cmd.Stdout, d.cmd.Stderr = log, log
	if err := d.cmd.Start(); err != nil {
		d.t.Fatalf("start containerd: %v", err)
	}
	d.done = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) {
		_ = cmd.Wait()
		close(done)
	}(d.cmd, d.done)

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for {
		qctx, qcancel := context.WithTimeout(ctx, 2*time.Second)
		_, err := containerd.Query(qctx, d.Socket)
		qcancel()
		if err == nil {
			return
		}
		select {
		case <-d.done:
			b, _ := os.ReadFile(filepath.Join(d.Root, "containerd.log"))
			d.t.Fatalf("containerd exited at start:\n%s", b)
		case <-ctx.Done():
			d.t.Fatalf("containerd did not answer CRI on %s: %v", d.Socket, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Stop stops containerd (SIGTERM, then SIGKILL after 10 s) if it runs.
func (d *Daemon) Stop() {
	if d.cmd == nil {
		return
	}
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.done:
	case <-time.After(10 * time.Second):
		_ = d.cmd.Process.Kill()
		<-d.done
	}
	d.cmd = nil
}

// Restart stops and starts containerd, which rereads its config.
func (d *Daemon) Restart() {
	d.t.Helper()
	d.Stop()
	d.Start()
}
