package lay

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/imagebuilder/manifest"
	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

func hexsum(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

func fileSum(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return hexsum(b)
}

// testLayer is a Layer with tiny backoff delays and small buffers, so
// chunks cross range and drop boundaries.
func testLayer(t *testing.T, opts ...Option) *Layer {
	log := slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	base := []Option{
		WithBackoff(backoff.Policy{Base: time.Millisecond, Max: 5 * time.Millisecond, Factor: 2}),
		WithRetries(3),
		WithBufferSize(64 << 10),
		WithFileTargets(true), // the tests' targets are files, as the lab's
	}
	return New(log, append(base, opts...)...)
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// makeImage returns size bytes that look like a disk image: random data
// with runs of zero blocks, and a zero tail.
func makeImage(size int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, 1))
	b := make([]byte, size)
	for off := 0; off < size*3/4; off += 4096 {
		if r.IntN(3) == 0 {
			continue // zero block
		}
		for i := off; i < min(off+4096, size); i += 8 {
			v := r.Uint64()
			for j := 0; j < 8 && i+j < size; j++ {
				b[i+j] = byte(v >> (8 * j))
			}
		}
	}
	return b
}

func tempTarget(t *testing.T) string { return filepath.Join(t.TempDir(), "disk.img") }

func TestLayRaw(t *testing.T) {
	img := makeImage(3<<20+123, 1)
	srv := newImageServer(t, img, nil)
	dst := tempTarget(t)
	res, err := testLayer(t).Lay(context.Background(), &agentv1.LayImageRequest{
		Url: srv.url(), Sha256: hexsum(img), Format: FormatRaw, Target: dst,
	}, nil)
	require.NoError(t, err)

	if got := fileSum(t, dst); got != hexsum(img) {
		t.Errorf("Lay(raw): target sha256 = %s, want %s", got, hexsum(img))
	}
	if res.GetSha256() != hexsum(img) || res.GetBytesFetched() != uint64(len(img)) {
		t.Errorf("Lay(raw) = %+v, want sha256 %s and %d bytes fetched", res, hexsum(img), len(img))
	}
	if res.GetBytesWritten() >= uint64(len(img)) {
		t.Errorf("Lay(raw) wrote %d bytes of %d: zero blocks were not skipped", res.GetBytesWritten(), len(img))
	}
	if reqs := srv.requests(); len(reqs) != 1 {
		t.Errorf("Lay(raw) made %d requests (%q), want 1", len(reqs), reqs)
	}
}

func TestLayOverwritesOldData(t *testing.T) {
	// The target held another, larger image: nothing of it may survive
	// where the new image has zeros (the skipped blocks).
	img := makeImage(1<<20, 2)
	dst := tempTarget(t)
	old := bytes.Repeat([]byte{0xAB}, 2<<20)
	require.NoError(t, os.WriteFile(dst, old, 0o600))
	srv := newImageServer(t, img, nil)
	_, err := testLayer(t).Lay(context.Background(), &agentv1.LayImageRequest{
		Url: srv.url(), Sha256: hexsum(img), Target: dst,
	}, nil)
	require.NoError(t, err)
	got, err := os.ReadFile(dst)
	require.NoError(t, err)
	require.Len(t, got, len(old), "a file target is never shrunk")
	if !bytes.Equal(got[:len(img)], img) {
		t.Errorf("Lay over old data: image region differs from the image")
	}
	if !bytes.Equal(got[len(img):], make([]byte, len(old)-len(img))) {
		t.Errorf("Lay over old data: old bytes survive beyond the image")
	}
}

