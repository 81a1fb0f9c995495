package liveness

import (
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/conditions"
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
