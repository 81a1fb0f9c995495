package dashboard

import "testing"

func TestConditionClass(t *testing.T) {
	for _, tc := range []struct{ status, severity, want string }{
		{"True", "", "ok"},
		{"False", "Error", "bad"},
		{"False", "", "bad"},
		// BootstrapOperation False/Succeeded: the operation ended well.
		{"False", "Info", "none"},
		{"Unknown", "", "busy"},
	} {
		if got := conditionClass(tc.status, tc.severity); got != tc.want {
			t.Errorf("conditionClass(%q, %q) = %q, want %q", tc.status, tc.severity, got, tc.want)
		}
	}
}
