package fleet

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/internal/testenv"
)

// benchAgent builds the agent as the tests do (no VCS stamp), so the warm
// benchmark hits the entry the tests built.
func benchAgent(b *testing.B) string {
	b.Helper()
	if os.Geteuid() != 0 {
		testenv.Skip(b, "building an image needs root")
	}
	if _, err := (kubetools.Cache{Dir: filepath.Join(rootfs.CacheRoot(), "kube-tools")}).Verify(kubetools.Pinned()); err != nil {
		testenv.Skipf(b, "kube-tools cache incomplete: %v", err)
	}
	dst := filepath.Join(b.TempDir(), "kiln-agent")
	cmd := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-trimpath", "-buildvcs=false", "-o", dst, "github.com/kilnhq/kiln/cmd/kiln-agent")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("go build kiln-agent: %v: %s", err, out)
	}
	return dst
}

// BenchmarkLabImageWarm is a LabImage call whose entry is cached: key
// (hashing the spec, the agent and the kube-tools manifest) and manifest
// read.
func BenchmarkLabImageWarm(b *testing.B) {
	agent := benchAgent(b)
	ctx := context.Background()
	if _, _, err := LabImage(ctx, ImageOptions{Agent: agent}); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for b.Loop() {
		if _, _, err := LabImage(ctx, ImageOptions{Agent: agent}); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLabImageCold builds the lab image into an empty cache (the
// rootfs cache entry as it is: warm after the first run).
func BenchmarkLabImageCold(b *testing.B) {
	agent := benchAgent(b)
	ctx := context.Background()
	for b.Loop() {
		dir := b.TempDir()
		_, m, err := LabImage(ctx, ImageOptions{Agent: agent, CacheDir: dir})
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(float64(m.DataSize()>>20), "MiB-data")
		b.ReportMetric(float64(m.CompressedSize>>20), "MiB-zstd")
		_ = os.RemoveAll(dir)
	}
}