func TestLayResumesDroppedConnection(t *testing.T) {
	for _, drops := range []int64{1, 2} {
		img := makeImage(2<<20, 3)
		srv := newImageServer(t, img, func(s *imageServer) {
			s.dropAfter = 700 << 10
			s.drops.Store(drops)
		})
		dst := tempTarget(t)
		res, err := testLayer(t).Lay(context.Background(), &agentv1.LayImageRequest{
			Url: srv.url(), Sha256: hexsum(img), Target: dst,
		}, nil)
		require.NoError(t, err, "drops=%d", drops)
		if got := fileSum(t, dst); got != hexsum(img) {
			t.Errorf("Lay(drops=%d): target sha256 = %s, want %s", drops, got, hexsum(img))
		}
		if n := srv.rangeRequests(); n != int(drops) {
			t.Errorf("Lay(drops=%d): server saw %d Range requests (%q), want %d", drops, n, srv.requests(), drops)
		}
		for _, r := range srv.requests()[1:] {
			if !strings.HasPrefix(r, "bytes=") || r == "bytes=0-" {
				t.Errorf("Lay(drops=%d): resume request Range %q does not start after the received bytes", drops, r)
			}
		}
		// Resuming fetches nothing twice.
		if res.GetBytesFetched() != uint64(len(img)) {
			t.Errorf("Lay(drops=%d) fetched %d bytes, want %d", drops, res.GetBytesFetched(), len(img))
		}
	}
}

func TestLayServerIgnoresRange(t *testing.T) {
	img := makeImage(2<<20, 4)
	srv := newImageServer(t, img, func(s *imageServer) {
		s.dropAfter = 500 << 10
		s.drops.Store(1)
		s.ignoreRange = true
	})
	dst := tempTarget(t)
	var mu sync.Mutex
	var steps []string
	_, err := testLayer(t).Lay(context.Background(), &agentv1.LayImageRequest{
		Url: srv.url(), Sha256: hexsum(img), Target: dst,
	}, func(p *agentv1.Progress) { mu.Lock(); steps = append(steps, p.GetStep()); mu.Unlock() })
	require.NoError(t, err)
	if got := fileSum(t, dst); got != hexsum(img) {
		t.Errorf("Lay(ignoring Range): target sha256 = %s, want %s", got, hexsum(img))
	}
	if !strings.Contains(strings.Join(steps, "\n"), "ignored the Range request") {
		t.Errorf("Lay(ignoring Range): progress steps %q do not say the stream restarted", steps)
	}
}

func TestLayCorruptByte(t *testing.T) {
	img := makeImage(2<<20, 5)
	want := hexsum(img)
	bad := bytes.Clone(img)
	bad[1<<20+17] ^= 0x40
	srv := newImageServer(t, bad, nil)
	dst := tempTarget(t)
	_, err := testLayer(t).Lay(context.Background(), &agentv1.LayImageRequest{
		Url: srv.url(), Sha256: want, Target: dst,
	}, nil)
	require.Error(t, err)
	if msg := "sha256 mismatch: got " + hexsum(bad) + " want " + want; !strings.Contains(err.Error(), msg) {
		t.Errorf("Lay(corrupt byte) = %v, want an error containing %q", err, msg)
	}
	if !errdefs.IsFailedPrecondition(err) {
		t.Errorf("Lay(corrupt byte) = %v, want FailedPrecondition", err)
	}
	assertInvalidated(t, dst)
}

// assertInvalidated checks that a failed lay left no partition table: the
// first MiB reads as zeros.
func assertInvalidated(t *testing.T, dst string) {
	t.Helper()
	f, err := os.Open(dst)
	require.NoError(t, err)
	defer f.Close()
	head := make([]byte, 1<<20)
	n, _ := io.ReadFull(f, head)
	if !bytes.Equal(head[:n], make([]byte, n)) {
		t.Errorf("after a failed lay the first MiB of %s is not zero: the half-laid image could boot", dst)
	}
}

func TestLayWrongSha(t *testing.T) {
	img := makeImage(1<<20, 6)
	srv := newImageServer(t, img, nil)
	wrong := hexsum([]byte("another image"))
	_, err := testLayer(t).Lay(context.Background(), &agentv1.LayImageRequest{
		Url: srv.url(), Sha256: wrong, Target: tempTarget(t),
	}, nil)
	if err == nil || !strings.Contains(err.Error(), "sha256 mismatch: got "+hexsum(img)+" want "+wrong) {
		t.Errorf("Lay(wrong sha256) = %v, want sha256 mismatch", err)
	}
}

