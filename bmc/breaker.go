package bmc

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// ConditionBMCReachable is the condition type a BMC reports for its host.
const ConditionBMCReachable = "BMCReachable"

// Reasons of the BMCReachable condition.
const (
	ReasonNotContacted = "NotContacted"
	ReasonReachable    = "Reachable"
	ReasonCallFailed   = "CallFailed"
	ReasonCircuitOpen  = "CircuitOpen"
	// ReasonRefused: the BMC answers but refuses what Kiln asks in a way
	// retrying cannot fix (credentials, authentication method, TLS trust);
	// the message says what to change. It does not open the circuit.
	ReasonRefused = "Refused"
)

// breaker is a per-BMC circuit breaker: after threshold consecutive failed
// calls it rejects calls for cooldown, then lets one trial call through;
// the trial's success closes it, its failure re-opens it.
type breaker struct {
	threshold int
	cooldown  time.Duration

	failures int
	last     string
	// permanent is the last error that retrying cannot fix (bad
	// credentials, a spec that does not fit the BMC): shown in the
	// condition but not counted toward opening the circuit.
	permanent   string
	openUntil   time.Time
	lastSuccess time.Time
	contacted   bool
}

// countsAsFailure is false for errors that say nothing about the BMC's
// health: bad input, unsupported operations, refused credentials, a spec
// that does not fit the BMC, and calls the caller cancelled. Only
// transport faults, timeouts and 5xx answers (Unavailable) count.
func countsAsFailure(err error) bool {
	return !errdefs.IsInvalidArgument(err) && !errdefs.IsNotSupported(err) && !errors.Is(err, context.Canceled) &&
		!isPermanent(err)
}

// isPermanent is true for errors that only a change of the Host spec or
// of the BMC's accounts can fix.
func isPermanent(err error) bool {
	return errdefs.IsPermissionDenied(err) || errdefs.IsFailedPrecondition(err)
}

// allow returns an Unavailable error while the circuit is open.
func (b *BMC) allow() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	br := &b.brk
	if br.failures < br.threshold {
		return nil
	}
	if b.opts.Now().Before(br.openUntil) {
		return errdefs.Unavailable("%s", b.circuitMessageLocked())
	}
	// Half-open: this call is the trial (calls are serialised per BMC).
	return nil
}

func (b *BMC) circuitMessageLocked() string {
	return fmt.Sprintf("circuit open for bmc %s: %d consecutive failures, last: %s",
		b.opts.Name, b.brk.failures, b.brk.last)
}

// record updates the breaker with a call's outcome.
func (b *BMC) record(err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	br := &b.brk
	if err != nil && isPermanent(err) {
		br.contacted = true
		br.permanent = err.Error()
		return
	}
	if err != nil && !countsAsFailure(err) {
		return
	}
	br.contacted = true
	if err == nil {
		br.failures, br.last, br.permanent = 0, "", ""
		br.lastSuccess = b.opts.Now()
		return
	}
	br.failures++
	br.last, br.permanent = err.Error(), ""
	if br.failures >= br.threshold {
		br.openUntil = b.opts.Now().Add(br.cooldown)
	}
}

// recordAttempt counts a failed attempt (one that timed out) on the
// breaker before its call ends. It reports whether the call may go on:
// false once the circuit is open.
func (b *BMC) recordAttempt(err error) bool {
	b.record(err)
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.brk.failures < b.brk.threshold
}

// Condition returns the BMCReachable condition for the host: Unknown
// before the first call, True after a successful call, False with reason
// CallFailed after failures, False with reason Refused after an error
// that only a spec or account change fixes (bad credentials, an auth
// method the BMC lacks), and False with reason CircuitOpen while the
// breaker rejects calls. A True condition says which Redfish auth method
// is in use and which system was picked when the BMC has several. Set it
// on the Host with conditions.Set.
func (b *BMC) Condition() *typesv1.Condition {
	b.mu.Lock()
	defer b.mu.Unlock()
	br := &b.brk
	switch {
	case !br.contacted:
		return conditions.New(ConditionBMCReachable, conditions.Unknown, ReasonNotContacted,
			fmt.Sprintf("bmc %s has not been contacted yet", b.opts.Name))
	case br.failures >= br.threshold:
		c := conditions.New(ConditionBMCReachable, conditions.False, ReasonCircuitOpen,
			fmt.Sprintf("%s; next try after %s", b.circuitMessageLocked(), br.openUntil.UTC().Format(time.RFC3339)))
		c.Severity = "Error"
		return c
	case br.permanent != "":
		c := conditions.New(ConditionBMCReachable, conditions.False, ReasonRefused, br.permanent)
		c.Severity = "Error"
		return c
	case br.failures == 0:
		msg := fmt.Sprintf("bmc %s answered at %s", b.opts.Name, br.lastSuccess.UTC().Format(time.RFC3339))
		if d, ok := b.drv.(describer); ok {
			if s := d.describe(); s != "" {
				msg += "; " + s
			}
		}
		return conditions.New(ConditionBMCReachable, conditions.True, ReasonReachable, msg)
	default:
		c := conditions.New(ConditionBMCReachable, conditions.False, ReasonCallFailed,
			fmt.Sprintf("bmc %s: %d consecutive failures, last: %s", b.opts.Name, br.failures, br.last))
		c.Severity = "Warning"
		return c
	}
}

// CircuitOpen reports whether calls are currently rejected.
func (b *BMC) CircuitOpen() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.brk.failures >= b.brk.threshold && b.opts.Now().Before(b.brk.openUntil)
}
