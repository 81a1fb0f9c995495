package conditions

import (
	"testing"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestBlocking(t *testing.T) {
	ready := &typesv1.Condition{Type: "Ready", Status: False, Reason: "WaitingForHost"}
	image := &typesv1.Condition{Type: "ImageResolved", Status: False, Reason: "ImageNotFound", Severity: "Error"}
	boot := &typesv1.Condition{Type: "BootstrapFailed", Status: True, Reason: "PreflightFailed", Severity: "Error"}
	list := []*typesv1.Condition{
		ready,
		{Type: "BMCReachable", Status: True},
		{Type: "BootstrapFailed", Status: False, Reason: "Bootstrapped"},
		{Type: "AgentReachable", Status: Unknown},
		image,
		boot,
	}
	got := Blocking(list)
	want := []*typesv1.Condition{image, boot, ready}
	if len(got) != len(want) {
		t.Fatalf("Blocking() = %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("Blocking()[%d] = %v, want %v", i, got[i], want[i])
		}
	}
	if got := Blocking([]*typesv1.Condition{{Type: "Ready", Status: True}}); got != nil {
		t.Errorf("Blocking(Ready=True) = %v, want nil", got)
	}
}

func TestSummary(t *testing.T) {
	tests := []struct {
		c    *typesv1.Condition
		max  int
		want string
	}{
		{nil, 10, ""},
		{&typesv1.Condition{Type: "Ready", Status: False}, 10, "Ready=False"},
		{&typesv1.Condition{Type: "Ready", Status: False, Reason: "NodeNotReady"}, 10, "NodeNotReady"},
		{&typesv1.Condition{Type: "ImageResolved", Status: False, Reason: "ImageNotFound", Message: "image a-1 not found;\nkilnctl get images"}, 0,
			"ImageNotFound: image a-1 not found; kilnctl get images"},
		{&typesv1.Condition{Type: "ImageResolved", Status: False, Reason: "ImageNotFound", Message: "image a-1 not found; kilnctl get images"}, 12,
			"ImageNotFound: image a-1 n…"},
	}
	for _, tt := range tests {
		if got := Summary(tt.c, tt.max); got != tt.want {
			t.Errorf("Summary(%v, %d) = %q, want %q", tt.c, tt.max, got, tt.want)
		}
	}
}