func TestLayTruncatedStream(t *testing.T) {
	img := makeImage(2<<20, 7)
	const at = 900 << 10
	srv := newImageServer(t, img, func(s *imageServer) { s.truncateAt = at })
	dst := tempTarget(t)
	_, err := testLayer(t, WithRetries(3)).Lay(context.Background(), &agentv1.LayImageRequest{
		Url: srv.url(), Sha256: hexsum(img), Target: dst,
	}, nil)
	require.Error(t, err)
	if msg := "stream truncated at 921600 of 2097152 bytes"; !strings.Contains(err.Error(), msg) {
		t.Errorf("Lay(truncated) = %v, want an error containing %q", err, msg)
	}
	if !errdefs.IsUnavailable(err) {
		t.Errorf("Lay(truncated) = %v, want Unavailable", err)
	}
	// Bounded: the first request, then at most retries reopenings (each
	// of which retryablehttp may retry as well).
	if n := len(srv.requests()); n < 2 || n > 1+3*4 {
		t.Errorf("Lay(truncated) made %d requests, want between 2 and 13", n)
	}
	assertInvalidated(t, dst)
}

func zstdCompress(t *testing.T, b []byte) []byte {
	t.Helper()
	enc, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest))
	require.NoError(t, err)
	return enc.EncodeAll(b, nil)
}

func TestLayZstd(t *testing.T) {
	img := makeImage(3<<20+5, 8)
	z := zstdCompress(t, img)
	for _, drops := range []int64{0, 2} {
		srv := newImageServer(t, z, func(s *imageServer) {
			s.dropAfter = int64(len(z) / 3)
			s.drops.Store(drops)
		})
		dst := tempTarget(t)
		res, err := testLayer(t).Lay(context.Background(), &agentv1.LayImageRequest{
			Url: srv.url(), Sha256: hexsum(z), Format: FormatRawZst, Target: dst, RawSize: uint64(len(img)),
		}, nil)
		require.NoError(t, err, "drops=%d", drops)
		if got := fileSum(t, dst); got != hexsum(img) {
			t.Errorf("Lay(raw.zst, drops=%d): target sha256 = %s, want %s", drops, got, hexsum(img))
		}
		if res.GetSha256() != hexsum(z) {
			t.Errorf("Lay(raw.zst) sha256 = %s, want the compressed stream's %s", res.GetSha256(), hexsum(z))
		}
	}
}

func TestLayZstdCorrupt(t *testing.T) {
	img := makeImage(1<<20, 9)
	z := zstdCompress(t, img)
	want := hexsum(z)
	bad := bytes.Clone(z)
	bad[len(bad)/2] ^= 0xff
	srv := newImageServer(t, bad, nil)
	_, err := testLayer(t).Lay(context.Background(), &agentv1.LayImageRequest{
		Url: srv.url(), Sha256: want, Format: FormatRawZst, Target: tempTarget(t),
	}, nil)
	// The decoder may notice first (a checksum or a bad block); either
	// way it must fail.
	require.Error(t, err, "Lay(corrupt raw.zst) succeeded")
	t.Logf("Lay(corrupt raw.zst) = %v", err)
}

// sparseImage writes a raw image of size bytes into dir whose data lies
// in runs (a run of data every stride bytes), as a sparse file, and
// returns its bytes and path.
func sparseImage(t *testing.T, size, run, stride int) ([]byte, string) {
	t.Helper()
	img := make([]byte, size)
	r := rand.New(rand.NewPCG(10, 1))
	for off := 0; off < size; off += stride {
		for i := off; i < min(off+run, size); i++ {
			img[i] = byte(r.Uint32() | 1)
		}
	}
	p := filepath.Join(t.TempDir(), "sparse.raw")
	f, err := os.Create(p)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, f.Truncate(int64(size)))
	for off := 0; off < size; off += stride {
		_, err := f.WriteAt(img[off:min(off+run, size)], int64(off))
		require.NoError(t, err)
	}
	return img, p
}

func toBlockMap(rs []manifest.Range) []*agentv1.BlockRange {
	out := make([]*agentv1.BlockRange, len(rs))
	for i, r := range rs {
		out[i] = &agentv1.BlockRange{Offset: r.Offset, Length: r.Length, Sha256: r.SHA256}
	}
	return out
}

func allocated(t *testing.T, path string) int64 {
	t.Helper()
	fi, err := os.Stat(path)
	require.NoError(t, err)
	return fi.Sys().(*syscall.Stat_t).Blocks * 512
}

