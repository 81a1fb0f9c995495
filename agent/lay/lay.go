// Package lay writes golden images onto disks for the agent: it streams an
// image over HTTP (resuming dropped connections with Range requests),
// decompresses zstd on the fly, hashes what it fetches, writes only the
// non-zero blocks onto a target discarded beforehand, fsyncs, and reports
// success only when the hash matches. With a block map it fetches only the
// ranges of the raw image that hold data and verifies each. It also wipes
// disks.
//
// A target is a block device; a regular file only in file-target mode
// (WithFileTargets: the lab's disks are files).
package lay

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	retryablehttp "github.com/hashicorp/go-retryablehttp"

	"github.com/kilnhq/kiln/agent/lay/internal/sha256x16"
	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// Formats of LayImageRequest.Format.
const (
	FormatRaw    = "raw"
	FormatRawZst = "raw.zst"
)

// Steps named in Progress.Step.
const (
	StepOpen    = "open"
	StepDiscard = "discard"
	StepFetch   = "fetch"
	StepSync    = "sync"
	StepVerify  = "verify"
	StepDone    = "done"
	StepWipe    = "wipe"
)

// Layer lays images onto targets and wipes them. It is safe for concurrent
// use on different targets.
type Layer struct {
	log         *slog.Logger
	httpClient  *http.Client
	client      *retryablehttp.Client
	retries     int
	policy      backoff.Policy
	bufSize     int
	blockSize   int
	gap         int64
	stall       time.Duration
	fetchers    int
	writers     int
	maxGroup    int64
	interval    time.Duration
	now         func() time.Time
	depth       int
	batchHash   bool         // verify small block-map ranges 16 at a time (AVX-512)
	inlineFirst int          // small ranges hashed by their fetcher before batching starts
	batched     atomic.Int64 // ranges verified in batches, for tests
	pool        sync.Pool

	fileTargets bool // regular files accepted as targets (the lab)
	observer    Observer

	mu   sync.Mutex
	busy map[string]bool // targets being laid or wiped
}

// claim marks target busy, so that two operations never write one disk
// at once. It returns an errdefs.Conflict error if it is busy already.
func (l *Layer) claim(target string) (release func(), err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.busy == nil {
		l.busy = map[string]bool{}
	}
	if l.busy[target] {
		return nil, errdefs.Conflict("target %q is busy with another lay or wipe", target)
	}
	l.busy[target] = true
	return func() {
		l.mu.Lock()
		delete(l.busy, target)
		l.mu.Unlock()
	}, nil
}

// Option configures a Layer.
type Option func(*Layer)

// WithHTTPClient sets the HTTP client (its transport carries TLS settings
// and timeouts). Default: a client with http.DefaultTransport's settings.
func WithHTTPClient(c *http.Client) Option { return func(l *Layer) { l.httpClient = c } }

// WithRetries sets how many times a request is retried, and how many
// consecutive dropped connections without progress a stream survives,
// before laying fails. Default 5.
func WithRetries(n int) Option { return func(l *Layer) { l.retries = n } }

// WithBackoff sets the delay policy between retries. Default 250ms doubling
// to 10s with 20% jitter.
func WithBackoff(p backoff.Policy) Option { return func(l *Layer) { l.policy = p } }

// WithBufferSize sets the size of the buffers passed between the fetch,
// hash and write stages. Memory use is bounded by about 20 buffers: 4 in
// each channel between stages, plus one per fetcher and writer; a block
// map verified in batches of 16 (on CPUs with AVX-512) adds up to 36: the
// batch being hashed and one more batch queued for the writers. A
// block-map lay maps its buffers itself, 2 MiB-aligned for transparent
// huge pages, and unmaps them when it ends; the streaming paths pool them
// on the Go heap. Default 1 MiB.
func WithBufferSize(n int) Option { return func(l *Layer) { l.bufSize = n } }

// WithBlockSize sets the granularity at which all-zero blocks are skipped.
// Default 4096.
func WithBlockSize(n int) Option { return func(l *Layer) { l.blockSize = n } }

// WithCoalesceGap sets the largest hole between two block-map ranges that
// is fetched (and thrown away) to save a request. Default 256 KiB; 0
// fetches every range on its own.
func WithCoalesceGap(n int64) Option { return func(l *Layer) { l.gap = n } }

// WithFetchers sets how many block-map requests run at once. Default 4.
func WithFetchers(n int) Option { return func(l *Layer) { l.fetchers = n } }

