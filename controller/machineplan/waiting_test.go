package machineplan

import (
	"testing"

	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestWaitingCondition: a preflight that only waits for the host clears
// a refusal's BootstrapFailed (the machine is no longer Failed) and says
// what it waits for, but never a failed operation's, which only a
// bootstrap that succeeds undoes.
func TestWaitingCondition(t *testing.T) {
	const msg = "preflight check offline-images in progress: importing 3/7"
	bf := func(status, reason string) []*typesv1.Condition {
		return []*typesv1.Condition{conditions.New(ConditionBootstrapFailed, status, reason, "earlier")}
	}
	for _, tc := range []struct {
		name  string
		conds []*typesv1.Condition
		want  bool // a condition to set
	}{
		{"first outcome", nil, true},
		{"after a refusal", bf(conditions.True, "PreflightFailed"), true},
		{"while waiting", bf(conditions.False, ReasonPreflightWaiting), true},
		{"after a failed kubeadm init", bf(conditions.True, "KubeadmInitFailed"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := WaitingCondition(tc.conds, msg)
			if !tc.want {
				if got != nil {
					t.Errorf("WaitingCondition(%s) = %v, want nil (BootstrapFailed kept)", tc.name, got)
				}
				return
			}
			if got.GetType() != ConditionBootstrapFailed || got.GetStatus() != conditions.False || got.GetReason() != ReasonPreflightWaiting || got.GetMessage() != msg {
				t.Errorf("WaitingCondition(%s) = %v, want BootstrapFailed=False %s %q", tc.name, got, ReasonPreflightWaiting, msg)
			}
		})
	}
}
