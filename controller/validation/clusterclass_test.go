package validation

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func i64(n int64) *int64 { return &n }

func validClass() *typesv1.ClusterClass {
	return &typesv1.ClusterClass{ApiVersion: APIVersion, Kind: "ClusterClass", Metadata: meta("edge"), Spec: &typesv1.ClusterClassSpec{
		Variables: []*typesv1.ClusterClassVariable{
			{Name: "site", Type: "string", Required: true},
			{Name: "os", Type: "enum", Enum: []string{"debian12", "ubuntu24"}, Default: "debian12"},
			{Name: "podCidr", Type: "cidr", Default: "10.244.0.0/16", Minimum: i64(12), Maximum: i64(24)},
			{Name: "workers", Type: "integer", Default: "2", Minimum: i64(0), Maximum: i64(10)},
		},
		Cluster: &typesv1.ClusterSpec{PodCidr: "${podCidr}", ServiceCidr: "10.96.0.0/12"},
		ControlPlane: &typesv1.ClusterClassMachines{
			HostSelector:  map[string]string{"site": "${site}"},
			ImageSelector: map[string]string{"os": "${os}"},
			HealthCheck: &typesv1.HealthCheckSpec{MaxUnhealthy: "1",
				UnhealthyConditions: []*typesv1.UnhealthyCondition{{Type: "NodeReady", Status: "False", Timeout: "5m"}}},
		},
		Workers: []*typesv1.ClusterClassWorker{
			{Name: "general", Template: &typesv1.ClusterClassMachines{Image: "img-$${literal}",
				Strategy: &typesv1.RolloutStrategy{MaxSurge: "0", MaxUnavailable: "1", NodeDrainTimeout: "5m"}}},
			{Name: "gpu", Template: &typesv1.ClusterClassMachines{HostSelector: map[string]string{"gpu": "true"}}},
		},
	}}
}

func class(mod func(*typesv1.ClusterClass)) *controllerv1.Resource {
	c := validClass()
	mod(c)
	return &controllerv1.Resource{Kind: &controllerv1.Resource_ClusterClass{ClusterClass: c}}
}

func topoCluster(mod func(*typesv1.Cluster)) *controllerv1.Resource {
	c := &typesv1.Cluster{ApiVersion: APIVersion, Kind: "Cluster", Metadata: meta("store1"), Spec: &typesv1.ClusterSpec{
		Topology: &typesv1.ClusterTopology{Class: "edge", Version: "v1.34.4", ControlPlaneReplicas: 1,
			Workers:   []*typesv1.TopologyWorkerPool{{Name: "app", Class: "general", Replicas: 2}},
			Variables: map[string]string{"site": "store1"}},
	}}
	mod(c)
	return &controllerv1.Resource{Kind: &controllerv1.Resource_Cluster{Cluster: c}}
}

