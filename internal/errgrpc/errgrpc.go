// Package errgrpc maps errdefs classes to gRPC status codes and back, at
// the gRPC edge only.
package errgrpc

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnhq/kiln/internal/errdefs"
)

var classes = []struct {
	class error
	code  codes.Code
}{
	{errdefs.ErrNotFound, codes.NotFound},
	{errdefs.ErrAlreadyExists, codes.AlreadyExists},
	{errdefs.ErrInvalidArgument, codes.InvalidArgument},
	{errdefs.ErrFailedPrecondition, codes.FailedPrecondition},
	{errdefs.ErrUnavailable, codes.Unavailable},
	{errdefs.ErrNotSupported, codes.Unimplemented},
	{errdefs.ErrPermissionDenied, codes.PermissionDenied},
	{errdefs.ErrConflict, codes.Aborted},
	{errdefs.ErrDeadlineExceeded, codes.DeadlineExceeded},
}

// ToGRPC converts err to a gRPC status error with the code of its class.
// An error that already is a status passes through.
func ToGRPC(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	for _, c := range classes {
		if errors.Is(err, c.class) {
			return status.Error(c.code, err.Error())
		}
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, err.Error())
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, err.Error())
	}
	return status.Error(codes.Unknown, err.Error())
}

// FromGRPC converts a gRPC status error back to an error of the matching
// errdefs class, keeping the message.
func FromGRPC(err error) error {
	if err == nil {
		return nil
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	for _, c := range classes {
		if st.Code() == c.code {
			return &remote{class: c.class, msg: st.Message()}
		}
	}
	return err
}

type remote struct {
	class error
	msg   string
}

func (e *remote) Error() string        { return e.msg }
func (e *remote) Is(target error) bool { return target == e.class }
