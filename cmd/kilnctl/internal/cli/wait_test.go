package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/kilnconfig"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestParseWaitFor(t *testing.T) {
	tests := []struct{ in, cond, status string }{
		{"condition=Ready", "Ready", "True"},
		{"condition=Ready=True", "Ready", "True"},
		{"condition=Provisioned=false", "Provisioned", "False"},
		{"condition=BMCReachable=UNKNOWN", "BMCReachable", "Unknown"},
	}
	for _, tt := range tests {
		cond, status, err := parseWaitFor(tt.in)
		if err != nil || cond != tt.cond || status != tt.status {
			t.Errorf("parseWaitFor(%q) = %q, %q, %v, want %q, %q", tt.in, cond, status, err, tt.cond, tt.status)
		}
	}
	for _, bad := range []string{"", "Ready", "condition=", "condition==True", "condition=Ready=yes", "delete", "jsonpath={.status.phase}"} {
		if _, _, err := parseWaitFor(bad); !errdefs.IsInvalidArgument(err) {
			t.Errorf("parseWaitFor(%q) = %v, want InvalidArgument", bad, err)
		}
	}
}

// TestWaitRefusesBadArgumentsWithoutDialing: no kilnconfig exists, so
// each refusal must come before a dial.
func TestWaitRefusesBadArgumentsWithoutDialing(t *testing.T) {
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"wait", "host/h1", "--for", "Ready"}, `wait: --for "Ready": use --for condition=TYPE or --for condition=TYPE=STATUS (STATUS True, False or Unknown; default True), e.g. --for condition=Ready`},
		{[]string{"wait", "host/h1", "--for", "condition=Ready=Yes"}, `wait: --for "condition=Ready=Yes": status "Yes": use --for condition=TYPE`},
		{[]string{"wait", "host/h1"}, "wait: --for is required: use --for condition=TYPE"},
		{[]string{"wait", "h1", "--for", "condition=Ready"}, `wait: "h1": name the resource as KIND/NAME, e.g. cluster/lab or host/h1`},
		{[]string{"wait", "node/h1", "--for", "condition=Ready"}, `unknown kind "node"`},
		{[]string{"wait", "host/h1", "--for", "condition=Ready", "--timeout", "-1s"}, "wait: --timeout -1s: use a positive duration"},
	}
	for _, tt := range tests {
		_, _, err := run(t, nil, tt.args...)
		if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("kilnctl %s = %v, want InvalidArgument containing %q", strings.Join(tt.args, " "), err, tt.want)
		}
	}
}

// waitRun is a kilnctl wait running in the background.
type waitRun struct {
	stdout, stderr syncBuffer
	done           chan error
}