func TestValidateClusterClass(t *testing.T) {
	tests := []struct {
		name string
		r    *controllerv1.Resource
		want []string // substrings of the error; none means valid
	}{
		{"valid class", class(func(*typesv1.ClusterClass) {}), nil},
		{"no control plane", class(func(c *typesv1.ClusterClass) { c.Spec.ControlPlane = nil }), []string{"spec.controlPlane: required"}},
		{"worker names unique", class(func(c *typesv1.ClusterClass) { c.Spec.Workers[1].Name = "general" }),
			[]string{`spec.workers[1].name: "general" is used by another worker class`}},
		{"worker name missing", class(func(c *typesv1.ClusterClass) { c.Spec.Workers[0].Name = "" }), []string{"spec.workers[0].name: required"}},
		{"worker name not dns", class(func(c *typesv1.ClusterClass) { c.Spec.Workers[0].Name = "GPU_big" }), []string{`spec.workers[0].name: "GPU_big" is not a DNS-1123 name`}},
		{"variable type unknown", class(func(c *typesv1.ClusterClass) { c.Spec.Variables[0].Type = "float" }),
			[]string{`spec.variables[0].type: "float" is not a variable type: use integer, string, enum, cidr`}},
		{"variable type missing", class(func(c *typesv1.ClusterClass) { c.Spec.Variables[0].Type = "" }), []string{"spec.variables[0].type: required"}},
		{"variable name twice", class(func(c *typesv1.ClusterClass) { c.Spec.Variables[1].Name = "site" }), []string{`spec.variables[1].name: "site" is declared twice`}},
		{"variable name bad", class(func(c *typesv1.ClusterClass) { c.Spec.Variables[3].Name = "2workers" }), []string{`spec.variables[3].name: "2workers" is not a variable name`}},
		{"integer default above max", class(func(c *typesv1.ClusterClass) { c.Spec.Variables[3].Default = "11" }),
			[]string{"spec.variables[3].default: 11 is above the maximum 10"}},
		{"integer default not a number", class(func(c *typesv1.ClusterClass) { c.Spec.Variables[3].Default = "two" }),
			[]string{`spec.variables[3].default: "two" is not an integer`}},
		{"min above max", class(func(c *typesv1.ClusterClass) { c.Spec.Variables[3].Minimum = i64(20) }),
			[]string{"spec.variables[3]: minimum 20 is above maximum 10", "default: 2 is below the minimum 20"}},
		{"enum default not listed", class(func(c *typesv1.ClusterClass) { c.Spec.Variables[1].Default = "centos" }),
			[]string{`spec.variables[1].default: "centos" is not one of debian12, ubuntu24`}},
		{"enum without values", class(func(c *typesv1.ClusterClass) { c.Spec.Variables[1].Enum = nil; c.Spec.Variables[1].Default = "" }),
			[]string{"spec.variables[1].enum: required for type enum"}},
		{"enum with bounds", class(func(c *typesv1.ClusterClass) { c.Spec.Variables[1].Maximum = i64(3) }),
			[]string{"spec.variables[1]: minimum and maximum do not apply to type enum"}},
		{"enum values on a string", class(func(c *typesv1.ClusterClass) { c.Spec.Variables[0].Enum = []string{"a"} }),
			[]string{"spec.variables[0].enum: is for type enum only"}},
		{"cidr default not a cidr", class(func(c *typesv1.ClusterClass) { c.Spec.Variables[2].Default = "10.244.0.0" }),
			[]string{`spec.variables[2].default: "10.244.0.0" is not a CIDR`}},
		{"cidr default too short a prefix", class(func(c *typesv1.ClusterClass) { c.Spec.Variables[2].Default = "10.0.0.0/8" }),
			[]string{"spec.variables[2].default: 10.0.0.0/8 has prefix length /8, shorter than the minimum /12"}},
		{"cidr bound out of range", class(func(c *typesv1.ClusterClass) { c.Spec.Variables[2].Maximum = i64(200) }),
			[]string{"a cidr's minimum and maximum bound its prefix length: use 0 to 128, not 200"}},
		{"reference to an undeclared variable", class(func(c *typesv1.ClusterClass) { c.Spec.ControlPlane.HostSelector["rack"] = "${rack}" }),
			[]string{"spec.controlPlane.hostSelector[rack]: ${rack} names no variable of spec.variables"}},
		{"reference in the cluster template", class(func(c *typesv1.ClusterClass) { c.Spec.Cluster.DnsDomain = "${domain}.local" }),
			[]string{"spec.cluster.dnsDomain: ${domain} names no variable"}},
		{"reference in a worker template", class(func(c *typesv1.ClusterClass) { c.Spec.Workers[1].Template.Image = "${image}" }),
			[]string{"spec.workers[1].template.image: ${image} names no variable"}},
		{"reference unclosed", class(func(c *typesv1.ClusterClass) { c.Spec.Workers[1].Template.Image = "img-${os" }),
			[]string{"spec.workers[1].template.image", "${ without a closing }"}},
		{"lone dollar", class(func(c *typesv1.ClusterClass) { c.Spec.Workers[1].Template.Image = "img-$os" }),
			[]string{"a lone $ at offset 4: write ${name} for a variable or $$ for a dollar sign"}},
		{"reference in a health check timeout", class(func(c *typesv1.ClusterClass) {
			c.Spec.ControlPlane.HealthCheck.UnhealthyConditions[0].Timeout = "${timeout}"
		}), []string{"spec.controlPlane.healthCheck.unhealthyConditions[0].timeout: ${timeout} names no variable"}},
		{"literal template checked", class(func(c *typesv1.ClusterClass) { c.Spec.Workers[0].Template.Strategy.MaxSurge = "lots" }),
			[]string{`spec.workers[0].template.strategy.maxSurge: "lots" is not a count or a percentage`}},
		{"control plane surge", class(func(c *typesv1.ClusterClass) { c.Spec.ControlPlane.RolloutMaxSurge = 2 }),
			[]string{"spec.controlPlane.rolloutMaxSurge: 2 is not supported"}},
		{"control plane strategy", class(func(c *typesv1.ClusterClass) { c.Spec.ControlPlane.Strategy = &typesv1.RolloutStrategy{} }),
			[]string{"spec.controlPlane.strategy: is for worker classes"}},
		{"health check condition unknown", class(func(c *typesv1.ClusterClass) { c.Spec.ControlPlane.HealthCheck.UnhealthyConditions[0].Type = "Ready" }),
			[]string{`spec.controlPlane.healthCheck.unhealthyConditions[0].type: "Ready" is not a condition`}},
		{"health check selector set", class(func(c *typesv1.ClusterClass) { c.Spec.ControlPlane.HealthCheck.Selector = map[string]string{"a": "b"} }),
			[]string{"spec.controlPlane.healthCheck: cluster and selector are filled in by the controller"}},
		{"class sets a version", class(func(c *typesv1.ClusterClass) { c.Spec.Cluster.KubernetesVersion = "v1.34.4" }),
			[]string{"spec.cluster.kubernetesVersion: is set by each cluster's spec.topology.version"}},
		{"literal pod cidr checked", class(func(c *typesv1.ClusterClass) { c.Spec.Cluster.PodCidr = "10.244.0.1/16" }),
			[]string{`spec.cluster.podCidr: "10.244.0.1/16" has host bits set`}},
		{"rollout change set", class(func(c *typesv1.ClusterClass) {
			c.Spec.Rollout = &typesv1.RolloutSpec{Change: &typesv1.RolloutChange{KubernetesVersion: "v1.35.0"}}
		}), []string{"spec.rollout.change: is filled in by the controller"}},

		// Cluster.spec.topology on its own.
		{"valid topology cluster", topoCluster(func(*typesv1.Cluster) {}), nil},
		{"topology without class", topoCluster(func(c *typesv1.Cluster) { c.Spec.Topology.Class = "" }), []string{"spec.topology.class: required"}},
		{"topology without version", topoCluster(func(c *typesv1.Cluster) { c.Spec.Topology.Version = "" }), []string{"spec.topology.version: required"}},
		{"topology and kubernetesVersion", topoCluster(func(c *typesv1.Cluster) { c.Spec.KubernetesVersion = "v1.34.4" }),
			[]string{"spec.kubernetesVersion: is set by spec.topology.version"}},
		{"topology even control plane", topoCluster(func(c *typesv1.Cluster) { c.Spec.Topology.ControlPlaneReplicas = 2 }),
			[]string{"spec.topology.controlPlaneReplicas: 2 is even"}},
		{"topology pools unique", topoCluster(func(c *typesv1.Cluster) {
			c.Spec.Topology.Workers = append(c.Spec.Topology.Workers, &typesv1.TopologyWorkerPool{Name: "app", Class: "gpu"})
		}), []string{`spec.topology.workers[1].name: "app" is used by another pool`}},
		{"topology pool without class", topoCluster(func(c *typesv1.Cluster) { c.Spec.Topology.Workers[0].Class = "" }),
			[]string{"spec.topology.workers[0].class: required"}},
		{"topology pool negative", topoCluster(func(c *typesv1.Cluster) { c.Spec.Topology.Workers[0].Replicas = -1 }),
			[]string{"spec.topology.workers[0].replicas: -1 is negative"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := Validate(tt.r)
			if len(tt.want) == 0 {
				require.NoError(t, err, "Validate(%s)", tt.name)
				return
			}
			require.Error(t, err, "Validate(%s) = nil, want %q", tt.name, tt.want)
			require.True(t, errdefs.IsInvalidArgument(err))
			for _, w := range tt.want {
				require.Contains(t, err.Error(), w, "Validate(%s) = %v, want %q", tt.name, err, w)
			}
		})
	}
}

