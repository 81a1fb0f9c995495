package cli

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/manifest"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

const examplesDir = "../../../../examples"

// kilnctl runs the CLI in process with the kilnconfig at config.
func kilnctl(t *testing.T, config string, args ...string) (string, error) {
	t.Helper()
	out, _, err := run(t, map[string]string{"KILNCONFIG": config, "HOME": t.TempDir()}, args...)
	return out, err
}

func mustKilnctl(t *testing.T, config string, args ...string) string {
	t.Helper()
	out, err := kilnctl(t, config, args...)
	require.NoError(t, err, "kilnctl %s", strings.Join(args, " "))
	return out
}

// TestEndToEnd drives kilnctl against a real controller (embedded etcd,
// gRPC over mTLS on loopback).
func TestEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	env := controllertest.Start(t)
	admin := env.AdminConfigPath

	// The first apply creates every example, in file order.
	wantCreated := []string{
		"cluster/prod-eu1", "controlplane/prod-eu1-cp", "machinedeployment/prod-eu1-workers", "healthcheck/prod-eu1-nodes",
		"host/edge-01", "host/rack1-02", "host/rack1-01", "image/debian12-k8s1.34.4-20261202",
		"cluster/lab", "controlplane/lab-cp", "machinedeployment/lab-workers",
	}
	lines := func(action string) string {
		var b strings.Builder
		for _, r := range wantCreated {
			b.WriteString(r + " " + action + "\n")
		}
		return b.String()
	}
	if got := mustKilnctl(t, admin, "apply", "-f", examplesDir); got != lines("created") {
		t.Fatalf("kilnctl apply -f examples/ =\n%s\nwant\n%s", got, lines("created"))
	}

	t.Run("second apply is unchanged", func(t *testing.T) {
		if got := mustKilnctl(t, admin, "apply", "-f", examplesDir); got != lines("unchanged") {
			t.Errorf("kilnctl apply -f examples/ (again) =\n%s\nwant\n%s", got, lines("unchanged"))
		}
	})

	t.Run("get -o yaml prints what was applied", func(t *testing.T) {
		applied, err := validation.LoadManifests(nil, filepath.Join(examplesDir, "host-redfish.yaml"))
		require.NoError(t, err)
		out := mustKilnctl(t, admin, "get", "host", "rack1-01", "-o", "yaml")
		if strings.Contains(out, "change-me") || strings.Contains(out, "password:") {
			t.Errorf("kilnctl get host rack1-01 -o yaml shows the BMC password:\n%s", out)
		}
		got, err := manifest.Decode("get.yaml", []byte(out))
		require.NoError(t, err, "output:\n%s", out)
		require.Len(t, got, 1)
		wantSpec := proto.Clone(applied[0].Resource.GetHost().GetSpec()).(*typesv1.HostSpec)
		wantSpec.Bmc.Password = ""
		wantSpec.Bmc.PasswordSet = true
		if !proto.Equal(got[0].Resource.GetHost().GetSpec(), wantSpec) {
			t.Errorf("kilnctl get host rack1-01 -o yaml spec = %v, want %v", got[0].Resource.GetHost().GetSpec(), wantSpec)
		}
		for _, want := range []string{"apiVersion: kiln.dev/v1\nkind: Host\nmetadata:\n  name: rack1-01\n", "resourceVersion:", "passwordSet: true"} {
			if !strings.Contains(out, want) {
				t.Errorf("kilnctl get host rack1-01 -o yaml =\n%s\nwant it to contain %q", out, want)
			}
		}

		// What get prints applies again and changes nothing.
		p := filepath.Join(t.TempDir(), "rack1-01.yaml")
		require.NoError(t, os.WriteFile(p, []byte(out), 0o600))
		if got := mustKilnctl(t, admin, "apply", "-f", p); got != "host/rack1-01 unchanged\n" {
			t.Errorf("kilnctl apply -f <get -o yaml output> = %q, want unchanged", got)
		}

		// Once the object changed, the stale resourceVersion is refused.
		require.NoError(t, os.WriteFile(p, []byte(strings.Replace(out, "rootDiskHint: /dev/vda", "rootDiskHint: /dev/vdb", 1)), 0o600))
		if got := mustKilnctl(t, admin, "apply", "-f", p); got != "host/rack1-01 configured\n" {
			t.Errorf("kilnctl apply -f <edited get output> = %q, want configured", got)
		}
		_, err = kilnctl(t, admin, "apply", "-f", p)
		if !errdefs.IsConflict(err) || !strings.Contains(err.Error(), "hint: the file names a metadata.resourceVersion") {
			t.Errorf("kilnctl apply -f <stale get output> = %v, want Conflict with a hint", err)
		}
		mustKilnctl(t, admin, "apply", "-f", filepath.Join(examplesDir, "host-redfish.yaml"))

		// JSON of one object, and of a list.
		js := mustKilnctl(t, admin, "get", "cp", "lab-cp", "-o", "json")
		if !strings.Contains(js, `"kind": "ControlPlane"`) || !strings.Contains(js, `"replicas": 1`) {
			t.Errorf("kilnctl get cp lab-cp -o json =\n%s", js)
		}
		js = mustKilnctl(t, admin, "get", "clusters", "-o", "json")
		if !strings.HasPrefix(js, "{\n  \"items\": [") || strings.Count(js, `"kind": "Cluster"`) != 2 {
			t.Errorf("kilnctl get clusters -o json =\n%s", js)
		}
	})

	t.Run("get tables and selectors", func(t *testing.T) {
		out := mustKilnctl(t, admin, "get", "hosts")
		rows := strings.Split(strings.TrimSpace(out), "\n")
		if len(rows) != 4 || !strings.HasPrefix(rows[0], "NAME ") || !strings.HasPrefix(rows[1], "edge-01 ") || !strings.HasPrefix(rows[3], "rack1-02 ") {
			t.Errorf("kilnctl get hosts =\n%s\nwant a header and edge-01, rack1-01, rack1-02", out)
		}
		out = mustKilnctl(t, admin, "get", "hosts", "-l", "rack=rack1", "-o", "name")
		if out != "host/rack1-01\nhost/rack1-02\n" {
			t.Errorf("kilnctl get hosts -l rack=rack1 -o name = %q, want the two rack1 hosts", out)
		}
		out = mustKilnctl(t, admin, "get", "md", "-o", "wide")
		if !strings.Contains(out, "RollingUpdate(surge=0,unavailable=1)") || !strings.Contains(out, "prod-eu1-workers") {
			t.Errorf("kilnctl get md -o wide =\n%s", out)
		}
		_, err := kilnctl(t, admin, "get", "host", "nope")
		if !errdefs.IsNotFound(err) || !strings.HasPrefix(err.Error(), "get host/nope: ") {
			t.Errorf("kilnctl get host nope = %v, want NotFound starting with get host/nope", err)
		}
	})

	t.Run("shell completion of names", func(t *testing.T) {
		out := mustKilnctl(t, admin, "__complete", "describe", "cp", "")
		if !strings.HasPrefix(out, "lab-cp\nprod-eu1-cp\n:4\n") {
			t.Errorf("kilnctl __complete describe cp '' = %q, want the control plane names", out)
		}
		out = mustKilnctl(t, admin, "__complete", "get", "")
		if !strings.HasPrefix(out, "hosts\nimages\nclusters\ncontrolplanes\n") {
			t.Errorf("kilnctl __complete get '' = %q, want the kinds", out)
		}
	})

	t.Run("dry run stores nothing", func(t *testing.T) {
		p := filepath.Join(t.TempDir(), "cp.yaml")
		require.NoError(t, os.WriteFile(p, []byte("apiVersion: kiln.dev/v1\nkind: ControlPlane\nmetadata:\n  name: lab-cp\nspec:\n  cluster: lab\n  replicas: 3\n  version: v1.34.4\n"), 0o644))
		if got := mustKilnctl(t, admin, "apply", "--dry-run", "-f", p); got != "controlplane/lab-cp configured (dry run)\n" {
			t.Errorf("kilnctl apply --dry-run = %q, want configured (dry run)", got)
		}
		out := mustKilnctl(t, admin, "get", "cp", "lab-cp", "-o", "yaml")
		if !strings.Contains(out, "  replicas: 1\n") {
			t.Errorf("after a dry run, kilnctl get cp lab-cp -o yaml =\n%s\nwant replicas still 1", out)
		}
	})

	t.Run("a bad file in a directory applies nothing", func(t *testing.T) {
		dir := t.TempDir()
		require.NoError(t, os.WriteFile(filepath.Join(dir, "a-host.yaml"), []byte("apiVersion: kiln.dev/v1\nkind: Host\nmetadata:\n  name: rack2-01\nspec:\n  bmc:\n    protocol: none\n"), 0o644))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "b-cp.yaml"), []byte("apiVersion: kiln.dev/v1\nkind: ControlPlane\nmetadata:\n  name: cp2\nspec:\n  cluster: lab\n  replicas: 2\n"), 0o644))
		_, err := kilnctl(t, admin, "apply", "-f", dir)
		want := "nothing applied; fix these and apply again:\n" + filepath.Join(dir, "b-cp.yaml") +
			":7: spec.replicas: 2 is even: an even number of control-plane members cannot keep etcd quorum better than one less: use 1, 3 or 5"
		if err == nil || err.Error() != want {
			t.Errorf("kilnctl apply -f dir-with-bad-file = %v, want %q", err, want)
		}
		if _, err := kilnctl(t, admin, "get", "host", "rack2-01"); !errdefs.IsNotFound(err) {
			t.Errorf("kilnctl get host rack2-01 after a refused apply = %v, want NotFound", err)
		}
	})

	t.Run("the controller refuses a version skip", func(t *testing.T) {
		p := filepath.Join(t.TempDir(), "cp.yaml")
		require.NoError(t, os.WriteFile(p, []byte("apiVersion: kiln.dev/v1\nkind: ControlPlane\nmetadata:\n  name: lab-cp\nspec:\n  cluster: lab\n  replicas: 1\n  version: v1.36.0\n"), 0o644))
		_, err := kilnctl(t, admin, "apply", "-f", p)
		if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "spec.version: v1.34 -> v1.36 skips v1.35; upgrade one minor at a time") {
			t.Errorf("kilnctl apply (v1.34 -> v1.36) = %v, want the skip refused", err)
		}
	})

	t.Run("a reader cannot apply", func(t *testing.T) {
		reader := env.ConfigFor(t, "reader", "alice")
		_, err := kilnctl(t, reader, "apply", "-f", filepath.Join(examplesDir, "host-byoh.yaml"))
		if !errdefs.IsPermissionDenied(err) {
			t.Fatalf("kilnctl apply as reader = %v, want PermissionDenied", err)
		}
		for _, want := range []string{"apply: ", "reader", "alice", "hint: kilnconfig " + reader + ` holds a reader certificate for "alice"; changes need an operator or admin certificate`} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("kilnctl apply as reader = %q, want it to contain %q", err, want)
			}
		}
		// Reading is allowed.
		if out := mustKilnctl(t, reader, "get", "hosts", "-o", "name"); !strings.Contains(out, "host/rack1-01") {
			t.Errorf("kilnctl get hosts as reader = %q, want the hosts", out)
		}
		if _, err := kilnctl(t, reader, "delete", "host", "rack1-01"); !errdefs.IsPermissionDenied(err) {
			t.Errorf("kilnctl delete as reader = %v, want PermissionDenied", err)
		}
		// An operator may apply.
		operator := env.ConfigFor(t, "operator", "bob")
		if out := mustKilnctl(t, operator, "apply", "-f", filepath.Join(examplesDir, "host-byoh.yaml")); out != "host/edge-01 unchanged\n" {
			t.Errorf("kilnctl apply as operator = %q, want unchanged", out)
		}
	})

	t.Run("describe shows conditions and events", func(t *testing.T) {
		// Give the host a condition the way a reconciler would.
		ctx := context.Background()
		h := &typesv1.Host{}
		rev, err := env.Store().Get(ctx, "hosts", "rack1-01", h)
		require.NoError(t, err)
		if h.Status == nil {
			h.Status = &typesv1.HostStatus{}
		}
		h.Status.State = typesv1.HostState_HOST_STATE_REGISTERING
		h.Status.Conditions = append(h.Status.Conditions, &typesv1.Condition{
			Type: "BMCReachable", Status: "False", Reason: "ConnectionRefused",
			Message: "dial tcp 127.0.0.1:8001: connect: connection refused", LastTransitionTime: timestamppb.Now(),
		})
		_, err = env.Store().Update(ctx, "hosts", "rack1-01", h, rev)
		require.NoError(t, err)

		out := mustKilnctl(t, admin, "describe", "host", "rack1-01")
		for _, want := range []string{
			"Name:", "rack1-01", "Labels:", "class=worker,rack=rack1,region=eu1",
			"Spec:\n  bmc:\n    protocol: redfish\n",
			"Status:\n  state: Registering\n",
			"Conditions:\n  TYPE", "REASON", "MESSAGE",
			"BMCReachable", "ConnectionRefused", "dial tcp 127.0.0.1:8001: connect: connection refused",
			"Events:\n  LAST SEEN", "Applied", "Host created",
		} {
			if !strings.Contains(out, want) {
				t.Errorf("kilnctl describe host rack1-01 =\n%s\nwant it to contain %q", out, want)
			}
		}
		if strings.Contains(out, "change-me") {
			t.Errorf("kilnctl describe host rack1-01 shows the password:\n%s", out)
		}
		if got := mustKilnctl(t, admin, "get", "host", "rack1-01", "-o", "yaml"); !strings.Contains(got, "status:\n  state: Registering\n  conditions:\n    - type: BMCReachable\n") {
			t.Errorf("kilnctl get host rack1-01 -o yaml =\n%s\nwant the status with its condition", got)
		}
		// Both outputs use the table's word for the state and apply
		// again unchanged, status and all.
		js := mustKilnctl(t, admin, "get", "host", "rack1-01", "-o", "json")
		if !strings.Contains(js, `"state": "Registering"`) || strings.Contains(js, "HOST_STATE") {
			t.Errorf("kilnctl get host rack1-01 -o json =\n%s\nwant \"state\": \"Registering\"", js)
		}
		p := filepath.Join(t.TempDir(), "rack1-01.json")
		require.NoError(t, os.WriteFile(p, []byte(js), 0o600))
		if got := mustKilnctl(t, admin, "apply", "-f", p); got != "host/rack1-01 unchanged\n" {
			t.Errorf("kilnctl apply -f <get -o json output> = %q, want unchanged", got)
		}
		if got := mustKilnctl(t, admin, "get", "hosts", "rack1-01"); !strings.Contains(got, "Registering") {
			t.Errorf("kilnctl get hosts rack1-01 = %q, want STATE Registering", got)
		}
	})

	t.Run("get events", func(t *testing.T) {
		// Every applied object has its "Applied" event; the fleet's
		// newest come last, and one object's are its own.
		out := mustKilnctl(t, admin, "get", "events")
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if len(lines) < 3 || !strings.HasPrefix(lines[0], "LAST SEEN") || !strings.Contains(lines[0], "OBJECT") ||
			!strings.Contains(out, "host/rack1-01") || !strings.Contains(out, "Applied") {
			t.Errorf("kilnctl get events =\n%s\nwant a table with host/rack1-01's Applied event", out)
		}
		out = mustKilnctl(t, admin, "get", "events", "host/rack1-01", "--limit", "1")
		if lines := strings.Split(strings.TrimSpace(out), "\n"); len(lines) != 2 || !strings.Contains(lines[1], "host/rack1-01") {
			t.Errorf("kilnctl get events host/rack1-01 --limit 1 =\n%s\nwant one event of host/rack1-01", out)
		}
		if got := mustKilnctl(t, admin, "get", "events", "host/rack1-01"); !strings.Contains(got, "host/rack1-01") || strings.Contains(got, "host/rack1-02") {
			t.Errorf("kilnctl get events host/rack1-01 =\n%s\nwant only rack1-01's events", got)
		}
		if got := mustKilnctl(t, admin, "get", "events", "hosts"); !strings.Contains(got, "host/rack1-02") || strings.Contains(got, "image/") {
			t.Errorf("kilnctl get events hosts =\n%s\nwant the hosts' events and no image's", got)
		}
		if _, err := kilnctl(t, admin, "get", "events", "nosuchkind"); err == nil || !strings.Contains(err.Error(), "unknown kind") {
			t.Errorf("kilnctl get events nosuchkind: err = %v, want unknown kind", err)
		}
		if _, err := kilnctl(t, admin, "get", "events", "--limit", "0"); err == nil || !strings.Contains(err.Error(), "--limit 0") {
			t.Errorf("kilnctl get events --limit 0: err = %v, want it refused", err)
		}
	})

	t.Run("delete", func(t *testing.T) {
		if got := mustKilnctl(t, admin, "delete", "host", "edge-01"); got != "host/edge-01 deleted\n" {
			t.Errorf("kilnctl delete host edge-01 = %q", got)
		}
		if _, err := kilnctl(t, admin, "get", "host", "edge-01"); !errdefs.IsNotFound(err) {
			t.Errorf("kilnctl get host edge-01 after delete = %v, want NotFound", err)
		}
		_, err := kilnctl(t, admin, "delete", "host", "edge-01")
		if !errdefs.IsNotFound(err) || !strings.HasPrefix(err.Error(), "delete host/edge-01: ") {
			t.Errorf("kilnctl delete host edge-01 (again) = %v, want NotFound", err)
		}
	})

	t.Run("token create", func(t *testing.T) {
		out := mustKilnctl(t, admin, "token", "create", "--ttl", "30m", "--host", "edge-01")
		re := regexp.MustCompile(`(?m)^  kiln-agent enroll --controller (\S+) --token (\S+) --ca-hash (\S+) --host edge-01$`)
		m := re.FindStringSubmatch(out)
		if m == nil {
			t.Fatalf("kilnctl token create =\n%s\nwant a kiln-agent enroll line", out)
		}
		if m[1] != env.Addr || m[3] != env.CAHash || !strings.Contains(out, "Token: "+m[2]+"\n") {
			t.Errorf("kilnctl token create = %q, want controller %s and CA hash %s", out, env.Addr, env.CAHash)
		}
		q := mustKilnctl(t, admin, "token", "create", "-q")
		if strings.Count(q, "\n") != 1 || strings.Contains(q, " ") || q == m[2]+"\n" {
			t.Errorf("kilnctl token create -q = %q, want one new token", q)
		}
	})

	t.Run("watch", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var out syncBuffer
		done := make(chan error, 1)
		go func() {
			opts := Options{Stdout: &out, Stderr: &out, Stdin: strings.NewReader(""),
				Getenv: func(k string) string { return map[string]string{"KILNCONFIG": admin}[k] }}
			done <- Run(ctx, opts, []string{"watch", "hosts"})
		}()
		// The watch starts at "now": change the host until the watch has
		// seen a change (the first change may precede the watch).
		p := filepath.Join(t.TempDir(), "h.yaml")
		deadline := time.Now().Add(60 * time.Second)
		for i := 0; !strings.Contains(out.String(), "rack3-01"); i++ {
			if time.Now().After(deadline) {
				t.Fatalf("kilnctl watch hosts printed %q, want a row for rack3-01", out.String())
			}
			require.NoError(t, os.WriteFile(p, []byte(fmt.Sprintf("apiVersion: kiln.dev/v1\nkind: Host\nmetadata:\n  name: rack3-01\n  labels: {try: %q}\nspec:\n  bmc: {protocol: none}\n", fmt.Sprint(i))), 0o644))
			mustKilnctl(t, admin, "apply", "-f", p)
			time.Sleep(100 * time.Millisecond)
		}
		cancel()
		require.NoError(t, <-done)
		got := out.String()
		if !strings.HasPrefix(got, "EVENT ") || !regexp.MustCompile(`(?m)^(ADDED|MODIFIED)\s+rack3-01\s`).MatchString(got) {
			t.Errorf("kilnctl watch hosts =\n%s\nwant a header and an ADDED or MODIFIED row for rack3-01", got)
		}
	})
}

