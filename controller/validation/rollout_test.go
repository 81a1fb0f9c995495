package validation

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func rollout(f func(*typesv1.RolloutSpec)) *controllerv1.Resource {
	r := &typesv1.Rollout{ApiVersion: APIVersion, Kind: "Rollout", Metadata: meta("k8s-1-35"), Spec: &typesv1.RolloutSpec{
		Change:          &typesv1.RolloutChange{KubernetesVersion: "v1.35.1"},
		ClusterSelector: map[string]string{"env": "prod"},
		Bake:            "10m",
		Halt: &typesv1.RolloutHalt{ReadyTimeout: "20m", OnRemediation: true,
			Conditions: []*typesv1.UnhealthyCondition{{Type: "UpgradeAllowed", Status: "False"}}},
	}}
	f(r.Spec)
	return &controllerv1.Resource{Kind: &controllerv1.Resource_Rollout{Rollout: r}}
}

func TestValidateRollout(t *testing.T) {
	tests := []struct {
		name string
		r    *controllerv1.Resource
		want []string // substrings of the error; none means valid
	}{
		{"version", rollout(func(*typesv1.RolloutSpec) {}), nil},
		{"image", rollout(func(s *typesv1.RolloutSpec) { s.Change = &typesv1.RolloutChange{Image: "debian12-k8s1.34.4-20261206"} }), nil},
		{"image selector", rollout(func(s *typesv1.RolloutSpec) {
			s.Change = &typesv1.RolloutChange{ImageSelector: map[string]string{"os": "debian12", "patch": "20261206"}}
		}), nil},
		{"class", rollout(func(s *typesv1.RolloutSpec) {
			s.Change = &typesv1.RolloutChange{ClusterClass: "edge", ClassRevision: 3}
		}), nil},
		{"minimal", rollout(func(s *typesv1.RolloutSpec) { s.Halt, s.Bake, s.ClusterSelector = nil, "", nil }), nil},
		{"no change", rollout(func(s *typesv1.RolloutSpec) { s.Change = nil }), []string{"spec.change: required: one of kubernetesVersion, image"}},
		{"two changes", rollout(func(s *typesv1.RolloutSpec) { s.Change.Image = "img" }), []string{"spec.change: sets kubernetesVersion and image: a Rollout carries exactly one change"}},
		{"image and selector", rollout(func(s *typesv1.RolloutSpec) {
			s.Change = &typesv1.RolloutChange{Image: "img", ImageSelector: map[string]string{"os": "debian12"}}
		}), []string{"spec.change.imageSelector: set together with spec.change.image"}},
		{"bad version", rollout(func(s *typesv1.RolloutSpec) { s.Change.KubernetesVersion = "1.35" }), []string{"spec.change.kubernetesVersion"}},
		{"class without revision", rollout(func(s *typesv1.RolloutSpec) {
			s.Change = &typesv1.RolloutChange{ClusterClass: "edge"}
		}), []string{"spec.change.classRevision: 0: name the class revision"}},
		{"revision without class", rollout(func(s *typesv1.RolloutSpec) {
			s.Change = &typesv1.RolloutChange{ClassRevision: 2}
		}), []string{"spec.change.clusterClass: required with spec.change.classRevision"}},
		{"bake", rollout(func(s *typesv1.RolloutSpec) { s.Bake = "ten minutes" }), []string{`spec.bake: "ten minutes" is not a duration`}},
		{"zero bake", rollout(func(s *typesv1.RolloutSpec) { s.Bake = "0s" }), nil},
		{"ready timeout", rollout(func(s *typesv1.RolloutSpec) { s.Halt.ReadyTimeout = "0s" }), []string{`spec.halt.readyTimeout: "0s" is zero`}},
		{"max concurrent", rollout(func(s *typesv1.RolloutSpec) { s.MaxConcurrent = -1 }), []string{"spec.maxConcurrent: -1: use 1 or more"}},
		{"wave label", rollout(func(s *typesv1.RolloutSpec) { s.WaveLabel = "upgrade wave" }), []string{`spec.waveLabel: "upgrade wave" is not a label key`}},
		{"selector", rollout(func(s *typesv1.RolloutSpec) { s.ClusterSelector = map[string]string{"env": "prod east"} }), []string{"spec.clusterSelector.env"}},
		{"halt condition type", rollout(func(s *typesv1.RolloutSpec) { s.Halt.Conditions[0].Type = "" }), []string{"spec.halt.conditions[0].type: required"}},
		{"halt condition status", rollout(func(s *typesv1.RolloutSpec) { s.Halt.Conditions[0].Status = "no" }), []string{`spec.halt.conditions[0].status: "no" is not a condition status`}},
		{"halt condition timeout", rollout(func(s *typesv1.RolloutSpec) { s.Halt.Conditions[0].Timeout = "soon" }), []string{`spec.halt.conditions[0].timeout: "soon" is not a duration`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := Validate(tt.r)
			if len(tt.want) == 0 {
				if err != nil {
					t.Fatalf("Validate(%s) = %v, want nil", tt.name, err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate(%s) = nil, want error containing %q", tt.name, tt.want)
			}
			if !errdefs.IsInvalidArgument(err) {
				t.Errorf("Validate(%s) = %v, want an InvalidArgument error", tt.name, err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Validate(%s) = %q, want it to contain %q", tt.name, err, w)
				}
			}
		})
	}
}

func TestValidateAgainstRollout(t *testing.T) {
	cur := rollout(func(*typesv1.RolloutSpec) {})
	paused := rollout(func(s *typesv1.RolloutSpec) { s.Paused = true })
	require.NoError(t, ValidateAgainst(paused, Observed{Current: cur}), "pausing a Rollout")
	other := rollout(func(s *typesv1.RolloutSpec) { s.Change.KubernetesVersion = "v1.35.2" })
	err := ValidateAgainst(other, Observed{Current: cur})
	require.ErrorContains(t, err, "spec.change: a Rollout's change is fixed once it exists")
	require.NoError(t, ValidateAgainst(other, Observed{}), "a new Rollout")
}
