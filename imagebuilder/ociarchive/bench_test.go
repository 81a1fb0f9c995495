package ociarchive

import (
	"io"
	"os"
	"path/filepath"
	"testing"
)

// BenchmarkWrite writes an image of one 64 MiB binary (the size class of
// kube-proxy) to io.Discard; reported as MB/s of layer content.
func BenchmarkWrite(b *testing.B) {
	src := filepath.Join(b.TempDir(), "bin")
	data := make([]byte, 64<<20)
	for i := range data {
		data[i] = byte(i * 7)
	}
	if err := os.WriteFile(src, data, 0o755); err != nil {
		b.Fatal(err)
	}
	img := Image{Ref: "registry.kiln.test/bench:v1", Files: []File{{Path: "/usr/local/bin/bench", Source: src}}}
	b.SetBytes(int64(len(data)))
	b.ResetTimer()
	for b.Loop() {
		if _, err := Write(io.Discard, img); err != nil {
			b.Fatal(err)
		}
	}
}
