package netns

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/imagebuilder/disk"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/internal/testenv"
)

// BenchmarkBootAgent measures a PXE power-on (the boot agent process in
// the host's namespaces) and a hard power-off.
func BenchmarkBootAgent(b *testing.B) {
	if os.Geteuid() != 0 {
		testenv.Skip(b, "needs root")
	}
	ctx := context.Background()
	m, err := New(ctx, Options{Name: "bench1", Lab: testLab(), StateDir: filepath.Join(b.TempDir(), "h"),
		Agent: Agent{Command: []string{"sleep", "infinity"}}})
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close(ctx)
	for b.Loop() {
		if err := m.PowerOn(ctx, machine.BootPXE); err != nil {
			b.Fatal(err)
		}
		if err := m.PowerOff(ctx, false); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDiskBoot measures a disk power-on to systemd "running" and a
// graceful power-off (D-Bus poweroff.target), reported separately.
func BenchmarkDiskBoot(b *testing.B) {
	if os.Geteuid() != 0 {
		testenv.Skip(b, "needs root")
	}
	if _, err := exec.LookPath("systemd-nspawn"); err != nil {
		testenv.Skip(b, "systemd-nspawn not installed")
	}
	ctx := context.Background()
	root, err := rootfs.Build(ctx, rootfs.Spec{Packages: []string{"procps"}}, nil)
	if err != nil {
		b.Fatal(err)
	}
	state := filepath.Join(b.TempDir(), "h")
	if err := os.MkdirAll(state, 0o700); err != nil {
		b.Fatal(err)
	}
	if _, err := disk.Build(ctx, disk.Spec{RootDir: root, Output: filepath.Join(state, "disk.raw")}, nil); err != nil {
		b.Fatal(err)
	}
	m, err := New(ctx, Options{Name: "bench2", Lab: testLab(), StateDir: state})
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close(ctx)
	var boot, off time.Duration
	for b.Loop() {
		t0 := time.Now()
		if err := m.PowerOn(ctx, machine.BootDisk); err != nil {
			b.Fatal(err)
		}
		for {
			cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			s, err := m.SystemState(cctx)
			cancel()
			if err == nil && (s == "running" || s == "degraded") {
				break
			}
			if time.Since(t0) > 2*time.Minute {
				b.Fatalf("not running after 2 min (state %q, %v)", s, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
		t1 := time.Now()
		if err := m.PowerOff(ctx, true); err != nil {
			b.Fatal(err)
		}
		boot += t1.Sub(t0)
		off += time.Since(t1)
	}
	b.ReportMetric(boot.Seconds()/float64(b.N), "s-to-running/op")
	b.ReportMetric(off.Seconds()/float64(b.N), "s-poweroff/op")
}
