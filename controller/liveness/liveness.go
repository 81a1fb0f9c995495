// Package liveness decides when a host's agent has gone quiet: a host
// whose last heartbeat is older than the allowed silence gets the
// condition AgentReachable=False. Deciding is pure (Decide); the
// controller's leader applies the result to the store.
package liveness

import (
	"fmt"
	"time"

	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// ConditionAgentReachable is the condition this package sets.
const ConditionAgentReachable = "AgentReachable"

// ReasonHeartbeatMissed is the reason of AgentReachable=False.
const ReasonHeartbeatMissed = "HeartbeatMissed"

// Decide returns the AgentReachable=False condition to set on h when its
// agent has been silent for longer than silence at now, or nil when
// nothing is to change: the host never had an agent, its heartbeat is
// fresh, or it is already marked unreachable.
func Decide(h *typesv1.Host, now time.Time, silence time.Duration) *typesv1.Condition {
	last := h.GetStatus().GetAgent().GetLastHeartbeat()
	if last == nil {
		return nil
	}
	age := now.Sub(last.AsTime())
	if age <= silence {
		return nil
	}
	if c := conditions.Get(h.GetStatus().GetConditions(), ConditionAgentReachable); c != nil && c.GetStatus() == conditions.False {
		return nil
	}
	return conditions.New(ConditionAgentReachable, conditions.False, ReasonHeartbeatMissed,
		fmt.Sprintf("no heartbeat from the agent since %s (%s ago, allowed %s)",
			last.AsTime().UTC().Format(time.RFC3339), age.Round(time.Second), silence))
}
