package manifest

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/errdefs"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

const goodCluster = `apiVersion: kiln.dev/v1
kind: Cluster
metadata:
  name: lab
  labels:
    upgrade-wave: 1
spec:
  kubernetesVersion: v1.34.4
  podCidr: 10.244.0.0/16
  serviceCidr: 10.96.0.0/12
`

func TestDecodeGood(t *testing.T) {
	docs, err := Decode("lab.yaml", []byte(goodCluster+"---\n---\n"+`apiVersion: kiln.dev/v1
kind: MachineDeployment
metadata: {name: lab-workers}
spec:
  cluster: lab
  replicas: 2
  strategy:
    maxSurge: 1
    maxUnavailable: 25%
status:
  replicas: 7
`))
	require.NoError(t, err)
	require.Len(t, docs, 2)

	c := docs[0].Resource.GetCluster()
	want := &typesv1.Cluster{ApiVersion: APIVersion, Kind: "Cluster",
		Metadata: &typesv1.ObjectMeta{Name: "lab", Labels: map[string]string{"upgrade-wave": "1"}},
		Spec:     &typesv1.ClusterSpec{KubernetesVersion: "v1.34.4", PodCidr: "10.244.0.0/16", ServiceCidr: "10.96.0.0/12"}}
	if !proto.Equal(c, want) {
		t.Errorf("Decode(cluster) = %v, want %v", c, want)
	}
	md := docs[1].Resource.GetMachineDeployment()
	if got := md.GetSpec().GetStrategy().GetMaxSurge(); got != "1" {
		t.Errorf("Decode(md).spec.strategy.maxSurge = %q, want \"1\"", got)
	}
	if md.GetStatus() != nil {
		t.Errorf("Decode(md).status = %v, want nil (status is ignored)", md.GetStatus())
	}
	if docs[1].Line != 13 {
		t.Errorf("Decode(md).Line = %d, want 13", docs[1].Line)
	}
}

