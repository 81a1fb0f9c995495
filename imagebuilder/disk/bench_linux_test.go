package disk

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/internal/testenv"
)

// BenchmarkBuildDebianRoot builds a GPT disk from the lab's cached Debian
// root (debootstrap minbase + systemd + dbus + procps).
func BenchmarkBuildDebianRoot(b *testing.B) {
	if os.Geteuid() != 0 {
		testenv.Skip(b, "needs root (debootstrap, or read the cached root)")
	}
	ctx := context.Background()
	root, err := rootfs.Build(ctx, rootfs.Spec{Packages: []string{"procps"}}, nil)
	if err != nil {
		testenv.Skip(b, err)
	}
	out := filepath.Join(b.TempDir(), "disk.raw")
	var l *Layout
	for b.Loop() {
		if l, err = Build(ctx, Spec{RootDir: root, Output: out}, nil); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(l.Size)/(1<<20), "MiB-image")
}
