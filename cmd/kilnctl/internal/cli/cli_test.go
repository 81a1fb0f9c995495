package cli

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/errdefs"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// run executes kilnctl in process and returns stdout, stderr and the error.
func run(t *testing.T, env map[string]string, args ...string) (string, string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	if env == nil {
		env = map[string]string{"HOME": t.TempDir()}
	}
	opts := Options{
		Stdin:  strings.NewReader(""),
		Stdout: &out, Stderr: &errOut,
		Getenv: func(k string) string { return env[k] },
		Now:    func() time.Time { return testNow },
	}
	err := Run(context.Background(), opts, args)
	return out.String(), errOut.String(), err
}

var testNow = time.Date(2026, 12, 2, 14, 0, 0, 0, time.UTC)

func TestLookupKind(t *testing.T) {
	tests := []struct{ in, want string }{
		{"host", "Host"}, {"hosts", "Host"}, {"Host", "Host"}, {"HOSTS", "Host"},
		{"cp", "ControlPlane"}, {"controlplane", "ControlPlane"}, {"controlplanes", "ControlPlane"},
		{"md", "MachineDeployment"}, {"machinedeployments", "MachineDeployment"},
		{"machine", "Machine"}, {"machines", "Machine"},
		{"hc", "HealthCheck"}, {"healthcheck", "HealthCheck"},
		{"image", "Image"}, {"images", "Image"}, {"cluster", "Cluster"},
	}
	for _, tt := range tests {
		k, err := lookupKind(tt.in)
		if err != nil || k.Name != tt.want {
			t.Errorf("lookupKind(%q) = %q, %v, want %q", tt.in, k.Name, err, tt.want)
		}
	}
	_, err := lookupKind("nodes")
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), `unknown kind "nodes": use one of hosts, images (img), clusters, controlplanes (cp)`) {
		t.Errorf("lookupKind(nodes) = %v, want an InvalidArgument listing the kinds", err)
	}
}

func TestParseSelector(t *testing.T) {
	got, err := parseSelector([]string{"rack=rack1,class=worker", "region==eu1"})
	require.NoError(t, err)
	want := map[string]string{"rack": "rack1", "class": "worker", "region": "eu1"}
	if len(got) != len(want) {
		t.Fatalf("parseSelector() = %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("parseSelector()[%q] = %q, want %q", k, got[k], v)
		}
	}
	for _, bad := range []string{"rack", "rack!=1", "=x"} {
		if _, err := parseSelector([]string{bad}); err == nil {
			t.Errorf("parseSelector(%q) = nil error, want InvalidArgument", bad)
		}
	}
}

func TestAge(t *testing.T) {
	tests := []struct {
		ago  time.Duration
		want string
	}{
		{5 * time.Second, "5s"}, {90 * time.Second, "90s"}, {5 * time.Minute, "5m"},
		{3 * time.Hour, "3h"}, {72 * time.Hour, "3d"}, {-time.Second, "0s"},
	}
	for _, tt := range tests {
		if got := age(timestamppb.New(testNow.Add(-tt.ago)), testNow); got != tt.want {
			t.Errorf("age(%v ago) = %q, want %q", tt.ago, got, tt.want)
		}
	}
	if got := age(nil, testNow); got != "-" {
		t.Errorf("age(nil) = %q, want -", got)
	}
}

func sampleHost() *controllerv1.Resource {
	return &controllerv1.Resource{Kind: &controllerv1.Resource_Host{Host: &typesv1.Host{
		Metadata: &typesv1.ObjectMeta{Name: "rack1-01", Labels: map[string]string{"rack": "rack1"}, Generation: 2,
			CreationTimestamp: timestamppb.New(testNow.Add(-5 * time.Minute))},
		Spec: &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "redfish", Address: "https://10.0.0.5", PasswordSet: true}},
		Status: &typesv1.HostStatus{State: typesv1.HostState_HOST_STATE_INSPECTING, Power: "on",
			Conditions: []*typesv1.Condition{{Type: "BMCReachable", Status: "False", Reason: "ConnectionRefused",
				Message: "dial tcp 10.0.0.5:443: connection refused", LastTransitionTime: timestamppb.New(testNow.Add(-30 * time.Second))}}},
	}}}
}

