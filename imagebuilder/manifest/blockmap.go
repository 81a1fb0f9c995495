package manifest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"hash"
	"io"
	"os"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// DefaultBlockSize is the block map granularity used by the image builder.
const DefaultBlockSize = 4096

// MaxRangeLength caps a block map range: a long run of data is split into
// ranges of at most this length, so that an agent can fetch and verify
// them in parallel and a bad range names a small part of the image.
const MaxRangeLength = 32 << 20

// extent is a run [off, end) of a file that the filesystem says may hold data.
type extent struct{ off, end int64 }

// BlockMap returns the ranges of the raw image at path that hold data, in
// order, with the sha256 of each. Ranges are at most MaxRangeLength long. It asks the filesystem for the file's
// data extents (SEEK_DATA/SEEK_HOLE; the whole file where that is not
// available), then reads those extents and also treats every all-zero block
// of blockSize bytes as a hole. Adjacent data blocks are merged into one
// range. A range ends at the file's end even when that is not a multiple of
// blockSize.
//
// It reads every data byte of the file once. It returns errdefs.InvalidArgument
// for a blockSize that is not a positive multiple of 512, and ctx's error
// when ctx ends.
func BlockMap(ctx context.Context, path string, blockSize int) ([]Range, error) {
	if blockSize <= 0 || blockSize%512 != 0 {
		return nil, errdefs.InvalidArgument("block map of %q: block size %d is not a positive multiple of 512", path, blockSize)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("block map of %q: %w", path, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("block map of %q: %w", path, err)
	}
	size := fi.Size()
	extents, err := dataExtents(f, size)
	if err != nil {
		return nil, fmt.Errorf("block map of %q: %w", path, err)
	}

	b := &mapBuilder{h: sha256.New()}
	zero := make([]byte, blockSize)
	bs := int64(blockSize)
	chunk := make([]byte, 256*bs)
	var done int64 // blocks before done were judged already
	for _, e := range extents {
		// Align to whole blocks so a block is judged on all its bytes;
		// two extents may share a block.
		off := max(e.off/bs*bs, done)
		end := min((e.end+bs-1)/bs*bs, size)
		done = max(done, end)
		for off < end {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			n := min(int64(len(chunk)), end-off)
			buf := chunk[:n]
			if _, err := f.ReadAt(buf, off); err != nil && err != io.EOF {
				return nil, fmt.Errorf("block map of %q: read at %d: %w", path, off, err)
			}
			for i := int64(0); i < n; i += bs {
				blk := buf[i:min(i+bs, n)]
				if bytes.Equal(blk, zero[:len(blk)]) {
					b.hole()
					continue
				}
				b.data(uint64(off+i), blk)
			}
			off += n
		}
	}
	b.hole()
	return b.ranges, nil
}

// mapBuilder merges consecutive data blocks into hashed ranges.
type mapBuilder struct {
	ranges []Range
	cur    *Range
	h      hash.Hash
}

func (b *mapBuilder) data(off uint64, blk []byte) {
	if b.cur != nil && (b.cur.End() != off || b.cur.Length+uint64(len(blk)) > MaxRangeLength) {
		b.hole()
	}
	if b.cur == nil {
		b.cur = &Range{Offset: off}
		b.h.Reset()
	}
	b.h.Write(blk)
	b.cur.Length += uint64(len(blk))
}

func (b *mapBuilder) hole() {
	if b.cur == nil {
		return
	}
	b.cur.SHA256 = hex.EncodeToString(b.h.Sum(nil))
	b.ranges = append(b.ranges, *b.cur)
	b.cur = nil
}