// WithWriters sets how many writes to the target are in flight at once.
// Writes bypass the page cache (O_DIRECT) and each waits for the disk, so
// more of them keep the disk's queue full. Default 4.
func WithWriters(n int) Option { return func(l *Layer) { l.writers = max(1, n) } }

// WithStallTimeout sets how long a connection may deliver no data before
// it is dropped and the stream resumed elsewhere in it. Default 30s.
func WithStallTimeout(d time.Duration) Option { return func(l *Layer) { l.stall = d } }

// WithProgressInterval sets the least time between two progress reports
// of the same step. Default 250ms.
func WithProgressInterval(d time.Duration) Option { return func(l *Layer) { l.interval = d } }

// WithFileTargets accepts regular files as targets, and creates a missing
// target outside /dev as one: the lab's disks are files. Default off: a
// target must be a block device, and anything else is an
// errdefs.InvalidArgument error.
func WithFileTargets(on bool) Option { return func(l *Layer) { l.fileTargets = on } }

// Observer is told of each image laid (agent/metrics). Its method must
// not block.
type Observer interface {
	// ObserveLay records a lay that succeeded: the bytes it wrote to the
	// target and fetched from the server, in d.
	ObserveLay(written, fetched uint64, d time.Duration)
}

// WithObserver reports each successful lay to o.
func WithObserver(o Observer) Option { return func(l *Layer) { l.observer = o } }

// WithClock sets the clock used for rates and ETAs. Default time.Now.
func WithClock(now func() time.Time) Option { return func(l *Layer) { l.now = now } }

// New returns a Layer.
func New(log *slog.Logger, opts ...Option) *Layer {
	l := &Layer{
		log:         log.With("component", "lay"),
		retries:     5,
		policy:      backoff.Policy{Base: 250 * time.Millisecond, Max: 10 * time.Second, Factor: 2, Jitter: 0.2},
		bufSize:     1 << 20,
		blockSize:   4096,
		gap:         256 << 10,
		stall:       30 * time.Second,
		fetchers:    4,
		writers:     4,
		maxGroup:    maxGroupSpan,
		interval:    250 * time.Millisecond,
		now:         time.Now,
		depth:       4,
		batchHash:   sha256x16.Accelerated(),
		inlineFirst: sha256x16.Lanes,
	}
	for _, o := range opts {
		o(l)
	}
	if l.httpClient == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		// Keep a warm connection per fetcher: the default of 2 idle
		// connections per host would close and reopen connections
		// between the ranges of a block map, each new one starting
		// with a small TCP window.
		tr.MaxIdleConnsPerHost = max(l.fetchers, 2)
		l.httpClient = &http.Client{Transport: tr}
	}
	l.client = &retryablehttp.Client{
		HTTPClient:   l.httpClient,
		Logger:       nil, // it would log URLs, which may carry tokens
		RetryWaitMin: l.policy.Base,
		RetryWaitMax: l.policy.Max,
		RetryMax:     l.retries,
		CheckRetry:   retryablehttp.DefaultRetryPolicy,
		Backoff:      retryablehttp.DefaultBackoff,
		ErrorHandler: func(resp *http.Response, err error, tries int) (*http.Response, error) {
			if err != nil {
				return nil, fmt.Errorf("giving up after %d attempts: %w", tries, redactErr(err))
			}
			return resp, nil // a status the caller maps to an error
		},
	}
	size := l.bufSize
	l.pool.New = func() any { b := make([]byte, size); return &b }
	return l
}

func (l *Layer) getBuf() *[]byte  { return l.pool.Get().(*[]byte) }
func (l *Layer) putBuf(b *[]byte) { l.pool.Put(b) }

