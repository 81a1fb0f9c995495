// Package errdefs is Kiln's small error vocabulary. Errors are classified
// by wrapping one of the sentinel errors below; callers test with Is*
// helpers or errors.Is. The classes map to gRPC codes only at the gRPC edge
// (package errgrpc).
package errdefs

import (
	"context"
	"errors"
	"fmt"
)

// The error classes.
var (
	ErrNotFound           = errors.New("not found")
	ErrAlreadyExists      = errors.New("already exists")
	ErrInvalidArgument    = errors.New("invalid argument")
	ErrFailedPrecondition = errors.New("failed precondition")
	ErrUnavailable        = errors.New("unavailable")
	ErrNotSupported       = errors.New("not supported")
	ErrPermissionDenied   = errors.New("permission denied")
	ErrConflict           = errors.New("conflict")
	ErrDeadlineExceeded   = errors.New("deadline exceeded")
)

// classed gives a message a class without putting the class's text in the
// message; cause is the error wrapped with %w, if any.
type classed struct {
	class error
	msg   string
	cause error
}

func (e *classed) Error() string { return e.msg }

func (e *classed) Is(target error) bool { return target == e.class }
func (e *classed) Unwrap() error        { return e.cause }

func newf(class error, format string, args ...any) error {
	err := fmt.Errorf(format, args...)
	return &classed{class: class, msg: err.Error(), cause: errors.Unwrap(err)}
}

// NotFound returns an error of class ErrNotFound with the formatted message.
func NotFound(format string, args ...any) error { return newf(ErrNotFound, format, args...) }

// AlreadyExists returns an error of class ErrAlreadyExists.
func AlreadyExists(format string, args ...any) error {
	return newf(ErrAlreadyExists, format, args...)
}

// InvalidArgument returns an error of class ErrInvalidArgument.
func InvalidArgument(format string, args ...any) error {
	return newf(ErrInvalidArgument, format, args...)
}

// FailedPrecondition returns an error of class ErrFailedPrecondition.
func FailedPrecondition(format string, args ...any) error {
	return newf(ErrFailedPrecondition, format, args...)
}

// Unavailable returns an error of class ErrUnavailable.
func Unavailable(format string, args ...any) error { return newf(ErrUnavailable, format, args...) }

// NotSupported returns an error of class ErrNotSupported.
func NotSupported(format string, args ...any) error { return newf(ErrNotSupported, format, args...) }

// PermissionDenied returns an error of class ErrPermissionDenied.
func PermissionDenied(format string, args ...any) error {
	return newf(ErrPermissionDenied, format, args...)
}

// Conflict returns an error of class ErrConflict (a stale resource version).
func Conflict(format string, args ...any) error { return newf(ErrConflict, format, args...) }

// IsNotFound reports whether err is of class ErrNotFound.
func IsNotFound(err error) bool { return errors.Is(err, ErrNotFound) }

// IsAlreadyExists reports whether err is of class ErrAlreadyExists.
func IsAlreadyExists(err error) bool { return errors.Is(err, ErrAlreadyExists) }

// IsInvalidArgument reports whether err is of class ErrInvalidArgument.
func IsInvalidArgument(err error) bool { return errors.Is(err, ErrInvalidArgument) }

// IsFailedPrecondition reports whether err is of class ErrFailedPrecondition.
func IsFailedPrecondition(err error) bool { return errors.Is(err, ErrFailedPrecondition) }

// IsUnavailable reports whether err is of class ErrUnavailable.
func IsUnavailable(err error) bool { return errors.Is(err, ErrUnavailable) }

// IsNotSupported reports whether err is of class ErrNotSupported.
func IsNotSupported(err error) bool { return errors.Is(err, ErrNotSupported) }

// IsPermissionDenied reports whether err is of class ErrPermissionDenied.
func IsPermissionDenied(err error) bool { return errors.Is(err, ErrPermissionDenied) }

// IsConflict reports whether err is of class ErrConflict.
func IsConflict(err error) bool { return errors.Is(err, ErrConflict) }

// Class names err's class in snake case, for labels and logs: "" for
// nil, "not_found", "already_exists", "invalid_argument",
// "failed_precondition", "unavailable", "not_supported",
// "permission_denied", "conflict", "deadline_exceeded" (also for
// context.DeadlineExceeded), "canceled" (context.Canceled), and "unknown"
// for an unclassified error. The set is closed, so it bounds a metric's
// label values.
func Class(err error) string {
	switch {
	case err == nil:
		return ""
	case IsNotFound(err):
		return "not_found"
	case IsAlreadyExists(err):
		return "already_exists"
	case IsInvalidArgument(err):
		return "invalid_argument"
	case IsFailedPrecondition(err):
		return "failed_precondition"
	case IsNotSupported(err):
		return "not_supported"
	case IsPermissionDenied(err):
		return "permission_denied"
	case IsConflict(err):
		return "conflict"
	case errors.Is(err, ErrDeadlineExceeded) || errors.Is(err, context.DeadlineExceeded):
		return "deadline_exceeded"
	case IsUnavailable(err):
		return "unavailable"
	case errors.Is(err, context.Canceled):
		return "canceled"
	}
	return "unknown"
}
