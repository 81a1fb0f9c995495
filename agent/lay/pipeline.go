package lay

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"log/slog"
	"runtime/trace"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/klauspost/compress/zstd"
	"golang.org/x/sync/errgroup"

	"github.com/kilnhq/kiln/agent/lay/internal/sha256x16"
	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// chunk is one buffer moving through the pipeline fetch → hash → write.
// Buffers come from the Layer's pool and go back to it after writing, and
// the channels between stages hold at most depth chunks each, so memory
// stays bounded whatever the image size.
type chunk struct {
	buf *[]byte
	n   int
	off int64 // where the bytes go on the target
}

func (c chunk) data() []byte { return (*c.buf)[:c.n] }

// send passes c on unless ctx ended.
func send(ctx context.Context, out chan<- chunk, c chunk) error {
	select {
	case out <- c:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// produce reads r into pooled buffers, filling each, and sends them in
// order with their target offsets starting at 0. It closes out.
func (l *Layer) produce(ctx context.Context, r io.Reader, out chan<- chunk, what string) error {
	defer close(out)
	var off int64
	for {
		b := l.getBuf()
		n, err := io.ReadFull(r, *b)
		if n > 0 {
			if serr := send(ctx, out, chunk{buf: b, n: n, off: off}); serr != nil {
				return serr
			}
			off += int64(n)
		} else {
			l.putBuf(b)
		}
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return nil
		}
		if err != nil {
			if cerr := ctx.Err(); cerr != nil {
				return cerr
			}
			return fmt.Errorf("%s: %w", what, err)
		}
	}
}

// chanReader reads the chunks of a channel as a stream, returning each
// buffer to the pool once consumed.
type chanReader struct {
	ctx context.Context
	l   *Layer
	in  <-chan chunk
	cur chunk
	pos int
}

func (r *chanReader) Read(p []byte) (int, error) {
	for r.cur.buf == nil || r.pos == r.cur.n {
		if r.cur.buf != nil {
			r.l.putBuf(r.cur.buf)
			r.cur.buf = nil
		}
		select {
		case c, ok := <-r.in:
			if !ok {
				return 0, io.EOF
			}
			r.cur, r.pos = c, 0
		case <-r.ctx.Done():
			return 0, r.ctx.Err()
		}
	}
	n := copy(p, r.cur.data()[r.pos:])
	r.pos += n
	return n, nil
}

// writer writes chunks at their offsets, skipping all-zero blocks when
// the target reads as zeros already.
type writer struct {
	t         *target
	skipZeros bool
	blockSize int
	zero      []byte
	written   int64 // bytes actually written
	end       int64 // one past the last byte seen
}

func newWriter(t *target, skipZeros bool, blockSize int) *writer {
	return &writer{t: t, skipZeros: skipZeros, blockSize: blockSize, zero: make([]byte, blockSize)}
}

func (w *writer) writeAt(b []byte, off int64) error {
	w.end = max(w.end, off+int64(len(b)))
	if !w.skipZeros {
		return w.put(b, off)
	}
	run := -1 // start of the current run of data blocks
	for i := 0; i < len(b); i += w.blockSize {
		blk := b[i:min(i+w.blockSize, len(b))]
		if bytes.Equal(blk, w.zero[:len(blk)]) {
			if run >= 0 {
				if err := w.put(b[run:i], off+int64(run)); err != nil {
					return err
				}
				run = -1
			}
		} else if run < 0 {
			run = i
		}
	}
	if run >= 0 {
		return w.put(b[run:], off+int64(run))
	}
	return nil
}

func (w *writer) put(b []byte, off int64) error {
	if err := w.t.writeAt(b, off); err != nil {
		return err
	}
	w.written += int64(len(b))
	return nil
}

// maxZstdWindow bounds the decoder's memory: 128 MiB is the window of
// `zstd --long` (27); images compressed with a larger window are refused.
const maxZstdWindow = 1 << 27

// drain writes every chunk of in, returning buffers to bufs.
func (l *Layer) drain(ctx context.Context, w *writer, in <-chan chunk, bufs buffers) error {
	for {
		select {
		case c, ok := <-in:
			if !ok {
				return nil
			}
			region := trace.StartRegion(ctx, "lay.write")
			err := w.writeAt(c.data(), c.off)
			region.End()
			bufs.put(c.buf)
			if err != nil {
				return err
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// layStream lays the object at url: fetch → hash (of the fetched bytes) →
// [zstd decode] → write, each stage in its own goroutine.
func (l *Layer) layStream(ctx context.Context, t *target, url, format, wantSum string, rawSize int64, zeroed bool, rep *reporter, log *slog.Logger) (*agentv1.LayImageResult, error) {
	var fetched atomic.Int64
	s := l.newStream(ctx, log, url, 0, -1, false, &fetched)
	s.note = rep.note
	s.onTotal = func(n int64) { rep.setTotal(uint64(n)) }
	if format == FormatRaw && rawSize > 0 {
		rep.setTotal(uint64(rawSize))
	}
	rep.step(StepFetch, 0)

	// The first stage to fail cancels gctx, which ends the others.
	g, gctx := errgroup.WithContext(ctx)
	s.ctx = gctx
	fetchedCh := make(chan chunk, l.depth)
	hashedCh := make(chan chunk, l.depth)
	h := sha256.New()

	var fetchErr error // the cause, when a later stage fails because of it
	g.Go(func() error {
		defer s.Close()
		fetchErr = l.produce(gctx, s, fetchedCh, "fetch")
		return fetchErr
	})
	g.Go(func() error { return hashStage(gctx, h, fetchedCh, hashedCh, rep) })
	toWrite := hashedCh
	if format == FormatRawZst {
		// Decoded bytes are copied into pooled, aligned buffers, so that
		// they can be written with O_DIRECT.
		decodedCh := make(chan chunk, l.depth)
		toWrite = decodedCh
		g.Go(func() error {
			dec, err := zstd.NewReader(&chanReader{ctx: gctx, l: l, in: hashedCh}, zstd.WithDecoderConcurrency(2), zstd.WithDecoderMaxWindow(maxZstdWindow),
				// The sha256 of the compressed stream is verified; zstd's own
				// xxhash of the output would only cost CPU.
				zstd.IgnoreChecksum(true))
			if err != nil {
				close(decodedCh)
				return fmt.Errorf("zstd: %w", err)
			}
			defer dec.Close()
			return l.produce(gctx, dec, decodedCh, "zstd decode")
		})
	}
	// Several writers keep several writes in flight: O_DIRECT writes wait
	// for the disk, and chunks land at their own offsets in any order.
	ws := l.spawnWriters(gctx, g, t, zeroed, toWrite, poolBuffers{l})
	if err := g.Wait(); err != nil {
		// A broken stream makes the decoder fail too: report the cause.
		if fetchErr != nil && !errors.Is(fetchErr, context.Canceled) {
			err = fetchErr
		}
		return nil, fmt.Errorf("lay %q: %w", t.path, err)
	}
	w := sumWriters(ws)
	if s.end >= 0 && s.off < s.end {
		return nil, errdefs.Unavailable("lay %q: stream truncated at %d of %d bytes", t.path, s.off, s.end)
	}
	rep.step(StepVerify, uint64(s.off))
	got := hex.EncodeToString(h.Sum(nil))
	if !strings.EqualFold(got, wantSum) {
		return nil, errdefs.FailedPrecondition("lay %q: sha256 mismatch: got %s want %s (%d bytes fetched)", t.path, got, strings.ToLower(wantSum), s.off)
	}
	if rawSize > 0 && w.end != rawSize {
		return nil, errdefs.FailedPrecondition("lay %q: image is %d bytes, want raw_size %d", t.path, w.end, rawSize)
	}
	if !t.block && w.end > t.size {
		// Zero blocks at the tail were skipped: give the file its size.
		if err := t.f.Truncate(w.end); err != nil {
			return nil, fmt.Errorf("target %q: set size: %w", t.path, err)
		}
		t.size = w.end
	}
	return &agentv1.LayImageResult{BytesWritten: uint64(w.written), BytesFetched: uint64(fetched.Load()), Sha256: got}, nil
}

// spawnWriters starts l.writers writers draining in, in g, under ctx (g's
// context).
func (l *Layer) spawnWriters(ctx context.Context, g *errgroup.Group, t *target, zeroed bool, in <-chan chunk, bufs buffers) []*writer {
	ws := make([]*writer, l.writers)
	for i := range ws {
		w := newWriter(t, zeroed, l.blockSize)
		ws[i] = w
		g.Go(func() error { return l.drain(ctx, w, in, bufs) })
	}
	return ws
}

// sumWriters adds up what the writers wrote and saw.
func sumWriters(ws []*writer) *writer {
	sum := &writer{}
	for _, w := range ws {
		sum.written += w.written
		sum.end = max(sum.end, w.end)
	}
	return sum
}

// hashStage hashes each chunk in order and passes it on.
func hashStage(ctx context.Context, h hash.Hash, in <-chan chunk, out chan<- chunk, rep *reporter) error {
	defer close(out)
	for {
		select {
		case c, ok := <-in:
			if !ok {
				return nil
			}
			h.Write(c.data())
			rep.add(c.n)
			if err := send(ctx, out, c); err != nil {
				return err
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// fetchGroup is a run of block-map ranges fetched with one request; the
// holes between them are smaller than the coalesce gap and are read and
// thrown away.
type fetchGroup struct {
	first, last int // indexes of ranges
	start, end  int64
}

// maxGroupSpan bounds the bytes one request covers when ranges are
// coalesced, so that a dense image (whose ranges touch) still becomes
// many requests that the fetchers hash in parallel. A single range larger
// than this is still one request: its sha256 covers it whole.
const maxGroupSpan = 16 << 20

// coalesce groups ranges whose holes are at most gap bytes into requests
// of at most maxSpan bytes.
func coalesce(ranges []*agentv1.BlockRange, gap, maxSpan int64) []fetchGroup {
	var out []fetchGroup
	for i, r := range ranges {
		off, end := int64(r.GetOffset()), int64(r.GetOffset()+r.GetLength())
		if n := len(out); n > 0 && off-out[n-1].end <= gap && end-out[n-1].start <= maxSpan {
			out[n-1].last, out[n-1].end = i, end
			continue
		}
		out = append(out, fetchGroup{first: i, last: i, start: off, end: end})
	}
	return out
}

// layMap lays the ranges of a block map. A file target's ranges are
// preallocated first. Several fetchers (WithFetchers) each take a group of
// ranges, fetch it with one request, hash each range as its bytes arrive
// and pass the chunks to the writers (WithWriters) through a channel; a
// range whose sha256 is not the map's fails the whole lay. Ranges are
// independent, so hashing runs on every core. On CPUs with AVX-512, ranges
// that fit in one buffer (but the first 16) are instead verified sixteen
// at a time by one hasher (hashBatches), which costs about a third of
// the CPU time of SHA-NI per byte. The buffers come from an arena of huge
// pages that lives as long as the lay (see arena). Holes are never
// fetched (beyond the small gaps inside a group), hashed or written. Under runtime/trace, each
// read+hash, each read of a batched range, each batch's hashing and each
// write is a region ("lay.fetch+hash", "lay.fetch", "lay.hash",
// "lay.write"), so `go tool trace` shows where a lay waits.
func (l *Layer) layMap(ctx context.Context, t *target, req *agentv1.LayImageRequest, zeroed bool, rep *reporter, log *slog.Logger) (*agentv1.LayImageResult, error) {
	ranges := req.GetBlockMap()
	var total uint64
	for _, r := range ranges {
		total += r.GetLength()
	}
	rep.setTotal(total)
	rep.step(StepFetch, 0)
	groups := coalesce(ranges, l.gap, l.maxGroup)
	fetchers := max(1, min(l.fetchers, len(groups)))
	log.Info("laying with a block map", "ranges", len(ranges), "requests", len(groups), "fetchers", fetchers, "writers", l.writers, "dataBytes", total, "rawSize", req.GetRawSize())

	if zeroed {
		t.preallocate(spans(ranges))
	}

	// The lay's buffers come from an arena of huge pages, unmapped when
	// layMap returns: after g.Wait, when every goroutine using them ended.
	bufs := newArena(l.bufSize)
	defer bufs.release()
	var fetched atomic.Int64
	g, gctx := errgroup.WithContext(ctx)
	groupCh := make(chan fetchGroup, len(groups))
	for _, fg := range groups {
		groupCh <- fg
	}
	close(groupCh)
	// With batched hashing, ranges that fit in one buffer go through
	// hashCh to one hasher, which verifies them 16 at a time; the writers'
	// queue then holds a whole batch more, so that the hasher hands a
	// batch over at once and hashes the next while the writers work.
	var hashCh chan rangeChunk
	writeDepth := l.depth
	if l.batchHash {
		hashCh = make(chan rangeChunk, l.depth)
		writeDepth += sha256x16.Lanes
	}
	writeCh := make(chan chunk, writeDepth)
	var small atomic.Int64 // ranges that fit in one buffer, counted as fetched
	var fetching, sending sync.WaitGroup
	for range fetchers {
		fetching.Add(1)
		g.Go(func() error {
			defer fetching.Done()
			h := sha256.New()
			for fg := range groupCh {
				s := l.newStream(gctx, log, req.GetUrl(), fg.start, fg.end, true, &fetched)
				s.note = rep.note
				err := l.fetchGroup(gctx, s, ranges, fg, h, writeCh, hashCh, &small, bufs, rep)
				s.Close()
				if err != nil {
					return err
				}
			}
			return nil
		})
	}
	sending.Add(1)
	go func() { fetching.Wait(); sending.Done() }()
	if hashCh != nil {
		sending.Add(1)
		go func() { fetching.Wait(); close(hashCh) }()
		g.Go(func() error {
			defer sending.Done()
			return l.hashBatches(gctx, ranges, hashCh, writeCh, bufs, rep)
		})
	}
	go func() { sending.Wait(); close(writeCh) }()
	writers := l.spawnWriters(gctx, g, t, zeroed, writeCh, bufs)
	if err := g.Wait(); err != nil {
		if errors.Is(err, errRangeIgnored) {
			return nil, err
		}
		return nil, fmt.Errorf("lay %q: %w", t.path, err)
	}
	written := sumWriters(writers).written
	if !zeroed {
		// The target cannot discard: the holes still hold old data.
		var holes int64
		pos := int64(0)
		for _, r := range append(ranges, &agentv1.BlockRange{Offset: req.GetRawSize()}) {
			if gap := int64(r.GetOffset()) - pos; gap > 0 {
				if err := t.zero(ctx, pos, gap); err != nil {
					return nil, err
				}
				holes += gap
			}
			pos = int64(r.GetOffset() + r.GetLength())
		}
		written += holes
		rep.note(fmt.Sprintf("wrote zeros over the %d bytes of holes, as the target cannot discard", holes))
	}
	return &agentv1.LayImageResult{BytesWritten: uint64(written), BytesFetched: uint64(fetched.Load()), Sha256: strings.ToLower(req.GetRawSha256())}, nil
}

// spans returns the ranges as [offset, length] pairs, touching ranges
// merged.
func spans(ranges []*agentv1.BlockRange) [][2]int64 {
	var out [][2]int64
	for _, r := range ranges {
		off, n := int64(r.GetOffset()), int64(r.GetLength())
		if k := len(out); k > 0 && out[k-1][0]+out[k-1][1] == off {
			out[k-1][1] += n
			continue
		}
		out = append(out, [2]int64{off, n})
	}
	return out
}

// fetchGroup reads one group's response: the ranges into chunks, the
// gaps into nothing. When hashCh is not nil, a range that fits in one
// buffer goes there unhashed (see hashBatches), but for the first
// l.inlineFirst such ranges of the lay: those give the writers work while
// the first batch fills. Any other range is hashed here as its bytes
// arrive and verified when its last chunk has, which is sent on only then
// (its earlier chunks go to the writers as they arrive: a range of any
// length is laid in bounded memory, and a mismatch fails the lay).
func (l *Layer) fetchGroup(ctx context.Context, s *stream, ranges []*agentv1.BlockRange, fg fetchGroup, h hash.Hash, out chan<- chunk, hashCh chan<- rangeChunk, small *atomic.Int64, bufs buffers, rep *reporter) error {
	pos := fg.start
	for i := fg.first; i <= fg.last; i++ {
		r := ranges[i]
		off, end := int64(r.GetOffset()), int64(r.GetOffset()+r.GetLength())
		if gap := off - pos; gap > 0 {
			if _, err := io.CopyN(io.Discard, s, gap); err != nil {
				return rangeFetchError(s, i, r, err)
			}
		}
		if hashCh != nil && end-off <= int64(l.bufSize) && small.Add(1) > int64(l.inlineFirst) {
			b := bufs.get()
			region := trace.StartRegion(ctx, "lay.fetch")
			_, err := io.ReadFull(s, (*b)[:end-off])
			region.End()
			if err != nil {
				bufs.put(b)
				return rangeFetchError(s, i, r, err)
			}
			select {
			case hashCh <- rangeChunk{chunk: chunk{buf: b, n: int(end - off), off: off}, index: i}:
			case <-ctx.Done():
				bufs.put(b)
				return ctx.Err()
			}
			pos = end
			continue
		}
		h.Reset()
		for off < end {
			b := bufs.get()
			n := min(int64(len(*b)), end-off)
			region := trace.StartRegion(ctx, "lay.fetch+hash")
			err := readHashed(s, (*b)[:n], h)
			region.End()
			if err != nil {
				bufs.put(b)
				return rangeFetchError(s, i, r, err)
			}
			rep.add(int(n))
			if off+n == end {
				if got := hex.EncodeToString(h.Sum(nil)); !strings.EqualFold(got, r.GetSha256()) {
					bufs.put(b)
					return errdefs.FailedPrecondition("range %d (offset %d, length %d): sha256 mismatch: got %s want %s", i, r.GetOffset(), r.GetLength(), got, strings.ToLower(r.GetSha256()))
				}
			}
			if err := send(ctx, out, chunk{buf: b, n: int(n), off: off}); err != nil {
				return err
			}
			off += n
		}
		pos = end
	}
	return nil
}

// rangeChunk is a whole block-map range, fetched and not yet verified.
type rangeChunk struct {
	chunk
	index int // in the block map
}

// hashBatches verifies the ranges arriving on in, sixteen at a time
// (sha256x16.Sum: one AVX-512 computation hashes all sixteen), and sends
// each on to the writers only once its sha256 is the map's: a range that
// does not match is never written and fails the lay. It waits for a full
// batch unless in is closed, as a batch costs as much as its longest
// range whatever the number of ranges in it.
func (l *Layer) hashBatches(ctx context.Context, ranges []*agentv1.BlockRange, in <-chan rangeChunk, out chan<- chunk, bufs buffers, rep *reporter) error {
	batch := make([]rangeChunk, 0, sha256x16.Lanes)
	msgs := make([][]byte, 0, sha256x16.Lanes)
	sums := make([][sha256.Size]byte, sha256x16.Lanes)
	defer func() {
		for _, c := range batch {
			bufs.put(c.buf)
		}
	}()
	for open := true; open; {
		batch, msgs = batch[:0], msgs[:0]
		for len(batch) < sha256x16.Lanes {
			var c rangeChunk
			select {
			case c, open = <-in:
			case <-ctx.Done():
				return ctx.Err()
			}
			if !open {
				break
			}
			batch = append(batch, c)
			msgs = append(msgs, c.data())
		}
		if len(batch) == 0 {
			break
		}
		region := trace.StartRegion(ctx, "lay.hash")
		sha256x16.Sum(msgs, sums)
		region.End()
		for k, c := range batch {
			r := ranges[c.index]
			if got := hex.EncodeToString(sums[k][:]); !strings.EqualFold(got, r.GetSha256()) {
				return errdefs.FailedPrecondition("range %d (offset %d, length %d): sha256 mismatch: got %s want %s", c.index, r.GetOffset(), r.GetLength(), got, strings.ToLower(r.GetSha256()))
			}
		}
		for k, c := range batch {
			if err := send(ctx, out, c.chunk); err != nil {
				batch = batch[k:] // the rest go back to the pool
				return err
			}
			rep.add(c.n)
		}
		l.batched.Add(int64(len(batch)))
		batch = batch[:0]
	}
	return nil
}

// readHashed fills buf from r like io.ReadFull, hashing each read's bytes
// as they arrive, while they are still in the CPU's cache.
func readHashed(r io.Reader, buf []byte, h hash.Hash) error {
	for pos := 0; pos < len(buf); {
		n, err := r.Read(buf[pos:])
		h.Write(buf[pos : pos+n])
		pos += n
		if err == io.EOF && pos < len(buf) {
			if pos == 0 {
				return io.EOF
			}
			return io.ErrUnexpectedEOF
		}
		if err != nil && err != io.EOF {
			return err
		}
	}
	return nil
}

func rangeFetchError(s *stream, i int, r *agentv1.BlockRange, err error) error {
	if errors.Is(err, errRangeIgnored) || s.ctx.Err() != nil {
		return err
	}
	if err == io.EOF || err == io.ErrUnexpectedEOF {
		err = errdefs.Unavailable("stream truncated at %d of %d bytes", s.off, s.end)
	}
	return fmt.Errorf("range %d (offset %d, length %d): %w", i, r.GetOffset(), r.GetLength(), err)
}