func TestDecodeErrors(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want []string // lines of the error, exactly
	}{
		{"unknown field with suggestion", strings.Replace(goodCluster, "podCidr", "podCIDR", 1),
			[]string{"f.yaml:9: spec.podCIDR: unknown field (did you mean podCidr?)"}},
		{"proto name suggests json name", strings.Replace(goodCluster, "podCidr", "pod_cidr", 1),
			[]string{"f.yaml:9: spec.pod_cidr: unknown field (did you mean podCidr?)"}},
		{"unknown field without suggestion", goodCluster + "  flavour: large\n",
			[]string{"f.yaml:11: spec.flavour: unknown field: ClusterSpec has ccmManifest, certificateRenewalDays, cloudProvider, cniManifest, controlPlaneEndpoint, dnsDomain, kubernetesVersion, paused, podCidr, serviceCidr, topology"}},
		{"wrong type int for string", strings.Replace(goodCluster, "v1.34.4", "1.34", 1),
			[]string{`f.yaml:8: spec.kubernetesVersion: want a string, got the number 1.34: quote it ("1.34")`}},
		{"wrong type string for int", "apiVersion: kiln.dev/v1\nkind: ControlPlane\nmetadata:\n  name: cp\nspec:\n  cluster: lab\n  replicas: three\n",
			[]string{`f.yaml:7: spec.replicas: want an integer, got "three"`}},
		{"wrong type list for bool", "apiVersion: kiln.dev/v1\nkind: Host\nmetadata:\n  name: h\nspec:\n  bmc: {protocol: none}\n  online: [yes]\n",
			[]string{"f.yaml:7: spec.online: want true or false, got a list"}},
		{"wrong type scalar for message", "apiVersion: kiln.dev/v1\nkind: Host\nmetadata:\n  name: h\nspec:\n  bmc: redfish\n",
			[]string{`f.yaml:6: spec.bmc: want a mapping of fields, got "redfish"`}},
		{"int32 out of range", "apiVersion: kiln.dev/v1\nkind: ControlPlane\nmetadata:\n  name: cp\nspec:\n  cluster: lab\n  replicas: 9999999999\n",
			[]string{"f.yaml:7: spec.replicas: 9999999999 is out of range for a 32-bit integer"}},
		{"int for non int-or-percent string", "apiVersion: kiln.dev/v1\nkind: HealthCheck\nmetadata:\n  name: hc\nspec:\n  cluster: lab\n  nodeStartupTimeout: 10\n",
			[]string{`f.yaml:7: spec.nodeStartupTimeout: want a string, got the number 10: quote it ("10")`}},
		{"mistyped password is not echoed", "apiVersion: kiln.dev/v1\nkind: Host\nmetadata:\n  name: h\nspec:\n  bmc:\n    protocol: ipmi\n    password: 98765431\n",
			[]string{"f.yaml:8: spec.bmc.password: want a string: quote the value"}},
		{"list element", "apiVersion: kiln.dev/v1\nkind: HealthCheck\nmetadata:\n  name: hc\nspec:\n  cluster: lab\n  unhealthyConditions:\n    - type: Ready\n      statuss: \"False\"\n",
			[]string{"f.yaml:9: spec.unhealthyConditions[0].statuss: unknown field (did you mean status?)"}},
		{"duplicate field", goodCluster + "  podCidr: 10.245.0.0/16\n",
			[]string{"f.yaml:11: spec.podCidr: duplicate field (first at line 9)"}},
		// Found by FuzzDecode: empty metadata and spec were accepted, and
		// the resource then marshalled to a document Decode refused.
		{"empty metadata and spec", "apiVersion: kiln.dev/v1\nkind: Cluster\nmetadata:\nspec: ~\n",
			[]string{"f.yaml:1: metadata: required: at least metadata.name", "f.yaml:1: spec: required"}},
		{"unknown kind", strings.Replace(goodCluster, "kind: Cluster", "kind: Clustr", 1),
			[]string{`f.yaml:2: kind: unknown kind "Clustr" (did you mean Cluster?)`}},
		{"missing kind", strings.Replace(goodCluster, "kind: Cluster\n", "", 1),
			[]string{"f.yaml:1: kind: required: one of Host, Image, Cluster, ControlPlane, MachineDeployment, Machine, HealthCheck, ClusterClass, Rollout, GitSource"}},
		{"bad api version", strings.Replace(goodCluster, "kiln.dev/v1", "kiln.dev/v1beta1", 1),
			[]string{`f.yaml:1: apiVersion: "kiln.dev/v1beta1" is not served: use kiln.dev/v1`}},
		{"unknown top-level key", goodCluster + "specs: {}\n",
			[]string{"f.yaml:11: specs: unknown field (did you mean spec?)"}},
		{"missing spec", "apiVersion: kiln.dev/v1\nkind: Image\nmetadata:\n  name: img\n",
			[]string{"f.yaml:1: spec: required"}},
		{"not a mapping", "- a\n- b\n",
			[]string{"f.yaml:1: a document must be a mapping with apiVersion, kind, metadata and spec"}},
		{"syntax error", "apiVersion: kiln.dev/v1\nkind: Host\nmetadata:\n  name: [h\n",
			[]string{"f.yaml:4: invalid YAML: did not find expected ',' or ']'"}},
		{"syntax error in a block", "apiVersion: kiln.dev/v1\nkind: Host\nmetadata:\n  labels:\n    - x\n    y: 2\n",
			[]string{"f.yaml:5: invalid YAML: did not find expected '-' indicator"}},
		{"scanner error", "apiVersion: kiln.dev/v1\nkind: Host\nmetadata:\n  name: a: b\n",
			[]string{"f.yaml:4: invalid YAML: mapping values are not allowed in this context"}},
		{"several problems in several documents", strings.Replace(goodCluster, "podCidr", "podCIDR", 1) + "---\n" + strings.Replace(goodCluster, "serviceCidr", "servicecidr", 1),
			[]string{"f.yaml:9: spec.podCIDR: unknown field (did you mean podCidr?)", "f.yaml:21: spec.servicecidr: unknown field (did you mean serviceCidr?)"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			docs, err := Decode("f.yaml", []byte(tt.in))
			if err == nil {
				t.Fatalf("Decode(%q) = %d docs, nil error, want %q", tt.name, len(docs), tt.want)
			}
			if !errdefs.IsInvalidArgument(err) {
				t.Errorf("Decode(%q) error class = %v, want InvalidArgument", tt.name, err)
			}
			if got, want := err.Error(), strings.Join(tt.want, "\n"); got != want {
				t.Errorf("Decode(%q) = %q, want %q", tt.name, got, want)
			}
			if docs != nil {
				t.Errorf("Decode(%q) returned %d documents with an error, want none", tt.name, len(docs))
			}
		})
	}
}

