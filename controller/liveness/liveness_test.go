package liveness

import (
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/factshash"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestDecide(t *testing.T) {
	now := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	host := func(last time.Duration, conds ...*typesv1.Condition) *typesv1.Host {
		return &typesv1.Host{Status: &typesv1.HostStatus{
			Agent:      &typesv1.AgentStatus{LastHeartbeat: timestamppb.New(now.Add(-last))},
			Conditions: conds,
		}}
	}
	tests := []struct {
		name string
		h    *typesv1.Host
		want string // status of the returned condition, "" for nil
	}{
		{"never enrolled", &typesv1.Host{}, ""},
		{"fresh", host(10 * time.Second), ""},
		{"exactly at the limit", host(30 * time.Second), ""},
		{"stale", host(31 * time.Second), conditions.False},
		{"stale and reachable", host(time.Hour, conditions.New(ConditionAgentReachable, conditions.True, "", "")), conditions.False},
		{"stale and already marked", host(time.Hour, conditions.New(ConditionAgentReachable, conditions.False, ReasonHeartbeatMissed, "")), ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := Decide(tt.h, now, 30*time.Second)
			got := ""
			if c != nil {
				got = c.GetStatus()
			}
			if got != tt.want {
				t.Errorf("Decide(%q) = %q, want %q", tt.name, got, tt.want)
			}
		})
	}
}

func TestPlan(t *testing.T) {
	now := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	facts := &typesv1.Facts{Hostname: "h1", AgentMode: "installed", BootSource: "disk"}
	sum := factshash.Sum(facts)
	// stored is a host whose agent checked in 10 s ago through replica a,
	// with facts, reachable.
	stored := func(mod ...func(*typesv1.Host)) *typesv1.Host {
		h := &typesv1.Host{Status: &typesv1.HostStatus{
			Facts: facts,
			Agent: &typesv1.AgentStatus{
				Address: "10.0.0.1:7441", Version: "v1", Controller: "a", FactsSha256: sum,
				LastHeartbeat: timestamppb.New(now.Add(-10 * time.Second)),
			},
			Conditions: []*typesv1.Condition{conditions.New(ConditionAgentReachable, conditions.True, ReasonHeartbeatReceived, "")},
		}}
		for _, m := range mod {
			m(h)
		}
		return h
	}
	beat := func(mod ...func(*Beat)) Beat {
		b := Beat{Address: "10.0.0.1:7441", Version: "v1", FactsSHA256: sum, Replica: "a", Now: now}
		for _, m := range mod {
			m(&b)
		}
		return b
	}
	other := &typesv1.Facts{Hostname: "h1", AgentMode: "boot", BootSource: "virtualmedia"}
	tests := []struct {
		name string
		h    *typesv1.Host
		b    Beat
		want Change
	}{
		{"idle: nothing changed", stored(), beat(), Change{}},
		{"old agent, same facts in full, no hash", stored(), beat(func(b *Beat) { b.Facts, b.FactsSHA256 = facts, "" }), Change{}},
		{"old agent, no facts, no hash", stored(), beat(func(b *Beat) { b.FactsSHA256 = "" }), Change{}},
		{"new agent, same facts in full", stored(), beat(func(b *Beat) { b.Facts = facts }), Change{}},
		{"first heartbeat", &typesv1.Host{}, beat(func(b *Beat) { b.Facts = facts }), Change{Write: true, Reason: WriteFirst}},
		{"unknown hash: ask, write nothing", stored(), beat(func(b *Beat) { b.FactsSHA256 = factshash.Sum(other) }), Change{WantFacts: true}},
		{"unknown hash on a new host: ask first", &typesv1.Host{}, beat(), Change{WantFacts: true}},
		{"new facts in full", stored(), beat(func(b *Beat) { b.Facts, b.FactsSHA256 = other, factshash.Sum(other) }), Change{Write: true, Reason: WriteFacts}},
		{"old agent, new facts", stored(), beat(func(b *Beat) { b.Facts, b.FactsSHA256 = other, "" }), Change{Write: true, Reason: WriteFacts}},
		{"new address", stored(), beat(func(b *Beat) { b.Address = "10.0.0.2:7441" }), Change{Write: true, Reason: WriteAddress}},
		{"new version", stored(), beat(func(b *Beat) { b.Version = "v2" }), Change{Write: true, Reason: WriteVersion}},
		{"heartbeats moved to replica b", stored(), beat(func(b *Beat) { b.Replica = "b" }), Change{Write: true, Reason: WriteHolder}},
		{"was marked unreachable", stored(func(h *typesv1.Host) {
			h.Status.Conditions = []*typesv1.Condition{conditions.New(ConditionAgentReachable, conditions.False, ReasonHeartbeatMissed, "")}
		}), beat(), Change{Write: true, Reason: WriteUnreachable}},
		{"operation started after the recorded check-in", stored(func(h *typesv1.Host) {
			h.Status.LastOperation = &typesv1.OperationStatus{Started: timestamppb.New(now.Add(-5 * time.Second))}
		}), beat(), Change{Write: true, Reason: WriteAwaited}},
		{"operation started before the recorded check-in", stored(func(h *typesv1.Host) {
			h.Status.LastOperation = &typesv1.OperationStatus{Started: timestamppb.New(now.Add(-time.Minute))}
		}), beat(), Change{}},
		{"stored heartbeat older than the refresh", stored(func(h *typesv1.Host) {
			h.Status.Agent.LastHeartbeat = timestamppb.New(now.Add(-2 * time.Hour))
		}), beat(), Change{Write: true, Reason: WriteRefresh}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Plan(tt.h, tt.b, time.Hour); got != tt.want {
				t.Errorf("Plan(%q) = %+v, want %+v", tt.name, got, tt.want)
			}
		})
	}
}

