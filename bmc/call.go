package bmc

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"
	"time"

	"github.com/stmcginnis/gofish/common"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// lateResultGrace is how long do waits, after ctx ends, for the
// operation's own error.
const lateResultGrace = 100 * time.Millisecond

// do runs one operation: circuit check, per-BMC slot, global slot,
// attempts with backoff, all under a deadline. The operation runs in its
// own goroutine so that do returns when ctx ends even if a provider does
// not honour ctx (bmclib's Redfish provider bounds requests only by the
// HTTP client timeout); the BMC's slot stays taken until that goroutine
// has finished, so a late request never overlaps the next operation.
func (b *BMC) do(ctx context.Context, op string, fn func(context.Context) error) (err error) {
	if o := b.opts.Observer; o != nil {
		start := b.opts.Now()
		defer func() {
			o.ObserveBMCCall(b.ep.Protocol, strings.ReplaceAll(op, " ", "_"), err, b.opts.Now().Sub(start))
		}()
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, b.opts.Timeout)
		defer cancel()
	}

	select {
	case b.slot <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("bmc %s: %s: waiting for the previous operation: %w", b.opts.Name, op, ctx.Err())
	}
	releaseSlot := func() { <-b.slot }

	if err := b.allow(); err != nil {
		releaseSlot()
		return err
	}
	if b.lim != nil {
		if err := b.lim.acquire(ctx); err != nil {
			releaseSlot()
			return fmt.Errorf("bmc %s: %s: waiting for a global slot: %w", b.opts.Name, op, err)
		}
	}

	b.mu.Lock()
	b.stats.Calls++
	b.inFlight++
	b.stats.MaxInFlight = max(b.stats.MaxInFlight, b.inFlight)
	b.mu.Unlock()

	done := make(chan error, 1)
	go func() {
		err := b.attempts(ctx, op, fn)
		b.mu.Lock()
		b.inFlight--
		b.mu.Unlock()
		if b.lim != nil {
			b.lim.release()
		}
		releaseSlot()
		done <- err
	}()

	select {
	case err = <-done:
	case <-ctx.Done():
		// The operation sees the same ctx; give it a moment to return its
		// own, more telling error (e.g. "still reports off").
		t := time.NewTimer(lateResultGrace)
		select {
		case err = <-done:
		case <-t.C:
			err = lateError(b.opts.Name, op, ctx.Err())
		}
		t.Stop()
	}
	b.record(err)
	if err != nil {
		b.log.Warn("bmc call failed", "op", op, "error", err)
	}
	return err
}

// lateError is do's error when ctx ended before the operation returned
// (its attempt still runs: an ipmitool slow to die, a provider that does
// not honour ctx). A deadline is the BMC giving no answer in time,
// Unavailable like every other timeout, so callers retry it and the
// condition says so; a caller's cancellation stays only that.
func lateError(name, op string, ctxErr error) error {
	if errors.Is(ctxErr, context.DeadlineExceeded) {
		return errdefs.Unavailable("bmc %s: %s: no answer before the deadline: %w", name, op, ctxErr)
	}
	return fmt.Errorf("bmc %s: %s: %w", name, op, ctxErr)
}

// attempts runs fn until it succeeds, fails permanently, runs out of
// attempts or of time.
func (b *BMC) attempts(ctx context.Context, op string, fn func(context.Context) error) error {
	var last error
	timeouts := 0
	for attempt := 0; ; attempt++ {
		b.mu.Lock()
		b.stats.Attempts++
		b.mu.Unlock()

		if ra, ok := b.drv.(retryAdviser); ok {
			ra.retryAfter() // forget a Retry-After noted before this attempt
		}
		actx, cancel := context.WithTimeout(ctx, b.opts.AttemptTimeout)
		err := fn(actx)
		attemptTimedOut := actx.Err() != nil && ctx.Err() == nil
		cancel()
		if err == nil {
			return nil
		}
		last = b.classify(op, err, attemptTimedOut)
		if !retryable(last) || attempt+1 >= b.opts.MaxAttempts || ctx.Err() != nil {
			break
		}
		if isTimeout(last) {
			// A BMC that gave no answer: count it now (the condition turns
			// False before the call ends), and try once more at most.
			timeouts++
			if timeouts >= 2 || !b.recordAttempt(last) {
				break
			}
		}
		b.mu.Lock()
		delay := b.opts.Backoff.Delay(attempt, b.rng)
		b.mu.Unlock()
		if ra, ok := b.drv.(retryAdviser); ok {
			// A BMC that says when to come back (503/429 Retry-After) is
			// believed, up to maxRetryAfter.
			delay = max(delay, min(ra.retryAfter(), maxRetryAfter))
		}
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < delay {
			break
		}
		t := time.NewTimer(delay)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return last
		}
	}
	b.mu.Lock()
	b.stats.Failures++
	b.mu.Unlock()
	return last
}

// retryAdviser is a driver that knows how long the BMC asked to wait.
type retryAdviser interface {
	retryAfter() time.Duration
}