func TestLoadValidationLines(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "lab.yaml")
	in := strings.Replace(goodCluster, "10.244.0.0/16", "10.244.1.0/16", 1) + "---\napiVersion: kiln.dev/v1\nkind: ControlPlane\nmetadata:\n  name: cp\nspec:\n  cluster: lab\n  replicas: 2\n"
	require.NoError(t, os.WriteFile(p, []byte(in), 0o644))
	_, err := Load(nil, p)
	require.Error(t, err)
	want := p + `:9: spec.podCidr: "10.244.1.0/16" has host bits set: use 10.244.0.0/16` + "\n" +
		p + ":18: spec.replicas: 2 is even: an even number of control-plane members cannot keep etcd quorum better than one less: use 1, 3 or 5"
	if err.Error() != want {
		t.Errorf("Load(%q) = %q, want %q", p, err, want)
	}
}

func TestLoadDirectoryAllOrNothing(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "a.yaml"), []byte(goodCluster), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "notes.txt"), []byte("not yaml: ["), 0o644))
	docs, err := Load(nil, dir)
	require.NoError(t, err)
	require.Len(t, docs, 1)

	// One bad file among good ones: nothing comes back.
	require.NoError(t, os.WriteFile(filepath.Join(dir, "b.yml"), []byte(strings.Replace(goodCluster, "name: lab", "name: Lab", 1)), 0o644))
	docs, err = Load(nil, dir)
	if err == nil || docs != nil {
		t.Fatalf("Load(dir with a bad file) = %d docs, %v, want no docs and an error", len(docs), err)
	}
	if want := filepath.Join(dir, "b.yml") + `:4: metadata.name: "Lab" is not a DNS-1123 name`; !strings.Contains(err.Error(), want) {
		t.Errorf("Load(dir) = %q, want it to contain %q", err, want)
	}

	// The same resource twice.
	require.NoError(t, os.WriteFile(filepath.Join(dir, "b.yml"), []byte(goodCluster), 0o644))
	_, err = Load(nil, dir)
	if want := filepath.Join(dir, "b.yml") + ":1: Cluster/lab is also defined at " + filepath.Join(dir, "a.yaml") + ":1"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("Load(dir with a duplicate) = %v, want %q", err, want)
	}

	// Standard input.
	docs, err = Load(strings.NewReader(goodCluster), "-")
	require.NoError(t, err)
	if len(docs) != 1 || docs[0].File != "-" {
		t.Errorf("Load(stdin) = %v, want one document from -", docs)
	}

	if _, err := Load(nil, t.TempDir()); err == nil || !strings.Contains(err.Error(), "holds no *.yaml or *.yml files") {
		t.Errorf("Load(empty dir) = %v, want an error naming the empty directory", err)
	}
}

// TestExamples parses and validates every file in examples/: what we show
// users must apply.
func TestExamples(t *testing.T) {
	docs, err := Load(nil, "../../examples")
	require.NoError(t, err)
	kinds := map[string]int{}
	for _, d := range docs {
		kind, _ := validation.KindName(d.Resource)
		kinds[kind]++
	}
	want := map[string]int{"Host": 3, "Image": 1, "Cluster": 2, "ControlPlane": 2, "MachineDeployment": 2, "HealthCheck": 1}
	for k, n := range want {
		if kinds[k] != n {
			t.Errorf("Load(examples) has %d %s, want %d", kinds[k], k, n)
		}
	}
	for _, f := range []string{"host-redfish.yaml", "host-ipmi.yaml", "host-byoh.yaml", "image.yaml", "cluster.yaml", "lab-cluster.yaml"} {
		if _, err := os.Stat(filepath.Join("../../examples", f)); err != nil {
			t.Errorf("examples/%s: %v", f, err)
		}
	}
}