func TestLayBlockMap(t *testing.T) {
	const size, run, stride = 16 << 20, 192 << 10, 1 << 20 // ~19% data
	img, src := sparseImage(t, size, run, stride)
	ranges, err := manifest.BlockMap(context.Background(), src, 4096)
	require.NoError(t, err)
	require.Len(t, ranges, size/stride)
	var data uint64
	for _, r := range ranges {
		data += r.Length
	}

	for _, gap := range []int64{0, 2 << 20} {
		srv := newImageServer(t, img, nil)
		dst := tempTarget(t)
		res, err := testLayer(t, WithCoalesceGap(gap)).Lay(context.Background(), &agentv1.LayImageRequest{
			Url: srv.url(), Target: dst, Format: FormatRaw, BlockMap: toBlockMap(ranges),
			RawSize: size, RawSha256: hexsum(img),
		}, nil)
		require.NoError(t, err, "gap=%d", gap)

		if got := fileSum(t, dst); got != hexsum(img) {
			t.Errorf("Lay(block map, gap=%d): target sha256 = %s, want %s", gap, got, hexsum(img))
		}
		sent := uint64(srv.sent.Load())
		switch gap {
		case 0:
			if sent != data {
				t.Errorf("Lay(block map, gap=0): server sent %d bytes, want exactly the %d data bytes", sent, data)
			}
			if n := len(srv.requests()); n != len(ranges) {
				t.Errorf("Lay(block map, gap=0) made %d requests, want %d", n, len(ranges))
			}
		default: // everything coalesced into one request, holes included
			if n := len(srv.requests()); n != 1 {
				t.Errorf("Lay(block map, gap=%d) made %d requests, want 1", gap, n)
			}
		}
		if res.GetBytesFetched() != sent {
			t.Errorf("Lay(block map) reports %d bytes fetched, server sent %d", res.GetBytesFetched(), sent)
		}
		// The holes are holes: the target's own block map is the source's,
		// and it holds no more blocks than the data.
		got, err := manifest.BlockMap(context.Background(), dst, 4096)
		require.NoError(t, err)
		require.Equal(t, ranges, got, "block map of the laid target")
		if a := allocated(t, dst); a > int64(data)+64<<10 {
			t.Errorf("Lay(block map): target allocates %d bytes for %d data bytes", a, data)
		}
	}
}

func TestLayBlockMapResumes(t *testing.T) {
	img, src := sparseImage(t, 8<<20, 3<<20, 4<<20)
	ranges, err := manifest.BlockMap(context.Background(), src, 4096)
	require.NoError(t, err)
	srv := newImageServer(t, img, func(s *imageServer) { s.dropAfter = 1 << 20; s.drops.Store(2) })
	dst := tempTarget(t)
	_, err = testLayer(t).Lay(context.Background(), &agentv1.LayImageRequest{
		Url: srv.url(), Target: dst, BlockMap: toBlockMap(ranges), RawSize: uint64(len(img)),
	}, nil)
	require.NoError(t, err)
	if got := fileSum(t, dst); got != hexsum(img) {
		t.Errorf("Lay(block map with drops): target sha256 = %s, want %s", got, hexsum(img))
	}
	if n := len(srv.requests()); n != len(ranges)+2 {
		t.Errorf("Lay(block map with drops) made %d requests (%q), want %d", n, srv.requests(), len(ranges)+2)
	}
}

func TestLayBlockMapCorruptRange(t *testing.T) {
	img, src := sparseImage(t, 8<<20, 256<<10, 1<<20)
	ranges, err := manifest.BlockMap(context.Background(), src, 4096)
	require.NoError(t, err)
	bad := bytes.Clone(img)
	bad[ranges[2].Offset+100] ^= 1
	srv := newImageServer(t, bad, nil)
	dst := tempTarget(t)
	_, err = testLayer(t).Lay(context.Background(), &agentv1.LayImageRequest{
		Url: srv.url(), Target: dst, BlockMap: toBlockMap(ranges), RawSize: uint64(len(img)),
	}, nil)
	require.Error(t, err)
	want := "range 2 (offset 2097152, length 262144): sha256 mismatch: got "
	if !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "want "+ranges[2].SHA256) {
		t.Errorf("Lay(block map, corrupt range 2) = %v, want an error containing %q", err, want)
	}
	assertInvalidated(t, dst)
}

