package classvar

import (
	"testing"

	"github.com/stretchr/testify/require"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestSubstitute(t *testing.T) {
	vals := map[string]string{"site": "store1", "os": "debian12"}
	tests := []struct {
		in, want, err string
	}{
		{"plain", "plain", ""},
		{"${site}", "store1", ""},
		{"img-${os}-${ site }", "img-debian12-store1", ""},
		{"cost $$5 at ${site}", "cost $5 at store1", ""},
		{"${zone}", "", `variable "zone" is not declared`},
		{"${site", "", "malformed reference"},
	}
	for _, tt := range tests {
		m := &typesv1.ClusterClassMachines{Image: tt.in, HostSelector: map[string]string{"site": tt.in}}
		got, err := Substitute(m, vals)
		if tt.err != "" {
			require.ErrorContains(t, err, tt.err, "Substitute(%q)", tt.in)
			continue
		}
		require.NoError(t, err, "Substitute(%q)", tt.in)
		require.Equal(t, tt.want, got.GetImage(), "Substitute(%q).image", tt.in)
		require.Equal(t, tt.want, got.GetHostSelector()["site"], "Substitute(%q).hostSelector", tt.in)
		require.Equal(t, tt.in, m.GetImage(), "Substitute changed its input")
	}
}

func TestReferences(t *testing.T) {
	m := &typesv1.ClusterClassMachines{
		Image:        "img-${os}",
		HostSelector: map[string]string{"site": "${site}"},
		HealthCheck:  &typesv1.HealthCheckSpec{UnhealthyConditions: []*typesv1.UnhealthyCondition{{Timeout: "${t}"}}},
	}
	require.Equal(t, []Ref{
		{Field: "hostSelector[site]", Name: "site"},
		{Field: "image", Name: "os"},
		{Field: "healthCheck.unhealthyConditions[0].timeout", Name: "t"},
	}, References(m))
}

func TestResolve(t *testing.T) {
	decl := []*typesv1.ClusterClassVariable{
		{Name: "site", Type: TypeString, Required: true},
		{Name: "n", Type: TypeInteger, Default: "3"},
		{Name: "opt", Type: TypeString},
	}
	got, probs := Resolve(decl, map[string]string{"site": "s1"})
	require.Empty(t, probs)
	require.Equal(t, map[string]string{"site": "s1", "n": "3", "opt": ""}, got)
	_, probs = Resolve(decl, map[string]string{"n": "x", "extra": "1"})
	require.Equal(t, []Problem{
		{"extra", "the class declares no such variable"},
		{"n", `"x" is not an integer`},
		{"site", "required: the class declares no default, so the cluster must set it"},
	}, probs)
}