func TestMarshalRoundTrip(t *testing.T) {
	docs, err := Load(nil, "../../examples")
	require.NoError(t, err)
	for _, d := range docs {
		b, err := Marshal(d.Resource)
		require.NoError(t, err)
		back, err := Decode("out.yaml", b)
		require.NoError(t, err, "output:\n%s", b)
		require.Len(t, back, 1)
		if !proto.Equal(back[0].Resource, d.Resource) {
			t.Errorf("Decode(Marshal(%s)) = %v, want %v\n%s", d.Summary(), back[0].Resource, d.Resource, b)
		}
		j, err := MarshalJSON(d.Resource)
		require.NoError(t, err)
		back, err = Decode("out.json", j)
		require.NoError(t, err, "output:\n%s", j)
		require.Len(t, back, 1)
		if !proto.Equal(back[0].Resource, d.Resource) {
			t.Errorf("Decode(MarshalJSON(%s)) = %v, want %v\n%s", d.Summary(), back[0].Resource, d.Resource, j)
		}
	}
}

func TestMarshalOrderAndStatus(t *testing.T) {
	md := &typesv1.MachineDeployment{
		Metadata: &typesv1.ObjectMeta{Name: "w", Generation: 3, Labels: map[string]string{"b": "2", "a": "1"}},
		Spec:     &typesv1.MachineDeploymentSpec{Cluster: "lab", Replicas: 2, Strategy: &typesv1.RolloutStrategy{MaxSurge: "1"}},
		Status: &typesv1.MachineDeploymentStatus{Replicas: 2, Conditions: []*typesv1.Condition{
			{Type: "Ready", Status: "True", Reason: "AllReady", Message: "line one\nline two"},
		}},
	}
	b, err := Marshal(&controllerv1.Resource{Kind: &controllerv1.Resource_MachineDeployment{MachineDeployment: md}})
	require.NoError(t, err)
	want := `apiVersion: kiln.dev/v1
kind: MachineDeployment
metadata:
  name: w
  labels:
    a: "1"
    b: "2"
  generation: 3
spec:
  cluster: lab
  replicas: 2
  strategy:
    maxSurge: "1"
status:
  replicas: 2
  conditions:
    - type: Ready
      status: "True"
      reason: AllReady
      message: |-
        line one
        line two
`
	if string(b) != want {
		t.Errorf("Marshal(md) =\n%s\nwant\n%s", b, want)
	}
	j, err := MarshalJSON(&controllerv1.Resource{Kind: &controllerv1.Resource_MachineDeployment{MachineDeployment: md}})
	require.NoError(t, err)
	if !strings.Contains(string(j), `"maxSurge": "1"`) || !strings.HasPrefix(string(j), "{\n  \"apiVersion\": \"kiln.dev/v1\"") {
		t.Errorf("MarshalJSON(md) = %s, want indented JSON starting with apiVersion", j)
	}
}

func TestSuggest(t *testing.T) {
	names := []string{"podCidr", "serviceCidr", "dnsDomain", "kubernetesVersion"}
	tests := []struct{ key, want string }{
		{"podCIDR", "podCidr"},
		{"pod_cidr", "podCidr"},
		{"kubernetesVerison", "kubernetesVersion"},
		{"dnsdomain", "dnsDomain"},
		{"flavour", ""},
		{"x", ""},
	}
	for _, tt := range tests {
		if got := suggest(tt.key, names); got != tt.want {
			t.Errorf("suggest(%q) = %q, want %q", tt.key, got, tt.want)
		}
	}
}

func TestEnumWord(t *testing.T) {
	values := typesv1.HostState(0).Descriptor().Values()
	tests := []struct {
		name protoreflect.Name
		want string
	}{
		{"HOST_STATE_PROVISIONED", "Provisioned"},
		{"HOST_STATE_REGISTERING", "Registering"},
		{"HOST_STATE_ERROR", "Error"},
		{"HOST_STATE_UNSPECIFIED", "Unspecified"},
	}
	for _, tt := range tests {
		ev := values.ByName(tt.name)
		require.NotNil(t, ev, tt.name)
		if got := EnumWord(ev); got != tt.want {
			t.Errorf("EnumWord(%s) = %q, want %q", tt.name, got, tt.want)
		}
	}
	for in, want := range map[string]string{"HostState": "HOST_STATE", "BMCProtocol": "BMC_PROTOCOL", "State": "STATE"} {
		if got := upperSnake(in); got != want {
			t.Errorf("upperSnake(%q) = %q, want %q", in, got, want)
		}
	}
}