func TestValidateTopologyAgainst(t *testing.T) {
	stored := func() *typesv1.ClusterClass {
		c := validClass()
		c.Status = &typesv1.ClusterClassStatus{Revision: 1, Revisions: []*typesv1.ClusterClassRevision{{Revision: 1, Spec: validClass().GetSpec()}}}
		return c
	}
	filled := func(mod func(*typesv1.Cluster)) *controllerv1.Resource {
		return topoCluster(func(c *typesv1.Cluster) {
			c.Spec.PodCidr, c.Spec.ServiceCidr = "10.244.0.0/16", "10.96.0.0/12"
			mod(c)
		})
	}
	existing := func(version string) *controllerv1.Resource {
		r := filled(func(c *typesv1.Cluster) { c.Spec.Topology.Version = version })
		r.GetCluster().Status = &typesv1.ClusterStatus{Topology: &typesv1.ClusterTopologyStatus{ClassRevision: 1}}
		return r
	}
	tests := []struct {
		name string
		r    *controllerv1.Resource
		o    Observed
		want []string
	}{
		{"valid", filled(func(*typesv1.Cluster) {}), Observed{Class: stored(), ClassSpec: stored().GetSpec()}, nil},
		{"class missing", filled(func(*typesv1.Cluster) {}), Observed{}, []string{`spec.topology.class: ClusterClass "edge" does not exist: apply it first`}},
		{"pool names an absent worker class", filled(func(c *typesv1.Cluster) { c.Spec.Topology.Workers[0].Class = "big" }),
			Observed{Class: stored(), ClassSpec: stored().GetSpec()},
			[]string{`spec.topology.workers[0].class: pool app names worker class "big", which the class does not have (it has general, gpu)`}},
		{"required variable missing", filled(func(c *typesv1.Cluster) { c.Spec.Topology.Variables = nil }),
			Observed{Class: stored(), ClassSpec: stored().GetSpec()}, []string{"spec.topology.variables.site: required"}},
		{"variable above max", filled(func(c *typesv1.Cluster) { c.Spec.Topology.Variables["workers"] = "12" }),
			Observed{Class: stored(), ClassSpec: stored().GetSpec()}, []string{"spec.topology.variables.workers: 12 is above the maximum 10"}},
		{"variable undeclared", filled(func(c *typesv1.Cluster) { c.Spec.Topology.Variables["color"] = "red" }),
			Observed{Class: stored(), ClassSpec: stored().GetSpec()}, []string{"spec.topology.variables.color: the class declares no such variable"}},
		{"no pod cidr from anywhere", topoCluster(func(*typesv1.Cluster) {}),
			Observed{Class: stored(), ClassSpec: stored().GetSpec()}, []string{`spec.podCidr: required: neither the cluster nor ClusterClass "edge"`}},
		{"version skips a minor", filled(func(c *typesv1.Cluster) { c.Spec.Topology.Version = "v1.36.0" }),
			Observed{Current: existing("v1.34.4"), Class: stored(), ClassSpec: stored().GetSpec()},
			[]string{"spec.topology.version: v1.34 -> v1.36 skips v1.35"}},
		{"class changes", filled(func(c *typesv1.Cluster) { c.Spec.Topology.Class = "core" }),
			Observed{Current: existing("v1.34.4"), Class: stored(), ClassSpec: stored().GetSpec()},
			[]string{`spec.topology.class: cannot change from "edge" to "core"`}},
		{"image of another version", filled(func(*typesv1.Cluster) {}),
			Observed{Class: stored(), ClassSpec: func() *typesv1.ClusterClassSpec {
				s := validClass().GetSpec()
				s.Workers[0].Template.Image = "debian12-k8s1.36.0"
				return s
			}(), ImageVersions: map[string]string{"debian12-k8s1.36.0": "v1.36.0"}},
			[]string{"image debian12-k8s1.36.0 of pool app holds Kubernetes v1.36.0 but the cluster runs v1.34.4: that skips v1.35"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := ValidateAgainst(tt.r, tt.o)
			if len(tt.want) == 0 {
				require.NoError(t, err)
				return
			}
			require.Error(t, err, "ValidateAgainst(%s) = nil, want %q", tt.name, tt.want)
			for _, w := range tt.want {
				require.Contains(t, err.Error(), w, "ValidateAgainst(%s) = %v, want %q", tt.name, err, w)
			}
		})
	}
}

