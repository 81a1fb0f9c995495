package machineplan

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestHostBlockerBootAgentMissing: a host waiting for a boot agent that
// does not come holds its machine back with that reason and message, not
// with "in progress".
func TestHostBlockerBootAgentMissing(t *testing.T) {
	h := &typesv1.Host{
		Metadata: &typesv1.ObjectMeta{Name: "h4"},
		Status: &typesv1.HostStatus{
			State:            typesv1.HostState_HOST_STATE_PROVISIONING,
			ProvisioningStep: string(hostlife.StepWaitBootAgent),
			Conditions: []*typesv1.Condition{
				conditions.New(hostlife.ConditionProvisioned, conditions.False, hostlife.ReasonInProgress, "step WaitBootAgent"),
				conditions.New(hostlife.ConditionBootAgentCheckedIn, conditions.False, hostlife.ReasonBootAgentMissing, "no boot agent check-in 20s after power on"),
			},
		},
	}
	c := HostBlocker(h)
	require.Equal(t, conditions.False, c.GetStatus())
	require.Equal(t, hostlife.ReasonBootAgentMissing, c.GetReason())
	require.Contains(t, c.GetMessage(), "host h4 (Provisioning, step WaitBootAgent): BootAgentCheckedIn=False: no boot agent check-in 20s after power on (kilnctl describe host h4)")
}
