package lay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	retryablehttp "github.com/hashicorp/go-retryablehttp"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// errRangeIgnored: the server answered a Range request of a block-map
// fetch with the whole object.
var errRangeIgnored = errors.New("server ignores HTTP Range requests")

// stream is an io.Reader over the bytes [start, end) of an HTTP object
// that survives dropped connections: it reopens the object with a Range
// request from the first byte not yet delivered (with If-Range, so a
// changed object is not spliced). If the server answers such a request
// with 200 and the whole object, it reads from byte 0 again and discards
// what it already delivered, and says so through note (the final hash
// still covers every delivered byte). A ranged stream (block map) instead
// fails with errRangeIgnored.
//
// Failed attempts are bounded: a request is retried by retryablehttp
// (connection errors, 5xx, 429); a body that breaks is reopened at most
// retries times in a row without a byte of progress.
type stream struct {
	ctx    context.Context
	l      *Layer
	log    *slog.Logger
	url    string
	ranged bool  // the server must honour Range (block-map fetch)
	end    int64 // one past the last byte wanted; -1 until known
	off    int64 // next byte to deliver
	total  int64 // size of the whole object; -1 until known

	body       io.ReadCloser
	cancelReq  context.CancelFunc
	watchdog   *time.Timer // cancels the request when no byte arrives for l.stall
	stalled    atomic.Bool // the watchdog fired
	validator  string      // ETag or Last-Modified of the first answer
	failures   int         // consecutive broken attempts
	progressed bool        // bytes arrived since the last open
	lastErr    error
	requests   int

	fetched *atomic.Int64 // bytes received, discarded ones included
	note    func(string)
	onTotal func(int64)
}

func (l *Layer) newStream(ctx context.Context, log *slog.Logger, url string, start, end int64, ranged bool, fetched *atomic.Int64) *stream {
	return &stream{
		ctx: ctx, l: l, log: log, url: url, ranged: ranged,
		off: start, end: end, total: -1, fetched: fetched,
		note: func(string) {}, onTotal: func(int64) {},
	}
}

func (s *stream) Close() error {
	var err error
	if s.body != nil {
		err = s.body.Close()
		s.body = nil
	}
	s.endRequest()
	return err
}

// startRequest returns the context of one request, cancelled by the
// watchdog when no byte arrives for the stall timeout.
func (s *stream) startRequest() context.Context {
	s.endRequest()
	ctx, cancel := context.WithCancel(s.ctx)
	s.cancelReq = cancel
	s.stalled.Store(false)
	s.watchdog = time.AfterFunc(s.l.stall, func() {
		s.stalled.Store(true)
		cancel()
	})
	return ctx
}

func (s *stream) endRequest() {
	if s.watchdog != nil {
		s.watchdog.Stop()
		s.watchdog = nil
	}
	if s.cancelReq != nil {
		s.cancelReq()
		s.cancelReq = nil
	}
}

// bodyRead reads under the watchdog: only the time spent waiting for the
// server counts, not the time the pipeline takes to ask for more.
func (s *stream) bodyRead(r io.Reader, p []byte) (int, error) {
	s.watchdog.Reset(s.l.stall)
	n, err := r.Read(p)
	s.watchdog.Stop()
	return n, err
}

type readFunc func([]byte) (int, error)

func (f readFunc) Read(p []byte) (int, error) { return f(p) }

// stallErr replaces the error of a request the watchdog cancelled.
func (s *stream) stallErr(err error) error {
	if s.stalled.Load() && s.ctx.Err() == nil {
		return fmt.Errorf("no data for %v", s.l.stall)
	}
	return err
}

func (s *stream) Read(p []byte) (int, error) {
	for {
		if s.end >= 0 && s.off >= s.end {
			s.Close()
			return 0, io.EOF
		}
		if s.body == nil {
			if err := s.open(); err != nil {
				return 0, err
			}
		}
		if s.end >= 0 && int64(len(p)) > s.end-s.off {
			p = p[:s.end-s.off]
		}
		n, err := s.bodyRead(s.body, p)
		s.off += int64(n)
		s.fetched.Add(int64(n))
		if n > 0 {
			s.progressed = true
		}
		if err == nil {
			return n, nil
		}
		s.Close()
		if err == io.EOF {
			if s.end < 0 || s.off >= s.end {
				// Unknown length: the server's end is the end, and the
				// hash decides whether it was all.
				s.end = s.off
				return n, nil
			}
			err = io.ErrUnexpectedEOF
		}
		if cerr := s.ctx.Err(); cerr != nil {
			return n, cerr
		}
		err = s.stallErr(err)
		s.lastErr = err
		if s.progressed {
			s.failures = 1
		} else {
			s.failures++
		}
		s.log.Warn("image stream broke; resuming", "at", s.off, "of", s.end, "attempt", s.failures, "error", redactErr(err))
		if n > 0 {
			return n, nil
		}
	}
}