func TestTable(t *testing.T) {
	var buf bytes.Buffer
	k, _ := lookupKind("host")
	a := newApp(Options{Now: func() time.Time { return testNow }})
	require.NoError(t, a.print(&buf, &buf, k, []*controllerv1.Resource{sampleHost()}, "", false))
	want := "NAME       STATE        POWER   BMC       MACHINE   IMAGE   PROGRESS   REASON              AGE\n" +
		"rack1-01   Inspecting   on      redfish   -         -       -          ConnectionRefused   5m\n"
	if buf.String() != want {
		t.Errorf("get hosts =\n%s\nwant\n%s", buf.String(), want)
	}
	buf.Reset()
	require.NoError(t, a.print(&buf, &buf, k, []*controllerv1.Resource{sampleHost()}, "wide", false))
	if !strings.Contains(buf.String(), "ADDRESS") || !strings.Contains(buf.String(), "https://10.0.0.5") {
		t.Errorf("get hosts -o wide =\n%s\nwant the BMC address column", buf.String())
	}
	buf.Reset()
	require.NoError(t, a.print(&buf, &buf, k, nil, "", false))
	if buf.String() != "No hosts found.\n" {
		t.Errorf("get hosts (none) = %q, want \"No hosts found.\\n\"", buf.String())
	}
	// Every kind has columns.
	for _, kk := range kinds {
		if len(columns[kk.Name]) == 0 {
			t.Errorf("columns[%q] is empty", kk.Name)
		}
	}
}

// A stuck object says why in its table row: the reason of its most
// telling blocking condition, and with -o wide its message too.
func TestReasonColumn(t *testing.T) {
	a := newApp(Options{Now: func() time.Time { return testNow }})
	stuck := &typesv1.Condition{Type: "ImageResolved", Status: "False", Reason: "ImageNotFound", Severity: "Error",
		Message: "image debian12-k8s1.34.4-20261202 not found; kilnctl get images lists 1: debian12-k8s1.34.4-20261203"}
	notReady := &typesv1.Condition{Type: "Ready", Status: "False", Reason: "WaitingForHost"}
	machine := &controllerv1.Resource{Kind: &controllerv1.Resource_Machine{Machine: &typesv1.Machine{
		Metadata: &typesv1.ObjectMeta{Name: "lab-cp-x"},
		Spec:     &typesv1.MachineSpec{Cluster: "lab", Role: "control-plane"},
		Status:   &typesv1.MachineStatus{Phase: "Pending", Conditions: []*typesv1.Condition{notReady, stuck}},
	}}}
	cluster := &controllerv1.Resource{Kind: &controllerv1.Resource_Cluster{Cluster: &typesv1.Cluster{
		Metadata: &typesv1.ObjectMeta{Name: "lab"},
		Status:   &typesv1.ClusterStatus{Conditions: []*typesv1.Condition{notReady}},
	}}}
	failed := &controllerv1.Resource{Kind: &controllerv1.Resource_Host{Host: &typesv1.Host{
		Metadata: &typesv1.ObjectMeta{Name: "h2"},
		Status:   &typesv1.HostStatus{State: typesv1.HostState_HOST_STATE_ERROR, ErrorReason: "disk /dev/vda not found"},
	}}}
	healthy := &controllerv1.Resource{Kind: &controllerv1.Resource_Host{Host: &typesv1.Host{
		Metadata: &typesv1.ObjectMeta{Name: "h3"},
		Status: &typesv1.HostStatus{State: typesv1.HostState_HOST_STATE_AVAILABLE, Conditions: []*typesv1.Condition{
			{Type: "BMCReachable", Status: "True"}, {Type: "BootstrapFailed", Status: "False", Reason: "Bootstrapped"}}},
	}}}
	// A host in the admission line (docs/lifecycle.md, "Admission: hosts
	// in flight"), with the conditions the executor writes: the REASON
	// column names the line, not the healthy BMC. controller/sim's
	// TestWaitingHostsSayWhy checks the executor ranks it first.
	waiting := &controllerv1.Resource{Kind: &controllerv1.Resource_Host{Host: &typesv1.Host{
		Metadata: &typesv1.ObjectMeta{Name: "h4"},
		Status: &typesv1.HostStatus{State: typesv1.HostState_HOST_STATE_AVAILABLE, Machine: "lab-w-1", Conditions: []*typesv1.Condition{
			{Type: "BMCReachable", Status: "True"},
			{Type: "ProvisioningAdmitted", Status: "False", Reason: "WaitingForSlot",
				Message: "waiting for a provisioning slot (2000 in flight, limit 2000): hosts start as others finish or fail; kiln-controller run --provision-max-in-flight sets the limit"}}},
	}}}
	tests := []struct {
		kind   string
		r      *controllerv1.Resource
		output string
		want   string // the REASON cell
	}{
		{"host", waiting, "", "WaitingForSlot"},
		{"host", waiting, "wide", "WaitingForSlot: waiting for a provisioning slot (2000 in flight, limit 2000…"},
		{"machine", machine, "", "ImageNotFound"},
		{"machine", machine, "wide", "ImageNotFound: image debian12-k8s1.34.4-20261202 not found; kilnctl get im…"},
		{"host", failed, "", "Error"},
		{"host", failed, "wide", "Error: disk /dev/vda not found"},
		{"host", healthy, "", "-"},
		{"cluster", cluster, "wide", "WaitingForHost"},
	}
	for _, tt := range tests {
		k, _ := lookupKind(tt.kind)
		var buf bytes.Buffer
		require.NoError(t, a.print(&buf, &buf, k, []*controllerv1.Resource{tt.r}, tt.output, false))
		if got := tableCell(buf.String(), "REASON"); got != tt.want {
			t.Errorf("get %s -o %q REASON = %q, want %q\n%s", tt.kind, tt.output, got, tt.want, buf.String())
		}
	}
	// Without -o wide, only hosts and machines have the column.
	for _, kind := range []string{"cluster", "cp", "md", "hc"} {
		k, _ := lookupKind(kind)
		var buf bytes.Buffer
		require.NoError(t, a.print(&buf, &buf, k, []*controllerv1.Resource{cluster}, "", false))
		if strings.Contains(buf.String(), "REASON") {
			t.Errorf("get %s =\n%s\nwant no REASON column (only with -o wide)", kind, buf.String())
		}
		buf.Reset()
		require.NoError(t, a.print(&buf, &buf, k, []*controllerv1.Resource{cluster}, "wide", false))
		if !strings.Contains(buf.String(), "REASON") {
			t.Errorf("get %s -o wide =\n%s\nwant a REASON column", kind, buf.String())
		}
	}
}