// maxRetryAfter caps the wait a BMC's Retry-After can ask for.
const maxRetryAfter = 30 * time.Second

// isTimeout reports whether a classified error is an attempt that got no
// answer in time.
func isTimeout(err error) bool {
	return errdefs.IsUnavailable(err) && errors.Is(err, context.DeadlineExceeded)
}

func retryable(err error) bool {
	return errdefs.IsUnavailable(err)
}

// classify turns a provider error into an errdefs-classed error with the
// password redacted from its text. The provider error itself is not
// wrapped (its text may carry what a BMC echoed back); only ctx errors
// are.
func (b *BMC) classify(op string, err error, attemptTimedOut bool) error {
	msg := redact(err.Error(), b.ep.Username, b.ep.Password)
	prefix := fmt.Sprintf("bmc %s: %s", b.opts.Name, op)

	// Our own errors (drivers, waitPower) keep their class.
	switch {
	case errdefs.IsUnavailable(err):
		if errors.Is(err, context.DeadlineExceeded) {
			return errdefs.Unavailable("%s: %s: %w", prefix, msg, context.DeadlineExceeded)
		}
		return errdefs.Unavailable("%s: %s", prefix, msg)
	case errdefs.IsNotSupported(err):
		return errdefs.NotSupported("%s: %s", prefix, msg)
	case errdefs.IsInvalidArgument(err):
		return errdefs.InvalidArgument("%s: %s", prefix, msg)
	case errdefs.IsNotFound(err):
		return errdefs.NotFound("%s: %s", prefix, msg)
	case errdefs.IsFailedPrecondition(err):
		return errdefs.FailedPrecondition("%s: %s", prefix, msg)
	case errdefs.IsPermissionDenied(err):
		return errdefs.PermissionDenied("%s: %s", prefix, msg)
	}

	var rf *common.Error
	if errors.As(err, &rf) {
		code := rf.HTTPReturnedStatusCode
		switch {
		case code == 401 || code == 403:
			return errdefs.PermissionDenied("%s: http %d: %s", prefix, code, msg)
		case code == 404:
			return errdefs.NotFound("%s: http %d: %s", prefix, code, msg)
		case code == 429 || code >= 500:
			return errdefs.Unavailable("%s: http %d: %s", prefix, code, msg)
		case code >= 400:
			return errdefs.InvalidArgument("%s: http %d: %s", prefix, code, msg)
		}
	}
	var cve *tls.CertificateVerificationError
	if errors.As(err, &cve) {
		return errdefs.FailedPrecondition("%s: the bmc's tls certificate is not trusted (set root CAs or insecure skip verify): %s", prefix, msg)
	}
	var te interface{ Timeout() bool }
	if attemptTimedOut || errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &te) && te.Timeout()) {
		msg = strings.TrimSuffix(msg, ": "+context.DeadlineExceeded.Error())
		return errdefs.Unavailable("%s: attempt timed out: the bmc gave no answer (connect %s, response headers %s, attempt %s): %s: %w",
			prefix, b.opts.ConnectTimeout, b.opts.ResponseTimeout, b.opts.AttemptTimeout, msg, context.DeadlineExceeded)
	}
	if errors.Is(err, context.Canceled) {
		return fmt.Errorf("%s: %s: %w", prefix, msg, context.Canceled)
	}
	var ne net.Error
	if errors.As(err, &ne) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return errdefs.Unavailable("%s: cannot reach the bmc (%s): check spec.bmc.address and the BMC network", prefix, msg)
	}
	lower := strings.ToLower(msg)
	switch {
	case strings.Contains(lower, "rakp 2 hmac is invalid"), strings.Contains(lower, "unauthorized name"),
		strings.Contains(lower, "401 unauthorized"), strings.Contains(lower, "invalid username or password"):
		return errdefs.PermissionDenied("%s: %s", prefix, msg)
	case strings.Contains(lower, "is not supported by this service"), strings.Contains(lower, "invalid boot device"),
		strings.Contains(lower, "not a supported media type"), strings.Contains(lower, "does not support"):
		return errdefs.NotSupported("%s: %s", prefix, msg)
	case strings.Contains(lower, "no matching redfish system"):
		return errdefs.NotFound("%s: %s", prefix, msg)
	}
	// Everything else (ipmitool session errors, odd BMC answers) is treated
	// as transient: a retry costs little and the breaker bounds it.
	return errdefs.Unavailable("%s: %s", prefix, msg)
}

// redactErr rebuilds err with the credentials removed (see redact),
// keeping its errdefs class.
func redactErr(err error, user, secret string) error {
	if err == nil {
		return nil
	}
	msg := redact(err.Error(), user, secret)
	if msg == err.Error() {
		return err
	}
	switch {
	case errdefs.IsInvalidArgument(err):
		return errdefs.InvalidArgument("%s", msg)
	case errdefs.IsFailedPrecondition(err):
		return errdefs.FailedPrecondition("%s", msg)
	}
	return errdefs.Unavailable("%s", msg)
}
