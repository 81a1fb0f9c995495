package golden

import (
	"context"
	"crypto/rand"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/kilnhq/kiln/imagebuilder/spec"
	"github.com/kilnhq/kiln/internal/testenv"
)

// BenchmarkBuildMinimalWarm builds the minimal image with a warm rootfs
// cache: the CI image's cost. Run with:
//
//	go test -run '^$' -bench BuildMinimalWarm -benchtime 3x ./imagebuilder/golden
func BenchmarkBuildMinimalWarm(b *testing.B) {
	s, err := spec.Parse([]byte("minimal: true\nsourceDateEpoch: 1764633600\nagent: /unused\n"))
	if err != nil {
		b.Fatal(err)
	}
	if os.Geteuid() != 0 || !isDir(RootfsSpec(s, "").Dir()) {
		testenv.Skip(b, "needs root and a warm rootfs cache (run TestBuildMinimal first)")
	}
	agent, err := os.Executable() // any executable: the agent's content does not change the cost
	if err != nil {
		b.Fatal(err)
	}
	s.Agent = agent
	var raw, data uint64
	for b.Loop() {
		out := b.TempDir()
		res, err := Build(context.Background(), Options{Spec: s, OutDir: out, Getenv: func(string) string { return "" }})
		if err != nil {
			b.Fatal(err)
		}
		raw, data = res.Manifest.RawSize, res.Manifest.DataSize()
		os.RemoveAll(out)
	}
	b.ReportMetric(float64(raw>>20), "rawMiB")
	b.ReportMetric(float64(data>>20), "dataMiB")
}

// BenchmarkCompress measures zstd + both sha256 over a 512 MiB sparse
// image with 128 MiB of incompressible data: bytes/s of raw input.
//
//	go test -run '^$' -bench Compress -benchtime 3x ./imagebuilder/golden
func BenchmarkCompress(b *testing.B) {
	dir := b.TempDir()
	raw := filepath.Join(dir, "disk.raw")
	f, err := os.Create(raw)
	if err != nil {
		b.Fatal(err)
	}
	const size, data = 512 << 20, 128 << 20
	if err := f.Truncate(size); err != nil {
		b.Fatal(err)
	}
	for off := int64(0); off < data; off += 4 << 20 {
		// data in every other 4 MiB, like a filesystem's scattered blocks
		if _, err := io.CopyN(io.NewOffsetWriter(f, off*2), rand.Reader, 4<<20); err != nil {
			b.Fatal(err)
		}
	}
	f.Close()
	b.SetBytes(size)
	for b.Loop() {
		if _, err := compress(context.Background(), raw, filepath.Join(dir, "disk.raw.zst")); err != nil {
			b.Fatal(err)
		}
	}
}
