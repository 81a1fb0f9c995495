package lay

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// batchImage is a 16 MiB image whose block map has 41 ranges of unequal
// lengths: around a 64-byte SHA-256 block, around a 4 KiB disk block,
// exactly one test buffer (64 KiB) and, for the fetcher's own hashing,
// longer than one buffer. It returns the image (zeros outside the ranges)
// and the block map.
func batchImage(t *testing.T) ([]byte, []*agentv1.BlockRange) {
	t.Helper()
	const size = 16 << 20
	lengths := []int{1, 63, 64, 65, 55, 56, 4095, 4096, 4097, 65535, 64 << 10, 64<<10 + 7, 200 << 10}
	img := make([]byte, size)
	r := rand.NewChaCha8([32]byte{12})
	var ranges []*agentv1.BlockRange
	for i := range 41 {
		off := i * 384 << 10 // ranges and holes alternate
		n := lengths[i%len(lengths)]
		r.Read(img[off : off+n])
		img[off] |= 1 // not a zero block
		ranges = append(ranges, &agentv1.BlockRange{Offset: uint64(off), Length: uint64(n), Sha256: hexsum(img[off : off+n])})
	}
	return img, ranges
}

// batchModes are the ways a Layer verifies small ranges: each by its
// fetcher (crypto/sha256), all in batches of 16 (sha256x16: AVX-512 where
// the CPU has it, crypto/sha256 otherwise), and the default mix (the
// first ranges by their fetchers, the rest in batches).
var batchModes = []struct {
	name        string
	batch       bool
	inlineFirst int
}{
	{"fetcher", false, 0},
	{"batches", true, 0},
	{"mixed", true, 5},
}

func TestLayBlockMapBatchedHashing(t *testing.T) {
	img, ranges := batchImage(t)
	var data uint64
	for _, r := range ranges {
		data += r.GetLength()
	}
	for _, mode := range batchModes {
		t.Run(mode.name, func(t *testing.T) {
			srv := newImageServer(t, img, nil)
			dst := tempTarget(t)
			l := testLayer(t)
			l.batchHash, l.inlineFirst = mode.batch, mode.inlineFirst
			res, err := l.Lay(context.Background(), &agentv1.LayImageRequest{
				Url: srv.url(), Target: dst, BlockMap: ranges, RawSize: uint64(len(img)),
			}, nil)
			require.NoError(t, err)
			if got := fileSum(t, dst); got != hexsum(img) {
				t.Errorf("Lay(%s): target sha256 = %s, want %s", mode.name, got, hexsum(img))
			}
			if res.GetBytesWritten() != data {
				t.Errorf("Lay(%s) wrote %d bytes, want the %d bytes of the ranges", mode.name, res.GetBytesWritten(), data)
			}
			// Ranges longer than a buffer (64 KiB here) are hashed by their
			// fetcher whatever the mode.
			small := 0
			for _, r := range ranges {
				if r.GetLength() <= 64<<10 {
					small++
				}
			}
			want := 0
			if mode.batch {
				want = small - mode.inlineFirst
			}
			if n := l.batched.Load(); n != int64(want) {
				t.Errorf("Lay(%s) verified %d ranges in batches, want %d", mode.name, n, want)
			}
		})
	}
}

// A corrupted range fails the lay with the range's mismatch, and its bytes
// never reach the target, in every mode.
func TestLayBlockMapBatchedCorruptRange(t *testing.T) {
	img, ranges := batchImage(t)
	for _, i := range []int{2, 30} { // a 64-byte range and a 64 KiB one
		bad := bytes.Clone(img)
		r := ranges[i]
		bad[r.GetOffset()+r.GetLength()-1] ^= 0x80
		gotSum := hexsum(bad[r.GetOffset() : r.GetOffset()+r.GetLength()])
		for _, mode := range batchModes {
			t.Run(fmt.Sprintf("range%d/%s", i, mode.name), func(t *testing.T) {
				srv := newImageServer(t, bad, nil)
				dst := tempTarget(t)
				l := testLayer(t)
				l.batchHash, l.inlineFirst = mode.batch, mode.inlineFirst
				_, err := l.Lay(context.Background(), &agentv1.LayImageRequest{
					Url: srv.url(), Target: dst, BlockMap: ranges, RawSize: uint64(len(img)),
				}, nil)
				want := fmt.Sprintf("range %d (offset %d, length %d): sha256 mismatch: got %s want %s", i, r.GetOffset(), r.GetLength(), gotSum, r.GetSha256())
				if err == nil || !strings.Contains(err.Error(), want) {
					t.Fatalf("Lay(%s, corrupt range %d) = %v, want an error containing %q", mode.name, i, err, want)
				}
				if !errdefs.IsFailedPrecondition(err) {
					t.Errorf("Lay(%s, corrupt range %d) = %v, want FailedPrecondition", mode.name, i, err)
				}
				assertInvalidated(t, dst)
				f, err := os.Open(dst)
				require.NoError(t, err)
				defer f.Close()
				on := make([]byte, r.GetLength())
				f.ReadAt(on, int64(r.GetOffset()))
				if !bytes.Equal(on, make([]byte, len(on))) {
					t.Errorf("Lay(%s, corrupt range %d): the range's bytes were written to the target before they were verified", mode.name, i)
				}
			})
		}
	}
}

// Connections dropped inside ranges are resumed; a server that always
// stops early fails the lay as truncated, in every mode.
func TestLayBlockMapBatchedDropsAndTruncation(t *testing.T) {
	img, ranges := batchImage(t)
	for _, mode := range batchModes {
		t.Run("drops/"+mode.name, func(t *testing.T) {
			srv := newImageServer(t, img, func(s *imageServer) { s.dropAfter = 30; s.drops.Store(6) })
			dst := tempTarget(t)
			l := testLayer(t, WithFetchers(1)) // the first requests are the dropped ones
			l.batchHash, l.inlineFirst = mode.batch, mode.inlineFirst
			_, err := l.Lay(context.Background(), &agentv1.LayImageRequest{
				Url: srv.url(), Target: dst, BlockMap: ranges, RawSize: uint64(len(img)),
			}, nil)
			require.NoError(t, err)
			if got := fileSum(t, dst); got != hexsum(img) {
				t.Errorf("Lay(%s, drops): target sha256 = %s, want %s", mode.name, got, hexsum(img))
			}
		})
		t.Run("truncated/"+mode.name, func(t *testing.T) {
			r := ranges[33] // 64 KiB + 7: stops inside it
			at := int64(r.GetOffset()) + 1000
			srv := newImageServer(t, img, func(s *imageServer) { s.truncateAt = at })
			dst := tempTarget(t)
			l := testLayer(t, WithRetries(2), WithFetchers(1)) // range 33 is the first to fail
			l.batchHash, l.inlineFirst = mode.batch, mode.inlineFirst
			_, err := l.Lay(context.Background(), &agentv1.LayImageRequest{
				Url: srv.url(), Target: dst, BlockMap: ranges, RawSize: uint64(len(img)),
			}, nil)
			want := fmt.Sprintf("stream truncated at %d of %d bytes", at, r.GetOffset()+r.GetLength())
			if err == nil || !strings.Contains(err.Error(), want) || !errdefs.IsUnavailable(err) {
				t.Errorf("Lay(%s, truncated) = %v, want Unavailable containing %q", mode.name, err, want)
			}
			assertInvalidated(t, dst)
		})
	}
}