func startWait(t *testing.T, config string, args ...string) *waitRun {
	t.Helper()
	w := &waitRun{done: make(chan error, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		opts := Options{Stdout: &w.stdout, Stderr: &w.stderr, Stdin: strings.NewReader(""),
			Getenv: func(k string) string { return map[string]string{"KILNCONFIG": config}[k] }}
		w.done <- Run(ctx, opts, append([]string{"wait"}, args...))
	}()
	t.Cleanup(func() {
		cancel()
		<-w.done
	})
	return w
}

// result waits for the command to end; a wait that does not end within a
// minute is a failure.
func (w *waitRun) result(t *testing.T) error {
	t.Helper()
	select {
	case err := <-w.done:
		w.done <- err // for the cleanup
		return err
	case <-time.After(time.Minute):
		t.Fatalf("kilnctl wait still running after a minute; stderr:\n%s", w.stderr.String())
		return nil
	}
}

// waitFor polls until the command printed want on stderr or ended.
func (w *waitRun) waitForStderr(t *testing.T, want string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !strings.Contains(w.stderr.String(), want) {
		if time.Now().After(deadline) {
			t.Fatalf("kilnctl wait printed on stderr\n%s\nwant %q", w.stderr.String(), want)
		}
		select {
		case err := <-w.done:
			w.done <- err
			t.Fatalf("kilnctl wait ended (%v) before printing %q; stderr:\n%s", err, want, w.stderr.String())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// setHostCondition writes a condition into a host's status, as the host
// lifecycle would.
func setHostCondition(t *testing.T, env *controllertest.Env, host string, state typesv1.HostState, c *typesv1.Condition) {
	t.Helper()
	ctx := context.Background()
	for {
		h := &typesv1.Host{}
		rev, err := env.Store().Get(ctx, "hosts", host, h)
		require.NoError(t, err)
		if h.Status == nil {
			h.Status = &typesv1.HostStatus{}
		}
		h.Status.State = state
		c.LastTransitionTime = timestamppb.Now()
		replaced := false
		for i, old := range h.Status.Conditions {
			if old.GetType() == c.GetType() {
				h.Status.Conditions[i], replaced = c, true
			}
		}
		if !replaced {
			h.Status.Conditions = append(h.Status.Conditions, c)
		}
		_, err = env.Store().Update(ctx, "hosts", host, h, rev)
		if errdefs.IsConflict(err) {
			continue
		}
		require.NoError(t, err)
		return
	}
}

func TestWait(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	env := controllertest.Start(t)
	admin := env.AdminConfigPath
	p := filepath.Join(t.TempDir(), "hosts.yaml")
	var hosts strings.Builder
	for _, h := range []string{"h1", "h2", "h3"} {
		hosts.WriteString("---\napiVersion: kiln.dev/v1\nkind: Host\nmetadata:\n  name: " + h + "\nspec:\n  bmc: {protocol: none}\n")
	}
	require.NoError(t, os.WriteFile(p, []byte(hosts.String()), 0o644))
	mustKilnctl(t, admin, "apply", "-f", p)

	t.Run("a condition set later releases the wait", func(t *testing.T) {
		reader := env.ConfigFor(t, "reader", "alice") // waiting needs no more than reading
		w := startWait(t, reader, "host/h1", "--for", "condition=Provisioned", "--timeout", "2m")
		w.waitForStderr(t, "host/h1: state -; no conditions\n")
		setHostCondition(t, env, "h1", typesv1.HostState_HOST_STATE_PROVISIONING,
			&typesv1.Condition{Type: "Provisioned", Status: "False", Reason: "Laying", Message: "writing the image: 40%"})
		w.waitForStderr(t, "host/h1: state Provisioning; Provisioned=False (Laying)\n")
		setHostCondition(t, env, "h1", typesv1.HostState_HOST_STATE_PROVISIONED,
			&typesv1.Condition{Type: "Provisioned", Status: "True", Reason: "ImageLaid"})
		require.NoError(t, w.result(t), "stderr:\n%s", w.stderr.String())
		if got := w.stdout.String(); got != "host/h1 condition Provisioned=True met\n" {
			t.Errorf("kilnctl wait host/h1 printed %q, want %q", got, "host/h1 condition Provisioned=True met\n")
		}
	})

	t.Run("a condition that already holds returns at once", func(t *testing.T) {
		out := mustKilnctl(t, admin, "wait", "HOST/h1", "--for", "condition=provisioned=true")
		if out != "host/h1 condition provisioned=True met\n" {
			t.Errorf("kilnctl wait (already true) = %q", out)
		}
	})

	t.Run("a timeout fails with the last conditions", func(t *testing.T) {
		setHostCondition(t, env, "h2", typesv1.HostState_HOST_STATE_REGISTERING,
			&typesv1.Condition{Type: "BMCReachable", Status: "False", Reason: "ConnectionRefused", Message: "dial tcp 127.0.0.1:8001: connect: connection refused"})
		_, err := kilnctl(t, admin, "wait", "host/h2", "--for", "condition=Provisioned", "--timeout", "1s")
		if err == nil || !errors.Is(err, errdefs.ErrDeadlineExceeded) {
			t.Fatalf("kilnctl wait host/h2 --timeout 1s = %v, want DeadlineExceeded", err)
		}
		want := "wait host/h2: timed out after 1s waiting for Provisioned=True; last state Registering; last conditions:\n" +
			"  BMCReachable=False ConnectionRefused: dial tcp 127.0.0.1:8001: connect: connection refused"
		if !strings.HasPrefix(err.Error(), want) {
			t.Errorf("kilnctl wait host/h2 --timeout 1s = %q, want it to start with %q", err, want)
		}
	})

	t.Run("deleting the resource ends the wait", func(t *testing.T) {
		w := startWait(t, admin, "host/h3", "--for", "condition=Provisioned", "--timeout", "2m")
		w.waitForStderr(t, "host/h3: ")
		mustKilnctl(t, admin, "delete", "host", "h3")
		err := w.result(t)
		if !errdefs.IsNotFound(err) || !strings.Contains(err.Error(), "wait host/h3: host h3 was deleted while waiting for Provisioned=True") {
			t.Errorf("kilnctl wait host/h3 (deleted) = %v, want NotFound saying it was deleted", err)
		}
	})

	t.Run("a timeout while the controller is unreachable says why", func(t *testing.T) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		closed := l.Addr().String()
		require.NoError(t, l.Close())
		cfg, err := kilnconfig.Load(admin)
		require.NoError(t, err)
		cfg.Server = closed
		p := filepath.Join(t.TempDir(), "down.yaml")
		require.NoError(t, kilnconfig.Write(p, cfg))
		_, err = kilnctl(t, p, "wait", "host/h1", "--for", "condition=Provisioned", "--timeout", "2s")
		if !errors.Is(err, errdefs.ErrDeadlineExceeded) || !strings.Contains(err.Error(), "wait host/h1: timed out after 2s waiting for Provisioned=True (") ||
			!strings.Contains(err.Error(), "connection refused") || !strings.Contains(err.Error(), "; the resource was never read") {
			t.Errorf("kilnctl wait (controller down) = %v, want a timeout naming the connection error", err)
		}
	})

	t.Run("an unknown resource", func(t *testing.T) {
		_, err := kilnctl(t, admin, "wait", "cluster/nope", "--for", "condition=Ready")
		if !errdefs.IsNotFound(err) || !strings.HasPrefix(err.Error(), "wait cluster/nope: ") {
			t.Errorf("kilnctl wait cluster/nope = %v, want NotFound", err)
		}
	})
}

// TestWaitSurvivesControllerRestart: the controller stops (its watches
// end with Unavailable) and starts again on the same address and data
// directory; the wait watches again and sees the condition set after.
func TestWaitSurvivesControllerRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd twice")
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	dir := t.TempDir()
	same := controllertest.WithConfig(func(c *controller.Config) { c.DataDir, c.ListenAddr = dir, addr })

	var w *waitRun
	var admin string
	outer := t
	t.Run("first controller", func(t *testing.T) {
		env := controllertest.Start(t, same)
		admin = env.AdminConfigPath
		p := filepath.Join(t.TempDir(), "h.yaml")
		require.NoError(t, os.WriteFile(p, []byte("apiVersion: kiln.dev/v1\nkind: Host\nmetadata:\n  name: h1\nspec:\n  bmc: {protocol: none}\n"), 0o644))
		mustKilnctl(t, admin, "apply", "-f", p)
		w = startWait(outer, admin, "host/h1", "--for", "condition=Provisioned", "--timeout", "5m")
		w.waitForStderr(t, "host/h1: state -; no conditions\n")
	}) // the controller stops here
	w.waitForStderr(t, "; watching again\n")

	env := controllertest.Start(t, same)
	setHostCondition(t, env, "h1", typesv1.HostState_HOST_STATE_PROVISIONED,
		&typesv1.Condition{Type: "Provisioned", Status: "True", Reason: "ImageLaid"})
	require.NoError(t, w.result(t), "stderr:\n%s", w.stderr.String())
	if got := w.stdout.String(); got != "host/h1 condition Provisioned=True met\n" {
		t.Errorf("kilnctl wait across a restart printed %q, want the condition met", got)
	}
	t.Logf("kilnctl wait across a restart, stderr:\n%s", w.stderr.String())
	// While the controller is down, wait says why once, not every retry.
	prev := ""
	for _, line := range strings.Split(w.stderr.String(), "\n") {
		if strings.HasSuffix(line, "watching again") && line == prev {
			t.Errorf("kilnctl wait repeated %q:\n%s", line, w.stderr.String())
		}
		prev = line
	}
}

// TestWaitStall: with --stall-timeout a wait whose resource (and, for a
// cluster, what it is made of) stops changing ends early, exit status 3,
// naming the blocking conditions; changes keep it waiting.
func TestWaitStall(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	env := controllertest.Start(t)
	admin := env.AdminConfigPath
	p := filepath.Join(t.TempDir(), "hosts.yaml")
	require.NoError(t, os.WriteFile(p, []byte("apiVersion: kiln.dev/v1\nkind: Host\nmetadata:\n  name: s1\nspec:\n  bmc: {protocol: none}\n"), 0o644))
	mustKilnctl(t, admin, "apply", "-f", p)
	setHostCondition(t, env, "s1", typesv1.HostState_HOST_STATE_REGISTERING,
		&typesv1.Condition{Type: "BMCReachable", Status: "False", Reason: "ConnectionRefused", Message: "dial tcp 127.0.0.1:8001: connect: connection refused"})

	t.Run("a host that does not change", func(t *testing.T) {
		start := time.Now()
		w := startWait(t, admin, "host/s1", "--for", "condition=Provisioned", "--timeout", "1m", "--stall-timeout", "1s")
		err := w.result(t)
		if !errors.Is(err, ErrStalled) || ExitCode(err) != 3 {
			t.Fatalf("kilnctl wait host/s1 --stall-timeout 1s = %v (exit %d), want ErrStalled (exit 3)", err, ExitCode(err))
		}
		if d := time.Since(start); d > 30*time.Second {
			t.Errorf("kilnctl wait --stall-timeout 1s took %v", d)
		}
		for _, want := range []string{
			"wait host/s1: nothing changed in host/s1 for 1s (since ",
			") while waiting for Provisioned=True; blocked by:\n  host/s1: BMCReachable=False ConnectionRefused: dial tcp 127.0.0.1:8001: connect: connection refused\n",
			"hint: kilnctl describe host s1 shows every condition and the recent events",
		} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("kilnctl wait host/s1 (stalled) =\n%v\nwant it to contain %q", err, want)
			}
		}
	})

	t.Run("changes keep it waiting", func(t *testing.T) {
		w := startWait(t, admin, "host", "s1", "--for", "condition=Provisioned", "--timeout", "1m", "--stall-timeout", "3s")
		w.waitForStderr(t, "host/s1: ")
		until := time.Now().Add(5 * time.Second)
		for i := 0; time.Now().Before(until); i++ {
			setHostCondition(t, env, "s1", typesv1.HostState_HOST_STATE_PROVISIONING,
				&typesv1.Condition{Type: "Provisioned", Status: "False", Reason: "Laying", Message: fmt.Sprintf("writing the image: %d%%", i)})
			select {
			case err := <-w.done:
				w.done <- err
				t.Fatalf("kilnctl wait ended while the host kept changing: %v", err)
			case <-time.After(500 * time.Millisecond):
			}
		}
		err := w.result(t)
		if !errors.Is(err, ErrStalled) || !strings.Contains(err.Error(), "host/s1: Provisioned=False Laying: writing the image: ") {
			t.Errorf("kilnctl wait host s1 after the changes stopped = %v, want stalled on Provisioned=False Laying", err)
		}
	})

	t.Run("a cluster and what it is made of", func(t *testing.T) {
		p := filepath.Join(t.TempDir(), "edge.yaml")
		require.NoError(t, os.WriteFile(p, []byte(`apiVersion: kiln.dev/v1
kind: Cluster
metadata:
  name: edge
spec:
  kubernetesVersion: v1.34.4
  podCidr: 10.244.0.0/16
---
apiVersion: kiln.dev/v1
kind: ControlPlane
metadata:
  name: edge-cp
spec:
  cluster: edge
  replicas: 1
  version: v1.34.4
  image: nope-20240101
  hostSelector: {site: nowhere}
`), 0o644))
		mustKilnctl(t, admin, "apply", "-f", p)
		w := startWait(t, admin, "cluster", "edge", "--for", "condition=Ready", "--timeout", "1m", "--stall-timeout", "2s")
		err := w.result(t)
		if !errors.Is(err, ErrStalled) || ExitCode(err) != 3 {
			t.Fatalf("kilnctl wait cluster edge --stall-timeout 2s = %v, want ErrStalled", err)
		}
		// This controller runs no cluster executor, so nothing reports on
		// the cluster: the stall says so for each object.
		for _, want := range []string{
			"wait cluster/edge: nothing changed in cluster/edge and the object it is made of for 2s",
			"blocked by:\n  cluster/edge: no conditions: nothing has reported on it\n  controlplane/edge-cp: no conditions: nothing has reported on it\n",
		} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("kilnctl wait cluster edge (stalled) =\n%v\nwant it to contain %q", err, want)
			}
		}
		t.Logf("kilnctl wait cluster edge (stalled):\n%v", err)
	})

	t.Run("a timeout is exit 1", func(t *testing.T) {
		_, err := kilnctl(t, admin, "wait", "host/s1", "--for", "condition=Provisioned", "--timeout", "1s", "--stall-timeout", "1h")
		if !errors.Is(err, errdefs.ErrDeadlineExceeded) || ExitCode(err) != 1 {
			t.Errorf("kilnctl wait --timeout 1s = %v (exit %d), want DeadlineExceeded, exit 1", err, ExitCode(err))
		}
	})
}