// The outputs use the API's word for enums, as the tables do, and read
// back to the same message, as does the proto name older kilnctls wrote.
func TestEnumWordsRoundTrip(t *testing.T) {
	st := &typesv1.HostStatus{State: typesv1.HostState_HOST_STATE_PROVISIONED, Power: "on", Machine: "lab-cp-1",
		Conditions: []*typesv1.Condition{{Type: "Ready", Status: "True", ObservedGeneration: 4,
			LastTransitionTime: timestamppb.New(time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC))}}}
	host := &controllerv1.Resource{Kind: &controllerv1.Resource_Host{Host: &typesv1.Host{
		Metadata: &typesv1.ObjectMeta{Name: "h1"}, Spec: &typesv1.HostSpec{BootMac: "52:54:00:00:00:01"}, Status: st}}}

	y, err := Marshal(host)
	require.NoError(t, err)
	if !strings.Contains(string(y), "\n  state: Provisioned\n") || strings.Contains(string(y), "HOST_STATE") {
		t.Errorf("Marshal(host) =\n%s\nwant status.state: Provisioned", y)
	}
	j, err := MarshalJSON(host)
	require.NoError(t, err)
	if !strings.Contains(string(j), `"state": "Provisioned"`) || strings.Contains(string(j), "HOST_STATE") {
		t.Errorf("MarshalJSON(host) =\n%s\nwant \"state\": \"Provisioned\"", j)
	}
	var any map[string]any
	require.NoError(t, json.Unmarshal(j, &any), "MarshalJSON output is JSON")

	sy, err := MarshalMessage(st)
	require.NoError(t, err)
	for name, text := range map[string]string{
		"yaml":       string(sy),
		"proto name": strings.Replace(string(sy), "Provisioned", "HOST_STATE_PROVISIONED", 1),
	} {
		got := &typesv1.HostStatus{}
		require.NoError(t, UnmarshalMessage("status.yaml", []byte(text), got), name)
		if !proto.Equal(got, st) {
			t.Errorf("UnmarshalMessage(%s) = %v, want %v", name, got, st)
		}
	}

	err = UnmarshalMessage("status.yaml", []byte("state: Cooked\n"), &typesv1.HostStatus{})
	want := `status.yaml:1: state: "Cooked" is not one of Registering, Inspecting, Available, Provisioning, Provisioned, Deprovisioning, Wiping, Error`
	if err == nil || err.Error() != want {
		t.Errorf("UnmarshalMessage(state: Cooked) = %v, want %s", err, want)
	}
}

// aliasHealthCheck is a HealthCheck whose unhealthyConditions are n
// aliases of one condition.
func aliasHealthCheck(n int) []byte {
	var b strings.Builder
	b.WriteString("apiVersion: kiln.dev/v1\nkind: HealthCheck\nmetadata:\n  name: hc\nspec:\n  cluster: c\n  unhealthyConditions: [&a {type: NodeReady, status: \"False\", timeout: 5m}")
	for range n {
		b.WriteString(", *a")
	}
	b.WriteString("]\n")
	return []byte(b.String())
}

// TestDecodeBoundsAliases is hole 6's alias attack: a few MB of YAML
// aliases used to expand into GBs of work in kilnctl. A document may
// reuse anchors, but its aliases may add at most aliasExtra values; past
// that it is refused at the line, without the expansion.
func TestDecodeBoundsAliases(t *testing.T) {
	docs, err := Decode("reuse.yaml", aliasHealthCheck(1000))
	require.NoError(t, err, "a document that reuses an anchor 1000 times")
	require.Len(t, docs, 1)

	bomb := aliasHealthCheck(300_000) // 1.2 MB; 2.1M values when expanded
	_, err = Decode("bomb.yaml", bomb)
	require.Error(t, err)
	require.Contains(t, err.Error(), "bomb.yaml:7")
	require.Contains(t, err.Error(), "aliases (*name) add more than 1000000 values")
	t.Logf("%d bytes: %v", len(bomb), err)

	var hc typesv1.HealthCheck
	err = UnmarshalMessage("bomb.yaml", bomb, &hc)
	require.Error(t, err)
	require.Contains(t, err.Error(), "aliases (*name) add more than")
}