// tableCell returns the cell under header in the first row of a table.
func tableCell(table, header string) string {
	lines := strings.Split(table, "\n")
	if len(lines) < 2 {
		return ""
	}
	head, row := []rune(lines[0]), []rune(lines[1])
	start := strings.Index(lines[0], header)
	if start < 0 {
		return ""
	}
	start = len([]rune(lines[0][:start]))
	end := len(row)
	// The next column starts where the header's next word does.
	for i := start + len(header); i < len(head); i++ {
		if head[i] != ' ' && head[i-1] == ' ' {
			end = min(i, len(row))
			break
		}
	}
	return strings.TrimSpace(string(row[start:end]))
}

func TestDescribeOutput(t *testing.T) {
	var buf bytes.Buffer
	k, _ := lookupKind("host")
	evs := []*typesv1.Event{
		{Time: timestamppb.New(testNow.Add(-20 * time.Second)), Type: "Warning", Reason: "BMCUnreachable", Message: "power on: connection refused"},
		// Aggregated: 4 times, first 10 minutes ago, last 1 minute ago,
		// after 2 were dropped by the rate limit.
		{Time: timestamppb.New(testNow.Add(-10 * time.Minute)), LastTime: timestamppb.New(testNow.Add(-time.Minute)), Count: 4, Dropped: 2,
			Type: "Warning", Reason: "StepTimedOut", Message: "PowerOn: no result within 3m"},
	}
	require.NoError(t, describeObject(&buf, k, sampleHost(), evs, testNow))
	got := buf.String()
	for _, want := range []string{
		"Name:       rack1-01\n",
		"Labels:     rack=rack1\n",
		"Created:    2026-12-02T13:55:00Z (5m ago)\n",
		"Spec:\n  bmc:\n    protocol: redfish\n    address: https://10.0.0.5\n    passwordSet: true\n",
		"Status:\n  state: Inspecting\n  power: \"on\"\n",
		"Conditions:\n  TYPE          STATUS  REASON             MESSAGE                                    AGE\n",
		"  BMCReachable  False   ConnectionRefused  dial tcp 10.0.0.5:443: connection refused  30s\n",
		"Events:\n" +
			"  LAST SEEN  TYPE     REASON          COUNT  FIRST SEEN  MESSAGE\n" +
			"  20s        Warning  BMCUnreachable  1      -           power on: connection refused\n" +
			"  60s        Warning  StepTimedOut    4      10m         PowerOn: no result within 3m (2 earlier events of this object dropped by the rate limit)\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("describe host =\n%s\nwant it to contain\n%s", got, want)
		}
	}
	if strings.Contains(got, "conditions:") {
		t.Errorf("describe host =\n%s\nwant conditions only in the table", got)
	}
}