func TestLayBlockMapServerIgnoresRange(t *testing.T) {
	img, src := sparseImage(t, 4<<20, 256<<10, 1<<20)
	ranges, err := manifest.BlockMap(context.Background(), src, 4096)
	require.NoError(t, err)
	srv := newImageServer(t, img, func(s *imageServer) { s.ignoreRange = true })
	req := &agentv1.LayImageRequest{Url: srv.url(), BlockMap: toBlockMap(ranges), RawSize: uint64(len(img))}

	// Without raw_sha256 there is nothing to verify a full stream with.
	req.Target = tempTarget(t)
	_, err = testLayer(t).Lay(context.Background(), req, nil)
	if err == nil || !strings.Contains(err.Error(), "Range") {
		t.Errorf("Lay(block map, no Range support, no raw_sha256) = %v, want an error about Range", err)
	}

	// With it, the whole raw image is streamed and verified.
	req.Target = tempTarget(t)
	req.RawSha256 = hexsum(img)
	_, err = testLayer(t).Lay(context.Background(), req, nil)
	require.NoError(t, err)
	if got := fileSum(t, req.Target); got != hexsum(img) {
		t.Errorf("Lay(block map fallback): target sha256 = %s, want %s", got, hexsum(img))
	}
}

func TestLayInvalidRequests(t *testing.T) {
	h := hexsum(nil)
	good := func() *agentv1.LayImageRequest {
		return &agentv1.LayImageRequest{Url: "http://127.0.0.1:1/i.raw", Sha256: h, Target: "/tmp/x", Format: FormatRaw}
	}
	tests := []struct {
		name   string
		mutate func(*agentv1.LayImageRequest)
	}{
		{"no target", func(r *agentv1.LayImageRequest) { r.Target = "" }},
		{"ftp url", func(r *agentv1.LayImageRequest) { r.Url = "ftp://host/i.raw" }},
		{"bad format", func(r *agentv1.LayImageRequest) { r.Format = "qcow2" }},
		{"short sha", func(r *agentv1.LayImageRequest) { r.Sha256 = "abc" }},
		{"map with zst", func(r *agentv1.LayImageRequest) {
			r.Format = FormatRawZst
			r.RawSize = 8192
			r.BlockMap = []*agentv1.BlockRange{{Offset: 0, Length: 4096, Sha256: h}}
		}},
		{"map without raw size", func(r *agentv1.LayImageRequest) {
			r.BlockMap = []*agentv1.BlockRange{{Offset: 0, Length: 4096, Sha256: h}}
		}},
		{"map overlap", func(r *agentv1.LayImageRequest) {
			r.RawSize = 1 << 20
			r.BlockMap = []*agentv1.BlockRange{{Offset: 0, Length: 8192, Sha256: h}, {Offset: 4096, Length: 4096, Sha256: h}}
		}},
		{"map beyond size", func(r *agentv1.LayImageRequest) {
			r.RawSize = 4096
			r.BlockMap = []*agentv1.BlockRange{{Offset: 4096, Length: 1, Sha256: h}}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := good()
			tt.mutate(r)
			_, err := testLayer(t).Lay(context.Background(), r, nil)
			if !errdefs.IsInvalidArgument(err) {
				t.Errorf("Lay(%q) = %v, want InvalidArgument", tt.name, err)
			}
		})
	}
}

func TestLayHTTPErrorsKeepSecrets(t *testing.T) {
	img := makeImage(4096, 11)
	srv := newImageServer(t, img, func(s *imageServer) { s.status = 404 })
	_, err := testLayer(t).Lay(context.Background(), &agentv1.LayImageRequest{
		Url: srv.url() + "?token=s3cr3t", Sha256: hexsum(img), Target: tempTarget(t),
	}, nil)
	if !errdefs.IsNotFound(err) {
		t.Errorf("Lay(404) = %v, want NotFound", err)
	}
	if err != nil && strings.Contains(err.Error(), "s3cr3t") {
		t.Errorf("Lay(404) = %v: the error leaks the URL's token", err)
	}

	// A refused connection: retried, then a clear error without the token.
	l := testLayer(t, WithRetries(1))
	srv.srv.Close()
	_, err = l.Lay(context.Background(), &agentv1.LayImageRequest{
		Url: srv.url() + "?token=s3cr3t", Sha256: hexsum(img), Target: tempTarget(t),
	}, nil)
	if !errdefs.IsUnavailable(err) || strings.Contains(err.Error(), "s3cr3t") {
		t.Errorf("Lay(refused) = %v, want Unavailable without the token", err)
	}
}

