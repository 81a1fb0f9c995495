package sweep

import (
	"testing"
	"time"
)

func TestLeaderWatch(t *testing.T) {
	t0 := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	steps := []struct {
		at     time.Duration
		leader bool
		want   bool
	}{
		{0, false, false},               // first look: no leader yet
		{5 * time.Second, false, false}, // within the grace
		{10 * time.Second, false, true}, // grace over: tell the hosts
		{11 * time.Second, true, false}, // a leader appeared
		{12 * time.Second, false, false},
		{21 * time.Second, false, false}, // grace counts from 12s again
		{22 * time.Second, false, true},
	}
	w := leaderWatch{grace: 10 * time.Second}
	for _, s := range steps {
		if got := w.observe(s.leader, t0.Add(s.at)); got != s.want {
			t.Errorf("observe(leader %v, t0+%v) = %v, want %v", s.leader, s.at, got, s.want)
		}
	}
}
