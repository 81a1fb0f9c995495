package bmc

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// TestLateOperationError: an operation that does not return when its
// caller's ctx ends (an ipmitool slow to die under load: CI saw
// TestIPMIUnreachableReturnsByDeadline get a bare "context deadline
// exceeded") still makes do return by the deadline, with an Unavailable
// error for a deadline (retried, counted by the breaker) and only the
// cancellation for a cancelled caller.
func TestLateOperationError(t *testing.T) {
	b, err := Dial(context.Background(), Endpoint{Protocol: ProtocolRedfish, Address: "https://127.0.0.1:9", Username: "u", Password: "p"},
		Options{Name: "late", MaxAttempts: 1})
	require.NoError(t, err)
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	deaf := func(context.Context) error { <-release; return errors.New("too late") }

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	err = b.do(ctx, "power state", deaf)
	require.Less(t, time.Since(start), 5*time.Second, "do waited for an operation past its deadline")
	require.True(t, errdefs.IsUnavailable(err), "error = %v, want Unavailable", err)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Contains(t, err.Error(), "bmc late: power state: no answer before the deadline")

	require.Equal(t, "bmc late: power on: context canceled", lateError("late", "power on", context.Canceled).Error())
	require.False(t, errdefs.IsUnavailable(lateError("late", "power on", context.Canceled)))
}