// Lay writes the image req describes onto req.Target and reports progress
// through progress (which may be nil) at most every progress interval per
// step. It blocks until the image is laid and synced, or fails.
//
// Without a block map it streams req.Url (format raw or raw.zst), hashes
// the bytes fetched, and succeeds only when that hash equals req.Sha256.
// With a block map it fetches only the mapped ranges of the raw image at
// req.Url and verifies each range's sha256 as it lands; holes are neither
// fetched, hashed nor written, and req.RawSha256 is not recomputed (the
// per-range hashes plus the map, which was made from that image, are the
// verification). If the server ignores Range requests, it falls back to
// streaming the whole raw image and verifying req.RawSha256.
//
// On failure the target holds no valid image: its first MiB is zeroed so
// it cannot boot, and the error says why ("sha256 mismatch: got X want Y",
// "stream truncated at N of M bytes", "range 3 (offset O, length L):
// sha256 mismatch ..."). Errors are of class errdefs.InvalidArgument (bad
// request, or a target that is not a block device outside file-target
// mode), NotFound (target or URL missing), FailedPrecondition (hash
// mismatch, target too small), Unavailable (network), Conflict (the target
// is being laid or wiped already) or ctx's error.
func (l *Layer) Lay(ctx context.Context, req *agentv1.LayImageRequest, progress func(*agentv1.Progress)) (*agentv1.LayImageResult, error) {
	if err := validate(req); err != nil {
		return nil, err
	}
	start := l.now()
	log := l.log.With("target", req.GetTarget(), "url", redactURL(req.GetUrl()), "format", req.GetFormat())
	release, err := l.claim(req.GetTarget())
	if err != nil {
		return nil, err
	}
	defer release()
	rep := newReporter(progress, l.now, l.interval)
	rep.step(StepOpen, 0)

	t, err := openTarget(req.GetTarget(), true, l.fileTargets)
	if err != nil {
		return nil, err
	}
	defer t.Close()
	rawSize := int64(req.GetRawSize())
	if rawSize > 0 && t.block && rawSize > t.size {
		return nil, errdefs.FailedPrecondition("target %q: %d bytes is smaller than the image (%d bytes)", t.path, t.size, rawSize)
	}

	res, err := l.lay(ctx, t, req, rep, log)
	if err != nil {
		log.Error("laying failed", "error", err)
		if cerr := t.invalidate(); cerr != nil {
			log.Warn("could not clear the target after the failure", "error", cerr)
		}
		return nil, err
	}
	took := l.now().Sub(start)
	res.Seconds = took.Seconds()
	if l.observer != nil {
		l.observer.ObserveLay(res.GetBytesWritten(), res.GetBytesFetched(), took)
	}
	rep.step(StepDone, res.BytesWritten)
	log.Info("image laid", "bytesWritten", res.BytesWritten, "bytesFetched", res.BytesFetched, "seconds", res.Seconds)
	return res, nil
}

func (l *Layer) lay(ctx context.Context, t *target, req *agentv1.LayImageRequest, rep *reporter, log *slog.Logger) (*agentv1.LayImageResult, error) {
	rawSize := int64(req.GetRawSize())
	rep.step(StepDiscard, 0)
	zeroed, note, err := t.discard(ctx, rawSize)
	if err != nil {
		return nil, err
	}
	if note != "" {
		log.Info("discard fell back", "note", note)
		rep.note(note)
	}
	if !zeroed && t.block && t.size > rawSize {
		// Without a discard, a stale backup GPT header at the end of the
		// disk would outlive the new image.
		tail := max(rawSize, t.size-mib)
		if err := t.zero(ctx, tail, t.size-tail); err != nil {
			return nil, err
		}
	}

	var res *agentv1.LayImageResult
	if len(req.GetBlockMap()) > 0 {
		res, err = l.layMap(ctx, t, req, zeroed, rep, log)
		if errors.Is(err, errRangeIgnored) && req.GetRawSha256() != "" {
			msg := "server ignores Range requests: streaming the whole raw image instead of the block map"
			log.Warn(msg)
			rep.note(msg)
			if zeroed, _, err = t.discard(ctx, rawSize); err != nil {
				return nil, err
			}
			res, err = l.layStream(ctx, t, req.GetUrl(), FormatRaw, req.GetRawSha256(), rawSize, zeroed, rep, log)
		}
	} else {
		res, err = l.layStream(ctx, t, req.GetUrl(), cmp.Or(req.GetFormat(), FormatRaw), req.GetSha256(), rawSize, zeroed, rep, log)
	}
	if err != nil {
		return nil, err
	}
	rep.step(StepSync, res.BytesWritten)
	if err := t.sync(); err != nil {
		return nil, err
	}
	return res, nil
}