// TestGetWatchShowsLayProgress: kilnctl get hosts -w lists the hosts,
// then prints a host's row again when the controller stores its lay's
// progress (controller/provision's TestLayProgressStored stores it from a
// real agent lay), and describe host shows it in words.
func TestGetWatchShowsLayProgress(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	env := controllertest.Start(t)
	admin := env.AdminConfigPath
	p := filepath.Join(t.TempDir(), "h.yaml")
	require.NoError(t, os.WriteFile(p, []byte("apiVersion: kiln.dev/v1\nkind: Host\nmetadata:\n  name: rack4-01\nspec:\n  bmc: {protocol: none}\n"), 0o644))
	mustKilnctl(t, admin, "apply", "-f", p)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out syncBuffer
	done := make(chan error, 1)
	go func() {
		opts := Options{Stdout: &out, Stderr: &out, Stdin: strings.NewReader(""),
			Getenv: func(k string) string { return map[string]string{"KILNCONFIG": admin}[k] }}
		done <- Run(ctx, opts, []string{"get", "hosts", "-w"})
	}()
	require.Eventually(t, func() bool { return strings.Contains(out.String(), "rack4-01") }, 30*time.Second, 20*time.Millisecond,
		"kilnctl get hosts -w lists rack4-01 first")

	now := time.Now()
	for range 10 {
		h := &typesv1.Host{}
		rev, err := env.Store().Get(ctx, "hosts", "rack4-01", h)
		require.NoError(t, err)
		h.Status = &typesv1.HostStatus{State: typesv1.HostState_HOST_STATE_PROVISIONING, ProvisioningStep: "LayImage",
			LastOperation: &typesv1.OperationStatus{Id: "rack4-01-LayImage-0", Kind: "LayImage", State: "Running", Started: timestamppb.New(now.Add(-15 * time.Second)),
				Percent: 41.4, Progress: &typesv1.OperationProgress{Step: "fetch", DoneBytes: 1288490189, TotalBytes: 3113851290, Percent: 41.4,
					BytesPerSecond: 85.3 * (1 << 20), EtaSeconds: 20.4, Updated: timestamppb.New(now)}}}
		if _, err = env.Store().Update(ctx, "hosts", "rack4-01", h, rev); !errdefs.IsConflict(err) {
			require.NoError(t, err)
			break
		}
	}
	row := regexp.MustCompile(`(?m)^rack4-01\s+Provisioning\s.*\sfetch 41% 85\.3 MiB/s ETA 21s\s`)
	require.Eventually(t, func() bool { return row.MatchString(out.String()) }, 30*time.Second, 20*time.Millisecond,
		"kilnctl get hosts -w prints the row again with its PROGRESS")
	cancel()
	require.NoError(t, <-done)
	got := out.String()
	t.Logf("kilnctl get hosts -w:\n%s", got)
	if !strings.HasPrefix(got, "NAME ") || !strings.Contains(strings.SplitN(got, "\n", 2)[0], "PROGRESS") {
		t.Errorf("kilnctl get hosts -w =\n%s\nwant a header with PROGRESS first", got)
	}

	desc := mustKilnctl(t, admin, "describe", "host", "rack4-01")
	want := "Progress:\n  LayImage rack4-01-LayImage-0 (Running): fetch: 1.2 GiB of 2.9 GiB (41%), 85.3 MiB/s, ETA 21s"
	if !strings.Contains(desc, want) {
		t.Errorf("kilnctl describe host rack4-01 =\n%s\nwant it to contain\n%s", desc, want)
	}
}

// syncBuffer is a bytes.Buffer safe for one writer and one reader.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
