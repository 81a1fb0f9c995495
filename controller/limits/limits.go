// Package limits bounds what one caller may ask of the controller: a
// request rate per caller (token buckets of golang.org/x/time/rate) on the
// gRPC API and the boot server, and a number of open streams per caller.
// A caller over its limit is refused at once with how long to wait
// (gRPC ResourceExhausted, HTTP 429 with Retry-After); other callers are
// not slowed down.
//
// A caller is its certificate identity (role and name) on the API and its
// address where it has no certificate (enrollment, the boot server).
package limits

import (
	"fmt"
	"math"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// Rate is a token bucket: PerSecond requests a second on average, Burst
// at once. PerSecond < 0 means no limit.
type Rate struct {
	PerSecond float64
	Burst     int
}

// Unlimited reports whether r limits nothing.
func (r Rate) Unlimited() bool { return r.PerSecond < 0 }

func (r Rate) String() string {
	if r.Unlimited() {
		return "no limit"
	}
	return fmt.Sprintf("%g requests per second (bursts of %d)", r.PerSecond, r.Burst)
}

// maxKeys bounds how many callers a Limiter remembers. Past it, callers
// whose buckets are full (idle long enough to be as good as new) are
// forgotten; if all are busy the Limiter starts over, which at worst gives
// every caller one more burst.
const maxKeys = 10_000

// Limiter keeps one token bucket per caller key. It is safe for
// concurrent use. The clock is injected: every decision takes the time
// from it, so tests decide without waiting.
type Limiter struct {
	rate  Rate
	clock func() time.Time

	mu      sync.Mutex
	buckets map[string]*rate.Limiter
}

// NewLimiter returns a Limiter of r per key; clock is time.Now when nil.
func NewLimiter(r Rate, clock func() time.Time) *Limiter {
	if clock == nil {
		clock = time.Now
	}
	if r.Burst < 1 {
		r.Burst = 1
	}
	return &Limiter{rate: r, clock: clock, buckets: map[string]*rate.Limiter{}}
}

// Rate is the limiter's rate.
func (l *Limiter) Rate() Rate { return l.rate }

// Allow spends one request of key's bucket. When the bucket is empty it
// spends nothing and returns false and how long until a request is
// allowed again (rounded up to a whole second, at least one).
func (l *Limiter) Allow(key string) (bool, time.Duration) {
	if l.rate.Unlimited() {
		return true, 0
	}
	now := l.clock()
	l.mu.Lock()
	defer l.mu.Unlock()
	b := l.buckets[key]
	if b == nil {
		if len(l.buckets) >= maxKeys {
			l.sweep(now)
		}
		b = rate.NewLimiter(rate.Limit(l.rate.PerSecond), l.rate.Burst)
		l.buckets[key] = b
	}
	r := b.ReserveN(now, 1)
	if !r.OK() {
		return false, time.Hour
	}
	if d := r.DelayFrom(now); d > 0 {
		r.CancelAt(now)
		return false, time.Duration(math.Ceil(d.Seconds())) * time.Second
	}
	return true, 0
}

// sweep forgets full buckets, and everything when none is full.
func (l *Limiter) sweep(now time.Time) {
	for k, b := range l.buckets {
		if b.TokensAt(now) >= float64(l.rate.Burst) {
			delete(l.buckets, k)
		}
	}
	if len(l.buckets) >= maxKeys {
		clear(l.buckets)
	}
}

// Counter bounds how many things (streams) each key holds at once. It is
// safe for concurrent use.
type Counter struct {
	max int // <= 0: no bound
	mu  sync.Mutex
	n   map[string]int
}

// NewCounter returns a Counter of at most max per key (no bound when
// max <= 0).
func NewCounter(max int) *Counter { return &Counter{max: max, n: map[string]int{}} }

// Acquire takes one for key; false when key holds max already. Call the
// returned release exactly once when done.
func (c *Counter) Acquire(key string) (release func(), ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.max > 0 && c.n[key] >= c.max {
		return nil, false
	}
	c.n[key]++
	var once sync.Once
	return func() {
		once.Do(func() {
			c.mu.Lock()
			defer c.mu.Unlock()
			if c.n[key]--; c.n[key] <= 0 {
				delete(c.n, key)
			}
		})
	}, true
}

// Max is the bound per key (<= 0: none).
func (c *Counter) Max() int { return c.max }
