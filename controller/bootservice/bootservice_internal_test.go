package bootservice

import (
	"testing"
	"time"

	"github.com/kilnhq/kiln/internal/errdefs"
)

func TestAgentControllerAddr(t *testing.T) {
	tests := []struct {
		url, api, want string
		bad            bool
	}{
		{"", "127.0.0.1:7443", "127.0.0.1:7443", false},
		{"", "10.77.0.1:7443", "10.77.0.1:7443", false},
		{"https://10.77.0.1:7443", "127.0.0.1:7443", "10.77.0.1:7443", false},
		{"https://ctl.rack1.example", "127.0.0.1:7443", "ctl.rack1.example:7443", false},
		{"https://[fd77::1]:9443", "127.0.0.1:7443", "[fd77::1]:9443", false},
		{"10.77.0.1:7443", "127.0.0.1:7443", "", true}, // no scheme: not a URL
	}
	for _, tt := range tests {
		got, err := agentControllerAddr(tt.url, tt.api)
		if tt.bad {
			if !errdefs.IsInvalidArgument(err) {
				t.Errorf("agentControllerAddr(%q, %q) = %q, %v, want InvalidArgument", tt.url, tt.api, got, err)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("agentControllerAddr(%q, %q) = %q, %v, want %q", tt.url, tt.api, got, err, tt.want)
		}
	}
}

// TestBootTokensRefill checks the per-host bucket against a fake clock:
// limit tokens at once, then one per ttl/limit.
func TestBootTokensRefill(t *testing.T) {
	now := time.Date(2026, 12, 2, 15, 0, 0, 0, time.UTC)
	b := newBootTokens(nil, nil, 30*time.Minute, 3, func() time.Time { return now })
	steps := []struct {
		advance time.Duration
		host    string
		want    bool
		wait    time.Duration // when refused: how long until a token is back
	}{
		{0, "a", true, 0}, {0, "a", true, 0}, {0, "a", true, 0},
		{0, "a", false, 10 * time.Minute},
		{0, "b", true, 0}, // another host has its own bucket
		{9 * time.Minute, "a", false, time.Minute},
		{time.Minute, "a", true, 0}, // 10 min = ttl/limit: one back
		{0, "a", false, 10 * time.Minute},
		{2 * time.Hour, "a", true, 0}, {0, "a", true, 0}, {0, "a", true, 0}, // refilled to limit, not beyond
		{0, "a", false, 10 * time.Minute},
	}
	for i, s := range steps {
		now = now.Add(s.advance)
		if got, wait := b.take(s.host); got != s.want || wait != s.wait {
			t.Errorf("step %d: take(%q) = %v, %v, want %v, %v", i, s.host, got, wait, s.want, s.wait)
		}
	}
	unlimited := newBootTokens(nil, nil, time.Minute, -1, time.Now)
	for i := range 100 {
		if ok, _ := unlimited.take("a"); !ok {
			t.Fatalf("take #%d with no limit refused", i)
		}
	}
}
