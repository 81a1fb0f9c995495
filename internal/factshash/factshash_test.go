package factshash

import (
	"testing"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestSum(t *testing.T) {
	a := &typesv1.Facts{Hostname: "rack1-01", AgentMode: "installed", BootSource: "disk"}
	tests := []struct {
		name string
		f    *typesv1.Facts
		same bool // Sum(f) == Sum(a)
	}{
		{"equal facts", &typesv1.Facts{Hostname: "rack1-01", AgentMode: "installed", BootSource: "disk"}, true},
		{"other mode", &typesv1.Facts{Hostname: "rack1-01", AgentMode: "boot", BootSource: "disk"}, false},
		{"other boot source", &typesv1.Facts{Hostname: "rack1-01", AgentMode: "installed", BootSource: "pxe"}, false},
		{"empty facts", &typesv1.Facts{}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Sum(tt.f) == Sum(a); got != tt.same {
				t.Errorf("Sum(%v) == Sum(%v) is %v, want %v", tt.f, a, got, tt.same)
			}
			if len(Sum(tt.f)) != 64 {
				t.Errorf("Sum(%v) = %q, want 64 hex digits", tt.f, Sum(tt.f))
			}
		})
	}
	if got := Sum(nil); got != "" {
		t.Errorf("Sum(nil) = %q, want \"\"", got)
	}
}