func TestLayMissingDevice(t *testing.T) {
	_, err := testLayer(t).Lay(context.Background(), &agentv1.LayImageRequest{
		Url: "http://127.0.0.1:1/i.raw", Sha256: hexsum(nil), Target: "/dev/kiln-no-such-disk",
	}, nil)
	if !errdefs.IsNotFound(err) {
		t.Errorf("Lay(/dev/kiln-no-such-disk) = %v, want NotFound", err)
	}
	if _, err := os.Stat("/dev/kiln-no-such-disk"); err == nil {
		os.Remove("/dev/kiln-no-such-disk")
		t.Errorf("Lay created a regular file under /dev")
	}
}

func TestLayCancelled(t *testing.T) {
	img := makeImage(4<<20, 12)
	srv := newImageServer(t, img, nil)
	ctx, cancel := context.WithCancel(context.Background())
	dst := tempTarget(t)
	_, err := testLayer(t, WithProgressInterval(0)).Lay(ctx, &agentv1.LayImageRequest{
		Url: srv.url(), Sha256: hexsum(img), Target: dst,
	}, func(p *agentv1.Progress) {
		if p.GetDoneBytes() > 0 {
			cancel()
		}
	})
	if !errorsIsCanceled(err) {
		t.Errorf("Lay(cancelled) = %v, want context.Canceled", err)
	}
}

func errorsIsCanceled(err error) bool {
	return err != nil && (strings.Contains(err.Error(), context.Canceled.Error()))
}

// fakeClock advances by step on every reading.
type fakeClock struct {
	mu   sync.Mutex
	t    time.Time
	step time.Duration
}

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(c.step)
	return c.t
}

func TestLayProgress(t *testing.T) {
	img := makeImage(4<<20, 13)
	srv := newImageServer(t, img, nil)
	clk := &fakeClock{t: time.Unix(0, 0), step: 100 * time.Millisecond}
	var got []*agentv1.Progress
	_, err := testLayer(t, WithClock(clk.now), WithProgressInterval(250*time.Millisecond)).Lay(context.Background(),
		&agentv1.LayImageRequest{Url: srv.url(), Sha256: hexsum(img), Target: tempTarget(t), RawSize: uint64(len(img))},
		func(p *agentv1.Progress) { got = append(got, p) })
	require.NoError(t, err)

	var steps []string
	var fetch []*agentv1.Progress
	for _, p := range got {
		if len(steps) == 0 || steps[len(steps)-1] != p.GetStep() {
			steps = append(steps, p.GetStep())
		}
		if p.GetStep() == StepFetch {
			fetch = append(fetch, p)
		}
	}
	require.Equal(t, []string{StepOpen, StepDiscard, StepFetch, StepVerify, StepSync, StepDone}, steps)
	// 64 buffers of 64 KiB at 100ms each: at most one report per 250ms.
	if n := len(fetch); n < 10 || n > 64/2+1 {
		t.Errorf("Lay reported fetch progress %d times for 64 buffers at 100ms each, want about one per 250ms", n)
	}
	last := fetch[len(fetch)-1]
	if last.GetTotalBytes() != uint64(len(img)) || last.GetBytesPerSecond() <= 0 || last.GetPercent() <= 0 {
		t.Errorf("last fetch progress = %v, want total %d and a rate", last, len(img))
	}
	if mid := fetch[len(fetch)/2]; mid.GetEtaSeconds() <= 0 {
		t.Errorf("mid fetch progress = %v, want an ETA", mid)
	}
}

