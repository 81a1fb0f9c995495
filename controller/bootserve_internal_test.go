package controller

import (
	"testing"

	"github.com/kilnhq/kiln/internal/errdefs"
)

func TestAgentControllerAddr(t *testing.T) {
	tests := []struct {
		url, api, want string
		bad            bool
	}{
		{"", "127.0.0.1:7443", "127.0.0.1:7443", false},
		{"", "[::]:7443", "127.0.0.1:7443", false},
		{"https://10.77.0.1:7443", "[::]:7443", "10.77.0.1:7443", false},
		{"https://ctl.rack1.example", "[::]:7443", "ctl.rack1.example:7443", false},
		{"https://[fd77::1]:9443", "[::]:7443", "[fd77::1]:9443", false},
		{"10.77.0.1:7443", "[::]:7443", "", true}, // no scheme: not a URL
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
