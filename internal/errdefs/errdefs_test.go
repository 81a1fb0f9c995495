package errdefs

import (
	"context"
	"errors"
	"fmt"
	"testing"
)

func TestClassesWrapAndMatch(t *testing.T) {
	base := errors.New("connection refused")
	err := Unavailable("bmc %q: power on: %w", "rack1-01", base)
	if got, want := err.Error(), `bmc "rack1-01": power on: connection refused`; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
	if !IsUnavailable(err) || !errors.Is(err, base) {
		t.Errorf("IsUnavailable = %v, errors.Is(base) = %v, want both true", IsUnavailable(err), errors.Is(err, base))
	}
	wrapped := fmt.Errorf("host x: %w", err)
	if !IsUnavailable(wrapped) || IsNotFound(wrapped) {
		t.Errorf("class lost or wrong after wrapping: %v", wrapped)
	}
}

func TestClass(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{nil, ""},
		{NotFound("x"), "not_found"},
		{fmt.Errorf("wrapped: %w", Unavailable("bmc down")), "unavailable"},
		{Unavailable("attempt timed out: %w", context.DeadlineExceeded), "deadline_exceeded"},
		{fmt.Errorf("op: %w", context.Canceled), "canceled"},
		{PermissionDenied("no"), "permission_denied"},
		{errors.New("plain"), "unknown"},
	} {
		if got := Class(tc.err); got != tc.want {
			t.Errorf("Class(%v) = %q, want %q", tc.err, got, tc.want)
		}
	}
}