// When the target cannot discard (a block device without discard support),
// nothing may be skipped: the target must still equal the image, old data
// gone, in both modes.
func TestLayWithoutDiscard(t *testing.T) {
	img, src := sparseImage(t, 4<<20, 256<<10, 1<<20)
	ranges, err := manifest.BlockMap(context.Background(), src, 4096)
	require.NoError(t, err)
	srv := newImageServer(t, img, nil)
	l := testLayer(t)
	log := slog.New(slog.DiscardHandler)
	lays := map[string]func(tg *target) error{
		"stream": func(tg *target) error {
			_, err := l.layStream(context.Background(), tg, srv.url(), FormatRaw, hexsum(img), int64(len(img)), false, newReporter(nil, time.Now, 0), log)
			return err
		},
		"block map": func(tg *target) error {
			req := &agentv1.LayImageRequest{Url: srv.url(), BlockMap: toBlockMap(ranges), RawSize: uint64(len(img))}
			_, err := l.layMap(context.Background(), tg, req, false, newReporter(nil, time.Now, 0), log)
			return err
		},
	}
	for name, lay := range lays {
		t.Run(name, func(t *testing.T) {
			dst := tempTarget(t)
			require.NoError(t, os.WriteFile(dst, bytes.Repeat([]byte{0xAB}, len(img)), 0o600))
			tg, err := openTarget(dst, false, true)
			require.NoError(t, err)
			defer tg.Close()
			require.NoError(t, lay(tg))
			if got := fileSum(t, dst); got != hexsum(img) {
				t.Errorf("lay %s without discard: target sha256 = %s, want %s (old data left in the holes?)", name, got, hexsum(img))
			}
		})
	}
}

func TestLayResumesStalledConnection(t *testing.T) {
	img := makeImage(2<<20, 14)
	srv, calls := stallServer(t, img)
	dst := tempTarget(t)
	_, err := testLayer(t, WithStallTimeout(100*time.Millisecond)).Lay(context.Background(), &agentv1.LayImageRequest{
		Url: srv.URL + "/image.raw", Sha256: hexsum(img), Target: dst,
	}, nil)
	require.NoError(t, err)
	if got := fileSum(t, dst); got != hexsum(img) {
		t.Errorf("Lay(stalled server): target sha256 = %s, want %s", got, hexsum(img))
	}
	if n := calls.Load(); n != 2 {
		t.Errorf("Lay(stalled server) made %d requests, want 2 (the stalled one, then a resume)", n)
	}
}

func TestLayBusyTarget(t *testing.T) {
	img := makeImage(4<<20, 15)
	srv := newImageServer(t, img, nil)
	l := testLayer(t, WithProgressInterval(0))
	dst := tempTarget(t)
	var second error
	_, err := l.Lay(context.Background(), &agentv1.LayImageRequest{Url: srv.url(), Sha256: hexsum(img), Target: dst},
		func(p *agentv1.Progress) {
			if p.GetStep() == StepFetch && second == nil {
				second = l.Wipe(context.Background(), dst, nil)
			}
		})
	require.NoError(t, err)
	if !errdefs.IsConflict(second) {
		t.Errorf("Wipe during Lay of the same target = %v, want Conflict", second)
	}
	require.NoError(t, l.Wipe(context.Background(), dst, nil), "Wipe after Lay")
}

func TestLayRetriesServerErrors(t *testing.T) {
	img := makeImage(1<<20, 16)
	inner := newImageServer(t, img, nil)
	var calls atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) <= 2 {
			http.Error(w, "busy", http.StatusServiceUnavailable)
			return
		}
		inner.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	dst := tempTarget(t)
	_, err := testLayer(t).Lay(context.Background(), &agentv1.LayImageRequest{Url: srv.URL + "/i.raw", Sha256: hexsum(img), Target: dst}, nil)
	require.NoError(t, err)
	if got := fileSum(t, dst); got != hexsum(img) {
		t.Errorf("Lay(after two 503s): target sha256 = %s, want %s", got, hexsum(img))
	}
	if n := calls.Load(); n != 3 {
		t.Errorf("Lay(after two 503s) made %d requests, want 3", n)
	}
}

