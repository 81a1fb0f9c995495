package errdefs

import (
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
