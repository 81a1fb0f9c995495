package store

import (
	"errors"
	"fmt"
	"testing"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

func TestPermanentWatchErrors(t *testing.T) {
	tests := []struct {
		err  error
		want bool
	}{
		{rpctypes.ErrNoLeader, false},
		{rpctypes.ErrGRPCNoLeader, false},
		{errors.New("connection reset"), false},
		{rpctypes.ErrPermissionDenied, true},
		{rpctypes.ErrGRPCPermissionDenied, true},
		{rpctypes.ErrFutureRev, true},
		{fmt.Errorf("wrapped: %w", rpctypes.ErrUserEmpty), true},
	}
	for _, tt := range tests {
		if got := permanent(tt.err); got != tt.want {
			t.Errorf("permanent(%q) = %v, want %v", tt.err, got, tt.want)
		}
	}
}
