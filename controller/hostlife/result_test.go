package hostlife

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestRetryAfterTimeoutReadsReason: a failed LayImage whose backoff is
// over starts again from PowerOff when its operation's reason is
// StepTimedOut (once the agent, asked, did not report it succeeded:
// lay_late_success.txt), and from LayImage itself when it failed
// otherwise. The
// message plays no part, except for a host stored by a controller from
// before operation.reason (message "timed out", no reason).
func TestRetryAfterTimeoutReadsReason(t *testing.T) {
	tests := []struct {
		name, reason, message string
		wantStep              Step
	}{
		{name: "timed out", reason: ReasonTimedOut, wantStep: StepPowerOff},
		{name: "agent failure", reason: ReasonStepFailed, wantStep: StepLayImage},
		{name: "agent failure whose message says timed out", reason: ReasonStepFailed, message: "timed out", wantStep: StepLayImage},
		{name: "stored before operation.reason", message: "timed out", wantStep: StepPowerOff},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := &typesv1.Host{
				Metadata: &typesv1.ObjectMeta{Name: "h1", Generation: 1},
				Spec:     &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "redfish"}},
				Status: &typesv1.HostStatus{
					State:            typesv1.HostState_HOST_STATE_PROVISIONING,
					Image:            "img1",
					Power:            "on",
					ProvisioningStep: string(StepLayImage),
					LastOperation: &typesv1.OperationStatus{
						Id: "h1.provisioning.0.layimage.0.img1", Kind: string(StepLayImage), State: OpFailed,
						Reason: tt.reason, Message: tt.message, Error: "boom", Attempt: 1,
						Started: timestamppb.New(t0), RetryAfter: timestamppb.New(t0.Add(time.Minute)),
					},
				},
			}
			out := Plan(Input{
				Host:    h,
				Desired: Desired{Machine: "m1", ImageName: "img1", Image: &typesv1.ImageSpec{Url: "http://images/img1"}},
				// The re-attach before a retry after a timeout: the agent
				// does not know the operation.
				Observed: Observed{Result: &Result{OperationID: "h1.provisioning.0.layimage.0.img1", Err: "Reattach: operation not found", Failure: FailAgent}},
				Now:      t0.Add(2 * time.Minute),
			})
			require.Equal(t, string(tt.wantStep), out.Status.GetProvisioningStep())
			require.Equal(t, int32(1), out.Status.GetLastOperation().GetAttempt())
			require.Empty(t, out.Status.GetLastOperation().GetReason(), "a new try has not failed")
			require.NotEmpty(t, out.Actions)
			require.Equal(t, NextNow, out.Next)
		})
	}
}

// TestDefaultTimeouts: DefaultTimeouts returns a copy (changing it
// changes no plan), and a step without a configured timeout gets its
// default while a configured one wins.
func TestDefaultTimeouts(t *testing.T) {
	d := DefaultTimeouts()
	require.Equal(t, 30*time.Minute, d[StepLayImage])
	for _, s := range Steps() {
		require.Contains(t, d, s, "every step has a default timeout")
	}
	d[StepLayImage] = time.Second
	require.Equal(t, 30*time.Minute, DefaultTimeouts()[StepLayImage])
	require.Equal(t, 30*time.Minute, Config{}.withDefaults().timeout(StepLayImage))

	c := Config{Timeouts: map[Step]time.Duration{StepLayImage: time.Minute}}.withDefaults()
	require.Equal(t, time.Minute, c.timeout(StepLayImage))
	require.Equal(t, 30*time.Minute, c.timeout(StepWipe))
}

func TestParseStep(t *testing.T) {
	for _, in := range []string{"LayImage", "layimage", "LAYIMAGE"} {
		s, err := ParseStep(in)
		require.NoError(t, err)
		require.Equal(t, StepLayImage, s)
	}
	s, err := ParseStep("WaitInstalledAgent")
	require.NoError(t, err)
	require.Equal(t, StepWaitInstalled, s)

	_, err = ParseStep("Lay")
	require.Error(t, err)
	require.True(t, errdefs.IsInvalidArgument(err), "%v", err)
	for _, s := range Steps() {
		require.True(t, strings.Contains(err.Error(), string(s)), "the error %q lists step %s", err, s)
	}
}