// TestValidateClassChangeAgainstClusters: a class change is refused when
// it would break a cluster of the class, naming each one and why.
func TestValidateClassChangeAgainstClusters(t *testing.T) {
	clusters := []*typesv1.Cluster{
		topoCluster(func(c *typesv1.Cluster) { c.Metadata.Name = "a"; c.Spec.Topology.Variables["workers"] = "8" }).GetCluster(),
		topoCluster(func(c *typesv1.Cluster) {
			c.Metadata.Name = "b"
			c.Spec.Topology.Workers = append(c.Spec.Topology.Workers, &typesv1.TopologyWorkerPool{Name: "ml", Class: "gpu", Replicas: 1})
		}).GetCluster(),
		topoCluster(func(c *typesv1.Cluster) { c.Metadata.Name = "c" }).GetCluster(),
	}
	tests := []struct {
		name string
		mod  func(*typesv1.ClusterClass)
		want []string
		not  []string
	}{
		{"compatible change", func(c *typesv1.ClusterClass) { c.Spec.ControlPlane.HealthCheck.MaxUnhealthy = "2" }, nil, nil},
		{"narrower max", func(c *typesv1.ClusterClass) { c.Spec.Variables[3].Maximum = i64(5) },
			[]string{"would break 1 cluster(s) of the class: a (variables.workers: 8 is above the maximum 5)"}, []string{"b (", "c ("}},
		{"worker class removed", func(c *typesv1.ClusterClass) { c.Spec.Workers = c.Spec.Workers[:1] },
			[]string{`b (workers[1].class: pool ml names worker class "gpu", which the class does not have (it has general))`}, []string{"a (", "c ("}},
		{"new required variable", func(c *typesv1.ClusterClass) {
			c.Spec.Variables = append(c.Spec.Variables, &typesv1.ClusterClassVariable{Name: "zone", Type: "string", Required: true})
		}, []string{"would break 3 cluster(s)", "a (variables.zone: required", "b (variables.zone", "c (variables.zone"}, nil},
		{"image of a skipped minor", func(c *typesv1.ClusterClass) {
			c.Spec.ControlPlane.ImageSelector = nil
			c.Spec.ControlPlane.Image = "k8s-136"
		},
			[]string{"image k8s-136 of the control plane holds Kubernetes v1.36.0 but the cluster runs v1.34.4: that skips v1.35"}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := class(tt.mod)
			require.NoError(t, Validate(r))
			err := ValidateAgainst(r, Observed{ClassClusters: clusters, ImageVersions: map[string]string{"k8s-136": "v1.36.0"}})
			if len(tt.want) == 0 {
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
			for _, w := range tt.want {
				require.Contains(t, err.Error(), w)
			}
			for _, n := range tt.not {
				require.False(t, strings.Contains(err.Error(), n), "ValidateAgainst = %v, should not name %q", err, n)
			}
		})
	}
}