func TestApply(t *testing.T) {
	now := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	facts := &typesv1.Facts{Hostname: "h1", AgentMode: "boot", BootSource: "pxe"}
	h := &typesv1.Host{}
	b := Beat{Address: "10.0.0.1:7441", Version: "v1", Facts: facts, Replica: "a", Now: now}
	if !Apply(h, b) {
		t.Errorf("Apply on a new host = false, want AgentReachable changed")
	}
	a := h.GetStatus().GetAgent()
	if a.GetMode() != "boot" || a.GetBootSource() != "pxe" || a.GetController() != "a" || a.GetFactsSha256() != factshash.Sum(facts) || !a.GetLastHeartbeat().AsTime().Equal(now) {
		t.Errorf("Apply recorded agent %v, want mode boot, boot source pxe, holder a, the facts' hash, heartbeat %s", a, now)
	}
	if got := Plan(h, Beat{Address: b.Address, Version: b.Version, FactsSHA256: factshash.Sum(facts), Replica: "a", Now: now.Add(10 * time.Second)}, time.Hour); got.Write || got.WantFacts {
		t.Errorf("Plan of the next idle heartbeat after Apply = %+v, want nothing to do", got)
	}
	if Apply(h, b) {
		t.Errorf("Apply twice = true, want AgentReachable unchanged")
	}
}

func TestDecideSeen(t *testing.T) {
	now := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	h := &typesv1.Host{Status: &typesv1.HostStatus{Agent: &typesv1.AgentStatus{LastHeartbeat: timestamppb.New(now.Add(-time.Hour))}}}
	if c := DecideSeen(h, now.Add(-20*time.Second), now, 30*time.Second); c != nil {
		t.Errorf("DecideSeen(stored 1h ago, seen 20s ago) = %v, want nil: memory is fresher than the store", c)
	}
	if c := DecideSeen(h, now.Add(-31*time.Second), now, 30*time.Second); c.GetStatus() != conditions.False {
		t.Errorf("DecideSeen(seen 31s ago) = %v, want AgentReachable=False", c)
	}
}