func TestNoConfig(t *testing.T) {
	home := t.TempDir()
	_, _, err := run(t, map[string]string{"HOME": home}, "get", "hosts")
	want := "no kilnctl config: pass --kilnconfig or set KILNCONFIG; the controller writes DATA_DIR/kilnconfig-admin.yaml (looked for " + filepath.Join(home, ".kiln", "config") + ")"
	if err == nil || err.Error() != want {
		t.Errorf("kilnctl get hosts (no config) = %v, want %q", err, want)
	}
	_, _, err = run(t, nil, "--kilnconfig", "/nonexistent/kc.yaml", "get", "hosts")
	if err == nil || !errdefs.IsNotFound(err) || !strings.Contains(err.Error(), "no kilnctl config at /nonexistent/kc.yaml") {
		t.Errorf("kilnctl --kilnconfig missing get hosts = %v, want NotFound naming the file", err)
	}
}

func TestApplyRefusesBadFilesWithoutDialing(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "c.yaml")
	require.NoError(t, os.WriteFile(p, []byte("apiVersion: kiln.dev/v1\nkind: Cluster\nmetadata:\n  name: lab\nspec:\n  kubernetesVersion: v1.34.4\n  podCIDR: 10.244.0.0/16\n"), 0o644))
	// No config exists: the file error must come first, without a dial.
	_, _, err := run(t, nil, "apply", "-f", p)
	want := "nothing applied; fix these and apply again:\n" + p + ":7: spec.podCIDR: unknown field (did you mean podCidr?)"
	if err == nil || err.Error() != want {
		t.Errorf("kilnctl apply -f bad = %v, want %q", err, want)
	}
	if !errdefs.IsInvalidArgument(err) {
		t.Errorf("kilnctl apply -f bad = %v, want InvalidArgument", err)
	}
	_, _, err = run(t, nil, "apply")
	if err == nil || !strings.Contains(err.Error(), "pass -f FILE") {
		t.Errorf("kilnctl apply = %v, want a hint to pass -f", err)
	}
}

func TestVersionCompletionLab(t *testing.T) {
	out, _, err := run(t, nil, "version")
	require.NoError(t, err)
	if !strings.HasPrefix(out, "kilnctl ") {
		t.Errorf("kilnctl version = %q, want kilnctl <version> ...", out)
	}
	for _, sh := range []string{"bash", "zsh", "fish"} {
		out, _, err := run(t, nil, "completion", sh)
		if err != nil || !strings.Contains(out, "kilnctl") || len(out) < 500 {
			t.Errorf("kilnctl completion %s = %d bytes, %v, want a script", sh, len(out), err)
		}
	}
	_, _, err = run(t, nil, "completion", "tcsh")
	if err == nil {
		t.Errorf("kilnctl completion tcsh = nil error, want refusal")
	}
	_, _, err = run(t, nil, "lab", "up")
	if !errdefs.IsNotSupported(err) || !strings.Contains(err.Error(), "kilnctl lab: not built yet") {
		t.Errorf("kilnctl lab up = %v, want NotSupported not built yet", err)
	}
	_, _, err = run(t, nil, "get", "nodes")
	if err == nil || !strings.Contains(err.Error(), `unknown kind "nodes"`) {
		t.Errorf("kilnctl get nodes = %v, want unknown kind", err)
	}
	_, _, err = run(t, nil, "get", "hosts", "-o", "xml")
	if err == nil || !strings.Contains(err.Error(), `output format "xml"`) {
		t.Errorf("kilnctl get hosts -o xml = %v, want an output format error", err)
	}
}
