// Package backoff computes exponential, jittered, capped delays. It holds
// no clock: callers pass the attempt number and a random source.
package backoff

import (
	"math/rand/v2"
	"time"
)

// Policy describes an exponential backoff: Base * Factor^attempt, capped at
// Max, with up to Jitter (a fraction, 0..1) removed at random.
type Policy struct {
	Base   time.Duration
	Max    time.Duration
	Factor float64
	Jitter float64
}

// Default is 1s doubling to 5m with 20% jitter.
var Default = Policy{Base: time.Second, Max: 5 * time.Minute, Factor: 2, Jitter: 0.2}

// Delay returns the delay before retry number attempt (0-based). r may be
// nil for no jitter.
func (p Policy) Delay(attempt int, r *rand.Rand) time.Duration {
	if attempt < 0 {
		attempt = 0
	}
	f := p.Factor
	if f < 1 {
		f = 2
	}
	d := float64(p.Base)
	for i := 0; i < attempt && d < float64(p.Max); i++ {
		d *= f
	}
	if p.Max > 0 && d > float64(p.Max) {
		d = float64(p.Max)
	}
	if p.Jitter > 0 && r != nil {
		d -= d * p.Jitter * r.Float64()
	}
	return time.Duration(d)
}
