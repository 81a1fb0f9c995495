// Package liveness decides when a host's agent has gone quiet, without a
// store write per heartbeat.
//
// The controller replica that receives an agent's heartbeats holds the
// agent's last-seen time in memory (Tracker) and is recorded on the Host
// as its holder (status.agent.controller). A heartbeat writes the Host
// only when it changes something an operator or the lifecycle reads
// (Plan): the agent's first heartbeat, a new address or version, new
// facts (compared by hash), a new holder, an agent that was marked
// unreachable, a lifecycle operation that started after the last recorded
// check-in (the planner waits for a newer one), or a stored heartbeat
// older than the refresh period. The holder marks AgentReachable=False on
// the hosts it holds once their agent has been silent for longer than
// the allowed silence (Monitor); a replica adopts the hosts of replicas
// that are no longer registered (Register, LiveReplicas) and of its own
// previous run, so their silent agents are marked too.
//
// Deciding is pure (Plan, Decide, DecideSeen); Monitor applies the
// result to the store.
package liveness

import (
	"fmt"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/factshash"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// ConditionAgentReachable is the condition this package sets.
const ConditionAgentReachable = "AgentReachable"

// ReasonHeartbeatMissed is the reason of AgentReachable=False.
const ReasonHeartbeatMissed = "HeartbeatMissed"

// ReasonHeartbeatReceived is the reason of AgentReachable=True.
const ReasonHeartbeatReceived = "HeartbeatReceived"

// DefaultRefresh is how old a Host's stored heartbeat may grow while its
// agent keeps checking in before a heartbeat rewrites it: it bounds how
// stale status.agent.last_heartbeat looks in `kilnctl describe`. 100,000
// idle agents cost 100,000/3,600 ≈ 28 writes/s.
const DefaultRefresh = time.Hour

// Decide returns the AgentReachable=False condition to set on h when its
// stored heartbeat is older than silence at now, or nil when nothing is
// to change: the host never had an agent, its heartbeat is fresh, or it
// is already marked unreachable.
func Decide(h *typesv1.Host, now time.Time, silence time.Duration) *typesv1.Condition {
	last := h.GetStatus().GetAgent().GetLastHeartbeat()
	if last == nil {
		return nil
	}
	return DecideSeen(h, last.AsTime(), now, silence)
}

// DecideSeen is Decide with the agent last seen at last (the later of the
// holder's memory and the stored heartbeat).
func DecideSeen(h *typesv1.Host, last, now time.Time, silence time.Duration) *typesv1.Condition {
	if stored := h.GetStatus().GetAgent().GetLastHeartbeat(); stored != nil && stored.AsTime().After(last) {
		last = stored.AsTime()
	}
	if last.IsZero() {
		return nil
	}
	age := now.Sub(last)
	if age <= silence {
		return nil
	}
	if c := conditions.Get(h.GetStatus().GetConditions(), ConditionAgentReachable); c != nil && c.GetStatus() == conditions.False {
		return nil
	}
	return conditions.New(ConditionAgentReachable, conditions.False, ReasonHeartbeatMissed,
		fmt.Sprintf("no heartbeat from the agent since %s (%s ago, allowed %s)",
			last.UTC().Format(time.RFC3339), age.Round(time.Second), silence))
}

// Beat is one heartbeat as a controller replica received it.
type Beat struct {
	Address string
	Version string
	// Facts are the facts sent in full, nil when none were sent.
	Facts *typesv1.Facts
	// FactsSHA256 is the hash the agent sent ("" from older agents).
	FactsSHA256 string
	// Replica is the ID of the replica that received the heartbeat.
	Replica string
	Now     time.Time
}

// factsSum is the hash of the beat's facts: the agent's, or computed for
// agents that send none.
func (b Beat) factsSum() string {
	if b.FactsSHA256 != "" {
		return b.FactsSHA256
	}
	return factshash.Sum(b.Facts)
}

// Reasons a heartbeat writes the Host (Change.Reason).
const (
	WriteFirst       = "first heartbeat"
	WriteAddress     = "address changed"
	WriteVersion     = "version changed"
	WriteFacts       = "facts changed"
	WriteHolder      = "heartbeats moved to this replica"
	WriteUnreachable = "agent was unreachable"
	WriteAwaited     = "an operation awaits a newer check-in"
	WriteRefresh     = "stored heartbeat older than the refresh period"
)

// Change is what one heartbeat changes on its Host.
type Change struct {
	// Write is set when the Host is to be written (Apply).
	Write bool
	// Reason says why (one of the Write* constants).
	Reason string
	// WantFacts asks the agent for its facts in full: it sent a hash of
	// facts the controller does not hold. Nothing is written until they
	// come (the facts decide the agent's mode and boot source, which the
	// lifecycle waits on).
	WantFacts bool
}

// Plan decides what heartbeat b changes on the stored host h. refresh is
// the age after which a stored heartbeat is rewritten (0: never).
func Plan(h *typesv1.Host, b Beat, refresh time.Duration) Change {
	s := h.GetStatus()
	a := s.GetAgent()
	if b.Facts == nil && b.FactsSHA256 != "" && b.FactsSHA256 != a.GetFactsSha256() {
		return Change{WantFacts: true}
	}
	last := a.GetLastHeartbeat()
	write := func(reason string) Change { return Change{Write: true, Reason: reason} }
	switch {
	case last == nil:
		return write(WriteFirst)
	case a.GetAddress() != b.Address:
		return write(WriteAddress)
	case a.GetVersion() != b.Version:
		return write(WriteVersion)
	case b.Facts != nil && b.factsSum() != a.GetFactsSha256():
		return write(WriteFacts)
	case a.GetController() != b.Replica:
		return write(WriteHolder)
	case !conditions.IsTrue(s.GetConditions(), ConditionAgentReachable):
		return write(WriteUnreachable)
	case s.GetLastOperation().GetStarted() != nil && last.AsTime().Before(s.GetLastOperation().GetStarted().AsTime()):
		// The lifecycle's waits accept a check-in newer than the start
		// of their operation (hostlife agentCheckedIn): record one.
		return write(WriteAwaited)
	case refresh > 0 && b.Now.Sub(last.AsTime()) > refresh:
		return write(WriteRefresh)
	}
	return Change{}
}

// Apply records heartbeat b on h: address, version, holder, time, facts
// when sent, and AgentReachable=True. It reports whether AgentReachable
// changed (the agent became reachable).
func Apply(h *typesv1.Host, b Beat) (becameReachable bool) {
	if h.Status == nil {
		h.Status = &typesv1.HostStatus{}
	}
	if h.Status.Agent == nil {
		h.Status.Agent = &typesv1.AgentStatus{}
	}
	a := h.Status.Agent
	a.Address = b.Address
	a.Version = b.Version
	a.Controller = b.Replica
	a.LastHeartbeat = timestamppb.New(b.Now)
	if b.Facts != nil {
		h.Status.Facts = b.Facts
		a.FactsSha256 = b.factsSum()
		a.Mode = b.Facts.GetAgentMode()
		a.BootSource = b.Facts.GetBootSource()
	}
	h.Status.Conditions, becameReachable = conditions.Set(h.Status.Conditions,
		conditions.New(ConditionAgentReachable, conditions.True, ReasonHeartbeatReceived, "agent at "+b.Address+" sends heartbeats"), b.Now)
	return becameReachable
}
