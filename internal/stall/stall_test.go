package stall

import (
	"strings"
	"testing"
	"time"

	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestDetector feeds snapshots at times of a fake clock: only a stretch
// of the timeout without any change is a stall.
func TestDetector(t *testing.T) {
	t0 := time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	v := func(kv ...string) map[string]string {
		m := map[string]string{}
		for i := 0; i+1 < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	steps := []struct {
		at       time.Duration
		versions map[string]string
		stalled  bool
		why      string
	}{
		{0, v("cluster/lab", "5"), false, "the first snapshot starts the clock"},
		{4 * time.Minute, v("cluster/lab", "5"), false, "unchanged, but for less than the timeout"},
		{5 * time.Minute, v("cluster/lab", "5"), true, "unchanged for the timeout"},
		{6 * time.Minute, v("cluster/lab", "5", "machine/lab-cp-x", "7"), false, "an object appeared"},
		{10 * time.Minute, v("cluster/lab", "5", "machine/lab-cp-x", "7"), false, "4m since the change"},
		{11 * time.Minute, v("cluster/lab", "5", "machine/lab-cp-x", "9"), false, "a version changed"},
		{16*time.Minute - time.Second, v("cluster/lab", "5", "machine/lab-cp-x", "9"), false, "1s short"},
		{16 * time.Minute, v("cluster/lab", "5", "machine/lab-cp-x", "9"), true, "stalled again"},
		{17 * time.Minute, v("cluster/lab", "5"), false, "an object went away"},
		{17 * time.Minute, v("cluster/lab", "5", "host/h1", "5"), false, "same count, another object"},
	}
	d := New(5 * time.Minute)
	if !d.LastChange().IsZero() {
		t.Errorf("LastChange() before any snapshot = %v, want zero", d.LastChange())
	}
	for _, s := range steps {
		if got := d.Observe(at(s.at), s.versions); got != s.stalled {
			t.Errorf("Observe(+%v, %v) = %v, want %v (%s)", s.at, s.versions, got, s.stalled, s.why)
		}
	}
	if got, want := d.LastChange(), at(17*time.Minute); !got.Equal(want) {
		t.Errorf("LastChange() = %v, want %v", got, want)
	}
	// The caller's map may change after Observe.
	m := v("a", "1")
	d = New(time.Minute)
	d.Observe(at(0), m)
	m["a"] = "2"
	if d.Observe(at(time.Minute), v("a", "1")) != true {
		t.Errorf("Observe kept a reference to the caller's map")
	}
}

func res(obj any) *controllerv1.Resource {
	switch o := obj.(type) {
	case *typesv1.Cluster:
		return &controllerv1.Resource{Kind: &controllerv1.Resource_Cluster{Cluster: o}}
	case *typesv1.ControlPlane:
		return &controllerv1.Resource{Kind: &controllerv1.Resource_ControlPlane{ControlPlane: o}}
	case *typesv1.MachineDeployment:
		return &controllerv1.Resource{Kind: &controllerv1.Resource_MachineDeployment{MachineDeployment: o}}
	case *typesv1.Machine:
		return &controllerv1.Resource{Kind: &controllerv1.Resource_Machine{Machine: o}}
	case *typesv1.Host:
		return &controllerv1.Resource{Kind: &controllerv1.Resource_Host{Host: o}}
	}
	panic("res: unknown kind")
}

func meta(name, rv string) *typesv1.ObjectMeta {
	return &typesv1.ObjectMeta{Name: name, ResourceVersion: rv}
}

func refs(items []*controllerv1.Resource) string {
	var out []string
	for _, r := range items {
		out = append(out, Ref(r))
	}
	return strings.Join(out, " ")
}

func TestScopeVersionsBlocked(t *testing.T) {
	items := []*controllerv1.Resource{
		res(&typesv1.Cluster{Metadata: meta("lab", "1"), Status: &typesv1.ClusterStatus{Conditions: []*typesv1.Condition{
			{Type: "Ready", Status: "False", Reason: "WaitingForControlPlane"}}}}),
		res(&typesv1.Cluster{Metadata: meta("prod", "2")}),
		res(&typesv1.ControlPlane{Metadata: meta("lab-cp", "3"), Spec: &typesv1.ControlPlaneSpec{Cluster: "lab"},
			Status: &typesv1.ControlPlaneStatus{Conditions: []*typesv1.Condition{{Type: "Ready", Status: "Unknown"}}}}),
		res(&typesv1.MachineDeployment{Metadata: meta("prod-w", "4"), Spec: &typesv1.MachineDeploymentSpec{Cluster: "prod"}}),
		res(&typesv1.Machine{Metadata: meta("lab-cp-x", "5"), Spec: &typesv1.MachineSpec{Cluster: "lab", Owner: "ControlPlane/lab-cp", Host: "h1"},
			Status: &typesv1.MachineStatus{Conditions: []*typesv1.Condition{
				{Type: "Ready", Status: "False", Reason: "WaitingForImage"},
				{Type: "ImageResolved", Status: "False", Reason: "ImageNotFound", Severity: "Error", Message: "image a not found;\nkilnctl get images lists 0"},
				{Type: "BootstrapFailed", Status: "False"}}}}),
		res(&typesv1.Machine{Metadata: meta("prod-w-y", "6"), Spec: &typesv1.MachineSpec{Cluster: "prod", Owner: "MachineDeployment/prod-w", Host: "h2"}}),
		res(&typesv1.Host{Metadata: meta("h1", "7")}),
		res(&typesv1.Host{Metadata: meta("h2", "8")}),
		res(&typesv1.Host{Metadata: meta("h3", "9"), Status: &typesv1.HostStatus{Machine: "lab-cp-z", State: typesv1.HostState_HOST_STATE_ERROR, ErrorReason: "disk not found"}}),
		res(&typesv1.Machine{Metadata: meta("lab-cp-z", "10"), Spec: &typesv1.MachineSpec{Cluster: "lab", Owner: "ControlPlane/lab-cp"}}),
	}
	tests := []struct{ kind, name, want string }{
		{"Cluster", "lab", "cluster/lab controlplane/lab-cp machine/lab-cp-x machine/lab-cp-z host/h1 host/h3"},
		{"ControlPlane", "lab-cp", "controlplane/lab-cp machine/lab-cp-x machine/lab-cp-z host/h1 host/h3"},
		{"MachineDeployment", "prod-w", "machinedeployment/prod-w machine/prod-w-y host/h2"},
		{"Machine", "prod-w-y", "machine/prod-w-y host/h2"},
		{"Host", "h2", "host/h2"},
	}
	for _, tt := range tests {
		if got := refs(Scope(tt.kind, tt.name, items)); got != tt.want {
			t.Errorf("Scope(%s, %s) = %s, want %s", tt.kind, tt.name, got, tt.want)
		}
	}
	scope := Scope("Cluster", "lab", items)
	v := Versions(scope)
	if len(v) != 6 || v["machine/lab-cp-x"] != "5" || v["host/h3"] != "9" {
		t.Errorf("Versions(Scope(Cluster, lab)) = %v", v)
	}
	got := strings.Join(Blocked(scope), "\n")
	want := "cluster/lab: Ready=False WaitingForControlPlane\n" +
		"machine/lab-cp-x: ImageResolved=False ImageNotFound: image a not found; kilnctl get images lists 0\n" +
		"machine/lab-cp-x: Ready=False WaitingForImage\n" +
		"machine/lab-cp-z: no conditions: nothing has reported on it\n" +
		"host/h1: no conditions: nothing has reported on it\n" +
		"host/h3: state Error: disk not found"
	if got != want {
		t.Errorf("Blocked(Scope(Cluster, lab)) =\n%s\nwant\n%s", got, want)
	}
	for kind, want := range map[string]string{
		"Cluster": "Cluster ControlPlane MachineDeployment Machine HealthCheck Host",
		"Machine": "Machine Host",
		"Host":    "Host",
	} {
		if got := strings.Join(ScopeKinds(kind), " "); got != want {
			t.Errorf("ScopeKinds(%s) = %s, want %s", kind, got, want)
		}
	}
}