func validate(req *agentv1.LayImageRequest) error {
	if req.GetTarget() == "" {
		return errdefs.InvalidArgument("lay image: target is required")
	}
	u, err := url.Parse(req.GetUrl())
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return errdefs.InvalidArgument("lay image: url %q is not an http(s) URL", redactURL(req.GetUrl()))
	}
	switch req.GetFormat() {
	case "", FormatRaw, FormatRawZst:
	default:
		return errdefs.InvalidArgument("lay image: format %q: want %q or %q", req.GetFormat(), FormatRaw, FormatRawZst)
	}
	if len(req.GetBlockMap()) == 0 {
		if !isHex256(req.GetSha256()) {
			return errdefs.InvalidArgument("lay image: sha256 %q is not 64 hex digits", req.GetSha256())
		}
		return nil
	}
	if req.GetFormat() == FormatRawZst {
		return errdefs.InvalidArgument("lay image: a block map needs the raw image (format raw), not raw.zst")
	}
	if req.GetRawSize() == 0 {
		return errdefs.InvalidArgument("lay image: a block map needs raw_size")
	}
	if req.GetRawSha256() != "" && !isHex256(req.GetRawSha256()) {
		return errdefs.InvalidArgument("lay image: raw_sha256 %q is not 64 hex digits", req.GetRawSha256())
	}
	var prevEnd uint64
	for i, r := range req.GetBlockMap() {
		end := r.GetOffset() + r.GetLength()
		switch {
		case r.GetLength() == 0:
			return errdefs.InvalidArgument("lay image: block map range %d (offset %d): empty", i, r.GetOffset())
		case i > 0 && r.GetOffset() < prevEnd:
			return errdefs.InvalidArgument("lay image: block map range %d (offset %d): overlaps or is out of order", i, r.GetOffset())
		case end < r.GetOffset() || end > req.GetRawSize():
			return errdefs.InvalidArgument("lay image: block map range %d (offset %d, length %d): beyond raw_size %d", i, r.GetOffset(), r.GetLength(), req.GetRawSize())
		case !isHex256(r.GetSha256()):
			return errdefs.InvalidArgument("lay image: block map range %d (offset %d): sha256 %q is not 64 hex digits", i, r.GetOffset(), r.GetSha256())
		}
		prevEnd = end
	}
	return nil
}

func isHex256(s string) bool {
	if len(s) != 64 {
		return false
	}
	for _, c := range s {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F') {
			return false
		}
	}
	return true
}

// redactURL drops user info, query and fragment, which may carry tokens.
func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparsable url)"
	}
	u.User = nil
	if u.RawQuery != "" {
		u.RawQuery = "REDACTED"
	}
	u.Fragment = ""
	return u.String()
}

// redactErr removes the query of URLs inside url.Errors.
func redactErr(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		ue.URL = redactURL(ue.URL)
	}
	return err
}

// httpStatusError maps a final HTTP status to an error class.
func httpStatusError(rawURL string, status int) error {
	msg := fmt.Sprintf("GET %s: server answered %d %s", redactURL(rawURL), status, strings.ToLower(http.StatusText(status)))
	switch {
	case status == http.StatusNotFound || status == http.StatusGone:
		return errdefs.NotFound("%s", msg)
	case status == http.StatusUnauthorized || status == http.StatusForbidden:
		return errdefs.PermissionDenied("%s", msg)
	case status >= 500 || status == http.StatusTooManyRequests:
		return errdefs.Unavailable("%s", msg)
	default:
		return errdefs.FailedPrecondition("%s", msg)
	}
}

// Wipe removes partition tables and filesystem signatures from target and
// discards it: it zeroes the first and the last MiB (MBR, both GPT headers,
// and the signatures of ext4, xfs, LVM, swap, ISO 9660, MD, ZFS labels) and
// the btrfs superblock mirrors at 64 MiB and 256 GiB, fsyncs, asks the
// kernel to re-read the partition table, then discards the whole target.
// Equivalent to: `wipefs -a TARGET && blkdiscard TARGET`.
//
// The target must exist (errdefs.NotFound) and be a block device, or a
// regular file in file-target mode (else errdefs.InvalidArgument).
// Discard is best effort; the zeroing is not.
func (l *Layer) Wipe(ctx context.Context, target string, progress func(*agentv1.Progress)) error {
	release, err := l.claim(target)
	if err != nil {
		return err
	}
	defer release()
	rep := newReporter(progress, l.now, l.interval)
	rep.step(StepWipe, 0)
	t, err := openTarget(target, false, l.fileTargets)
	if err != nil {
		return err
	}
	defer t.Close()
	if err := t.wipeSignatures(ctx); err != nil {
		return err
	}
	rep.step(StepDiscard, 0)
	if _, note, err := t.discard(ctx, 0); err != nil {
		return err
	} else if note != "" {
		l.log.Info("discard fell back", "target", target, "note", note)
		rep.note(note)
	}
	rep.step(StepDone, 0)
	l.log.Info("target wiped", "target", target)
	return nil
}

// exists reports whether path exists.
func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