// giveUp is the error after the last failed attempt.
func (s *stream) giveUp(cause error) error {
	if s.end >= 0 {
		return errdefs.Unavailable("stream truncated at %d of %d bytes after %d requests: %v", s.off, s.end, s.requests, cause)
	}
	return errdefs.Unavailable("stream broken at %d bytes after %d requests: %v", s.off, s.requests, cause)
}

// open (re)opens the body at s.off, waiting out the backoff after a
// failure.
func (s *stream) open() error {
	for {
		if s.failures > 0 {
			if s.failures > s.l.retries {
				return s.giveUp(s.lastErr)
			}
			timer := time.NewTimer(s.l.policy.Delay(s.failures-1, nil))
			select {
			case <-s.ctx.Done():
				timer.Stop()
				return s.ctx.Err()
			case <-timer.C:
			}
		}
		s.progressed = false
		req, err := retryablehttp.NewRequestWithContext(s.startRequest(), http.MethodGet, s.url, nil)
		if err != nil {
			return errdefs.InvalidArgument("url %q: %v", redactURL(s.url), err)
		}
		wantRange := s.off > 0 || s.ranged
		if wantRange {
			if s.end >= 0 {
				req.Header.Set("Range", fmt.Sprintf("bytes=%d-%d", s.off, s.end-1))
			} else {
				req.Header.Set("Range", fmt.Sprintf("bytes=%d-", s.off))
			}
			if s.validator != "" {
				req.Header.Set("If-Range", s.validator)
			}
		}
		s.requests++
		resp, err := s.l.client.Do(req)
		s.watchdog.Stop()
		if err != nil {
			if cerr := s.ctx.Err(); cerr != nil {
				return cerr
			}
			if s.stalled.Load() { // no answer in time: counts as a broken attempt
				s.lastErr = s.stallErr(err)
				s.failures++
				continue
			}
			return s.giveUp(err)
		}
		if s.validator == "" {
			s.validator = resp.Header.Get("ETag")
			if s.validator == "" || strings.HasPrefix(s.validator, "W/") {
				s.validator = resp.Header.Get("Last-Modified")
			}
		}
		switch resp.StatusCode {
		case http.StatusPartialContent:
			first, total, err := parseContentRange(resp.Header.Get("Content-Range"))
			if err != nil || first != s.off {
				resp.Body.Close()
				return errdefs.FailedPrecondition("GET %s: asked for bytes from %d, server sent Content-Range %q", redactURL(s.url), s.off, resp.Header.Get("Content-Range"))
			}
			s.setTotal(total)
			s.body = resp.Body
			return nil
		case http.StatusOK:
			s.setTotal(resp.ContentLength)
			if wantRange {
				if s.ranged {
					resp.Body.Close()
					return errRangeIgnored
				}
				s.note(fmt.Sprintf("server ignored the Range request (answered 200): restarting the stream from byte 0 and discarding the %d bytes already received", s.off))
				s.log.Warn("server ignored Range; restarting the stream from byte 0", "discard", s.off)
				body := resp.Body
				n, err := io.CopyN(io.Discard, readFunc(func(p []byte) (int, error) { return s.bodyRead(body, p) }), s.off)
				s.fetched.Add(n)
				if err != nil {
					resp.Body.Close()
					if cerr := s.ctx.Err(); cerr != nil {
						return cerr
					}
					s.lastErr = fmt.Errorf("re-reading the first %d bytes: %w", s.off, s.stallErr(err))
					s.failures++
					continue
				}
			}
			s.body = resp.Body
			return nil
		default:
			resp.Body.Close()
			return httpStatusError(s.url, resp.StatusCode)
		}
	}
}

// setTotal records the object's size once known; an unbounded stream then
// ends there.
func (s *stream) setTotal(total int64) {
	if total < 0 || s.total >= 0 {
		return
	}
	s.total = total
	if s.end < 0 {
		s.end = total
	}
	s.onTotal(total)
}

// parseContentRange parses "bytes first-last/total" ("*" total is -1).
func parseContentRange(v string) (first, total int64, err error) {
	rest, ok := strings.CutPrefix(v, "bytes ")
	if !ok {
		return 0, 0, fmt.Errorf("content-range %q: no bytes unit", v)
	}
	span, size, ok := strings.Cut(rest, "/")
	if !ok {
		return 0, 0, fmt.Errorf("content-range %q: no total", v)
	}
	f, _, ok := strings.Cut(span, "-")
	if !ok {
		return 0, 0, fmt.Errorf("content-range %q: no span", v)
	}
	if first, err = strconv.ParseInt(f, 10, 64); err != nil {
		return 0, 0, fmt.Errorf("content-range %q: %w", v, err)
	}
	total = -1
	if size != "*" {
		if total, err = strconv.ParseInt(size, 10, 64); err != nil {
			return 0, 0, fmt.Errorf("content-range %q: %w", v, err)
		}
	}
	return first, total, nil
}
