package hostlife

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestBootAgentMissing: with Config.ExpectedBoot set (the controller's
// --expected-boot-time), a Redfish host whose boot agent does not come
// says so once that long has passed since the power on, naming the media
// it was told to boot and what to check, with one Warning event; the step
// itself waits on until its timeout, and the condition turns True when
// the agent comes.
func TestBootAgentMissing(t *testing.T) {
	h := &typesv1.Host{
		Metadata: &typesv1.ObjectMeta{Name: "h1"},
		Spec:     &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "redfish"}},
	}
	cfg := Config{ExpectedBoot: 20 * time.Second}
	desired := Desired{Machine: "m1", ImageName: "img1", Image: &typesv1.ImageSpec{Url: "http://images/img1"}}
	plan := func(at time.Duration, ok bool) Output {
		in := Input{Host: h, Desired: desired, Now: t0.Add(at), ISOURL: "http://boot/boot/iso/h1.iso", Config: cfg}
		if ok {
			in.Observed.Result = &Result{OperationID: h.GetStatus().GetLastOperation().GetId()}
		}
		out := Plan(in)
		h.Status = out.Status
		return out
	}
	plan(0, false)            // Registering: CheckBMC
	plan(time.Second, true)   // Available, then Provisioning: PowerOff
	plan(2*time.Second, true) // BootAgentMedia
	plan(3*time.Second, true) // PowerOn
	out := plan(4*time.Second, true)
	require.Equal(t, string(StepWaitBootAgent), out.Status.GetProvisioningStep())
	// Waiting: no condition yet, and the plan wakes when ExpectedBoot ends
	// (the power on started at 3s).
	out = plan(15*time.Second, false)
	require.Nil(t, conditions.Get(out.Status.GetConditions(), ConditionBootAgentCheckedIn))
	require.Equal(t, 8*time.Second, out.RequeueAfter)

	out = plan(23*time.Second, false)
	c := conditions.Get(out.Status.GetConditions(), ConditionBootAgentCheckedIn)
	require.NotNil(t, c)
	require.Equal(t, conditions.False, c.GetStatus())
	require.Equal(t, ReasonBootAgentMissing, c.GetReason())
	for _, want := range []string{"20s after power on", "virtual media http://boot/boot/iso/h1.iso", "check its console", "gives up after 15m0s"} {
		require.Contains(t, c.GetMessage(), want)
	}
	require.Len(t, out.Events, 1)
	require.Equal(t, "Warning", out.Events[0].Type)
	require.Equal(t, ReasonBootAgentMissing, out.Events[0].Reason)
	require.Equal(t, string(StepWaitBootAgent), out.Status.GetProvisioningStep(), "the step waits on")

	// Said once: a later look changes nothing and records no event.
	out = plan(33*time.Second, false)
	require.False(t, out.Changed)
	require.Empty(t, out.Events)

	h.Status.Agent = &typesv1.AgentStatus{Address: "10.0.0.2:7444", Mode: "boot", BootSource: "cdrom", LastHeartbeat: timestamppb.New(t0.Add(40 * time.Second))}
	out = plan(41*time.Second, false)
	c = conditions.Get(out.Status.GetConditions(), ConditionBootAgentCheckedIn)
	require.Equal(t, conditions.True, c.GetStatus())
	require.Equal(t, ReasonCheckedIn, c.GetReason())
	require.True(t, strings.HasPrefix(c.GetMessage(), "the boot agent checked in from cdrom 38s after power on"), c.GetMessage())
	require.Equal(t, string(StepLayImage), out.Status.GetProvisioningStep())
}
