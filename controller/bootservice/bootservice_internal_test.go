package bootservice

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

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
		got, err := AgentControllerAddr(tt.url, tt.api)
		if tt.bad {
			if !errdefs.IsInvalidArgument(err) {
				t.Errorf("AgentControllerAddr(%q, %q) = %q, %v, want InvalidArgument", tt.url, tt.api, got, err)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("AgentControllerAddr(%q, %q) = %q, %v, want %q", tt.url, tt.api, got, err, tt.want)
		}
	}
}

// TestInstalledControllerURL: the URL in a laid image's identity names
// the same host and port boot agents enroll with; without a port in
// --controller-url, the API's (it used to be the URL as given, which an
// installed agent dialled at port 443).
func TestInstalledControllerURL(t *testing.T) {
	for _, tt := range []struct{ url, api, want string }{
		{"", "127.0.0.1:7443", "https://127.0.0.1:7443"}, // the root passes clientAddr(listen address)
		{"https://10.253.25.1", "10.253.25.1:34017", "https://10.253.25.1:34017"},
		{"https://ctl.rack1.example", "[::]:7443", "https://ctl.rack1.example:7443"},
		{"https://ctl.rack1.example:9443/", "[::]:7443", "https://ctl.rack1.example:9443"},
	} {
		got, err := InstalledControllerURL(tt.url, tt.api)
		require.NoError(t, err, "%q, %q", tt.url, tt.api)
		require.Equal(t, tt.want, got, "InstalledControllerURL(%q, %q)", tt.url, tt.api)
		boot, err := AgentControllerAddr(tt.url, tt.api)
		require.NoError(t, err)
		require.Equal(t, "https://"+boot, got, "installed and boot agents reach different addresses")
	}
	_, err := InstalledControllerURL("10.77.0.1:7443", "[::]:7443")
	require.True(t, errdefs.IsInvalidArgument(err), "no scheme: %v", err)
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
