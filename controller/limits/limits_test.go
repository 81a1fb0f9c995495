package limits

import (
	"testing"
	"time"
)

func TestLimiter(t *testing.T) {
	now := time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)
	l := NewLimiter(Rate{PerSecond: 0.5, Burst: 3}, func() time.Time { return now })
	for i := range 3 {
		if ok, _ := l.Allow("mallory"); !ok {
			t.Fatalf("Allow(mallory) #%d = false, want true within the burst", i+1)
		}
	}
	ok, wait := l.Allow("mallory")
	if ok || wait != 2*time.Second {
		t.Errorf("Allow(mallory) past the burst = %v, %v, want false, 2s", ok, wait)
	}
	if ok, _ := l.Allow("alice"); !ok {
		t.Errorf("Allow(alice) = false while only mallory spent her bucket, want true")
	}
	now = now.Add(2 * time.Second)
	if ok, _ := l.Allow("mallory"); !ok {
		t.Errorf("Allow(mallory) after the wait = false, want true")
	}
	if ok, _ := NewLimiter(Rate{PerSecond: -1}, nil).Allow("x"); !ok {
		t.Errorf("an unlimited Limiter refused")
	}
}

func TestLimiterForgetsIdleCallers(t *testing.T) {
	now := time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)
	l := NewLimiter(Rate{PerSecond: 1, Burst: 1}, func() time.Time { return now })
	for i := range maxKeys {
		l.Allow(time.Duration(i).String())
	}
	now = now.Add(time.Second) // every bucket is full again
	l.Allow("new")
	if n := len(l.buckets); n != 1 {
		t.Errorf("after %d idle callers and one new, the Limiter remembers %d, want 1", maxKeys, n)
	}
}

func TestCounter(t *testing.T) {
	c := NewCounter(2)
	r1, ok1 := c.Acquire("agent:a")
	_, ok2 := c.Acquire("agent:a")
	_, ok3 := c.Acquire("agent:a")
	if !ok1 || !ok2 || ok3 {
		t.Fatalf("Acquire x3 = %v %v %v, want true true false", ok1, ok2, ok3)
	}
	if _, ok := c.Acquire("agent:b"); !ok {
		t.Errorf("Acquire(agent:b) = false, want true (another caller)")
	}
	r1()
	r1() // a second release is a no-op
	if _, ok := c.Acquire("agent:a"); !ok {
		t.Errorf("Acquire(agent:a) after a release = false, want true")
	}
	if _, ok := c.Acquire("agent:a"); ok {
		t.Errorf("Acquire(agent:a) = true with 2 held, want false (double release counted twice?)")
	}
}
