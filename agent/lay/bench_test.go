package lay

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/imagebuilder/manifest"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// benchImage writes a size-byte image into dir: dense random bytes, or
// data% of it in 1 MiB runs and holes elsewhere.
func benchImage(b *testing.B, dir string, size int64, data int) (path string, sum string) {
	b.Helper()
	path = filepath.Join(dir, "bench.raw")
	f, err := os.Create(path)
	require.NoError(b, err)
	defer f.Close()
	require.NoError(b, f.Truncate(size))
	r := rand.NewChaCha8([32]byte{2})
	buf := make([]byte, 1<<20)
	stride := int64(len(buf)) * 100 / int64(data)
	for off := int64(0); off+int64(len(buf)) <= size; off += stride {
		r.Read(buf)
		_, err := f.WriteAt(buf, off)
		require.NoError(b, err)
	}
	_, err = f.Seek(0, io.SeekStart)
	require.NoError(b, err)
	h := sha256.New()
	_, err = io.Copy(h, f)
	require.NoError(b, err)
	return path, hex.EncodeToString(h.Sum(nil))
}

func benchLay(b *testing.B, size int64, data int, useMap bool) {
	dir := b.TempDir()
	src, sum := benchImage(b, dir, size, data)
	img, err := os.ReadFile(src)
	require.NoError(b, err)
	srv := newImageServer(b, img, nil)
	dst := filepath.Join(dir, "target.img")
	req := &agentv1.LayImageRequest{Url: srv.url(), Sha256: sum, RawSize: uint64(size), Target: dst}
	if useMap {
		ranges, err := manifest.BlockMap(context.Background(), src, 4096)
		require.NoError(b, err)
		req.BlockMap, req.RawSha256, req.Sha256 = toBlockMap(ranges), sum, ""
	}
	l := New(slog.New(slog.DiscardHandler), WithFileTargets(true))
	b.SetBytes(size)
	b.ResetTimer()
	for b.Loop() {
		os.Remove(dst)
		if _, err := l.Lay(context.Background(), req, nil); err != nil {
			b.Fatal(err)
		}
	}
}

// The rate is of the raw image: MB/s of disk laid.
func BenchmarkLayDense(b *testing.B)          { benchLay(b, 256<<20, 100, false) }
func BenchmarkLayDenseMap(b *testing.B)       { benchLay(b, 256<<20, 100, true) }
func BenchmarkLaySparse20Stream(b *testing.B) { benchLay(b, 256<<20, 20, false) }
func BenchmarkLaySparse20Map(b *testing.B)    { benchLay(b, 256<<20, 20, true) }

func BenchmarkZeroSkipWriter(b *testing.B) {
	dir := b.TempDir()
	f, err := os.Create(filepath.Join(dir, "t"))
	require.NoError(b, err)
	defer f.Close()
	w := newWriter(&target{f: f, path: f.Name()}, true, 4096)
	buf := make([]byte, 1<<20) // all zeros: the check is the cost
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		if err := w.writeAt(buf, 0); err != nil {
			b.Fatal(err)
		}
	}
}