// An image replaced on the server while it is being fetched must not be
// spliced: If-Range makes the server send the new object whole, and the
// result fails verification instead of mixing two images.
func TestLayImageChangedDuringFetch(t *testing.T) {
	oldImg := makeImage(2<<20, 17)
	newImg := makeImage(2<<20, 18)
	var calls atomic.Int64
	var mu sync.Mutex
	var ranges []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		ranges = append(ranges, r.Header.Get("If-Range"))
		mu.Unlock()
		if calls.Add(1) == 1 {
			w.Header().Set("ETag", `"old"`)
			fw := &faultWriter{ResponseWriter: w, s: &imageServer{}, limit: 1 << 20}
			http.ServeContent(fw, r, "i.raw", time.Unix(1, 0), bytes.NewReader(oldImg))
			return
		}
		w.Header().Set("ETag", `"new"`)
		http.ServeContent(w, r, "i.raw", time.Unix(2, 0), bytes.NewReader(newImg))
	}))
	t.Cleanup(srv.Close)
	_, err := testLayer(t).Lay(context.Background(), &agentv1.LayImageRequest{Url: srv.URL + "/i.raw", Sha256: hexsum(oldImg), Target: tempTarget(t)}, nil)
	if err == nil || !strings.Contains(err.Error(), "sha256 mismatch") {
		t.Errorf("Lay(image replaced mid-fetch) = %v, want sha256 mismatch", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(ranges) < 2 || ranges[1] != `"old"` {
		t.Errorf("resume request If-Range = %q, want the first answer's ETag", ranges)
	}
}

// A dense image's ranges touch: they are still fetched as several
// requests of at most maxGroup bytes, so that the fetchers hash them in
// parallel, while small holes between small ranges are still coalesced.
func TestLayBlockMapSplitsTouchingRanges(t *testing.T) {
	const size = 8 << 20
	img := make([]byte, size)
	rand.NewChaCha8([32]byte{11}).Read(img)
	var ranges []*agentv1.BlockRange
	for off := 0; off < size; off += 1 << 20 {
		ranges = append(ranges, &agentv1.BlockRange{Offset: uint64(off), Length: 1 << 20, Sha256: hexsum(img[off : off+1<<20])})
	}
	srv := newImageServer(t, img, nil)
	dst := tempTarget(t)
	l := testLayer(t)
	l.maxGroup = 2 << 20
	_, err := l.Lay(context.Background(), &agentv1.LayImageRequest{
		Url: srv.url(), Target: dst, BlockMap: ranges, RawSize: size,
	}, nil)
	require.NoError(t, err)
	if got := fileSum(t, dst); got != hexsum(img) {
		t.Errorf("Lay(dense block map): target sha256 = %s, want %s", got, hexsum(img))
	}
	got := srv.requests()
	slices.Sort(got)
	want := []string{"bytes=0-2097151", "bytes=2097152-4194303", "bytes=4194304-6291455", "bytes=6291456-8388607"}
	if !slices.Equal(got, want) {
		t.Errorf("Lay(dense block map, 2 MiB groups) requests = %q, want %q", got, want)
	}
}

func TestCoalesce(t *testing.T) {
	br := func(off, n uint64) *agentv1.BlockRange { return &agentv1.BlockRange{Offset: off, Length: n} }
	ranges := []*agentv1.BlockRange{br(0, 100), br(150, 100), br(250, 300), br(1000, 10), br(1010, 600)}
	for _, tc := range []struct {
		gap, span int64
		want      []fetchGroup
	}{
		{0, 1 << 20, []fetchGroup{{0, 0, 0, 100}, {1, 2, 150, 550}, {3, 4, 1000, 1610}}},
		{50, 1 << 20, []fetchGroup{{0, 2, 0, 550}, {3, 4, 1000, 1610}}},
		{1000, 1 << 20, []fetchGroup{{0, 4, 0, 1610}}},
		// The span caps a group; a range longer than it is a group of its own.
		{1000, 500, []fetchGroup{{0, 1, 0, 250}, {2, 2, 250, 550}, {3, 3, 1000, 1010}, {4, 4, 1010, 1610}}},
	} {
		if got := coalesce(ranges, tc.gap, tc.span); !slices.Equal(got, tc.want) {
			t.Errorf("coalesce(gap %d, span %d) = %v, want %v", tc.gap, tc.span, got, tc.want)
		}
	}
}
