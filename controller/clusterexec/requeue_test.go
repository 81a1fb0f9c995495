package clusterexec_test

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/utils/clock"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kilnhq/kiln/controller/clusterexec"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// timerClock is a fake clock that reports the duration of every timer
// made on it: the work queue makes one for its earliest waiting item each
// time it has looked at the time, so a timer of d after a step says the
// queue saw that time and holds the item d longer.
type timerClock struct {
	*clocktesting.FakeClock
	timers chan time.Duration
}

func (c *timerClock) NewTimer(d time.Duration) clock.Timer {
	select {
	case c.timers <- d:
	default:
	}
	return c.FakeClock.NewTimer(d)
}

// waitTimer waits until the queue arms a timer of d.
func (c *timerClock) waitTimer(t *testing.T, d time.Duration) {
	t.Helper()
	bound := time.After(30 * time.Second) // only stops a hung test
	for {
		select {
		case got := <-c.timers:
			if got == d {
				return
			}
		case <-bound:
			t.Fatalf("the work queue never armed a timer of %s", d)
		}
	}
}

// reconciles records when (on the fake clock) each cluster reconcile ran.
type reconciles struct {
	mu  sync.Mutex
	now func() time.Time
	at  []time.Time
}

func (r *reconciles) ObserveOperationOutcome(string, string, time.Duration) {}
func (r *reconciles) ObserveReconcile(string, error, time.Duration, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.at = append(r.at, r.now())
}
func (r *reconciles) times() []time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]time.Time(nil), r.at...)
}

// TestPlannerRequeueReconcilesThen: a HealthCheck with nodeStartupTimeout
// 10m over a machine whose host is still being laid asks (Requeue) to be
// planned again when the 10 minutes are up. With the executor's pass
// interval an hour away, the cluster is reconciled again exactly then, on
// the injected clock, and not a second before; that reconcile remediates
// the machine.
func TestPlannerRequeueReconcilesThen(t *testing.T) {
	w := newWorld(t, 0)
	t0 := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	clk := &timerClock{FakeClock: clocktesting.NewFakeClock(t0), timers: make(chan time.Duration, 1000)}
	meta := func(name string) *typesv1.ObjectMeta {
		return &typesv1.ObjectMeta{Name: name, Generation: 1, CreationTimestamp: timestamppb.New(t0), Uid: "uid-" + name}
	}
	w.create("clusters", "c1", &typesv1.Cluster{Metadata: meta("c1"), Spec: &typesv1.ClusterSpec{KubernetesVersion: "v1.34.4"}})
	w.create("hosts", "h1", &typesv1.Host{Metadata: meta("h1"), Spec: &typesv1.HostSpec{Online: true},
		Status: &typesv1.HostStatus{State: typesv1.HostState_HOST_STATE_PROVISIONING, ProvisioningStep: "LayImage", Machine: "m1"}})
	m := meta("m1")
	m.Labels = map[string]string{"cluster": "c1", "role": "worker"}
	m.Annotations = map[string]string{clusterexec.AnnotationClusterUID: "uid-c1"}
	w.create("machines", "m1", &typesv1.Machine{Metadata: m,
		Spec: &typesv1.MachineSpec{Cluster: "c1", Role: "worker", Host: "h1", Version: "v1.34.4"}, Status: &typesv1.MachineStatus{}})
	w.create("healthchecks", "hc", &typesv1.HealthCheck{Metadata: meta("hc"),
		Spec: &typesv1.HealthCheckSpec{Cluster: "c1", Selector: map[string]string{"cluster": "c1"}, NodeStartupTimeout: "10m"}})

	obs := &reconciles{now: clk.Now}
	ex := clusterexec.New(clusterexec.Deps{Store: w.st, Recorder: w.rec, Agents: clusterexec.AgentDialer(w.kubeadm.AgentDialer()), Observer: obs},
		clusterexec.Config{Interval: time.Hour, Clock: clk.Now, QueueClock: clk}, slog.New(slog.NewTextHandler(testWriter{t}, nil)))
	runCtx, stop := context.WithCancel(w.ctx)
	done := make(chan struct{})
	go func() { _ = ex.Run(runCtx); close(done) }()
	defer func() { stop(); <-done }()

	// The first pass: the machine has no node; the HealthCheck asks to be
	// planned again in 10m, and the queue holds the cluster that long.
	clk.waitTimer(t, 10*time.Minute)
	require.Equal(t, []time.Time{t0}, obs.times(), "reconciles before the requeue")

	clk.Step(10*time.Minute - time.Second)
	clk.waitTimer(t, time.Second) // the queue saw t0+9m59s and still holds c1
	require.Equal(t, []time.Time{t0}, obs.times(), "reconciles at t0+9m59s, before the requeue is due")
	_, err := w.st.Get(w.ctx, "machines", "m1", &typesv1.Machine{})
	require.NoError(t, err, "machine m1 remediated before its nodeStartupTimeout")

	clk.Step(time.Second)
	require.Eventually(t, func() bool { return len(obs.times()) >= 2 }, 30*time.Second, 10*time.Millisecond, "no reconcile when the requeue was due")
	require.Equal(t, t0.Add(10*time.Minute), obs.times()[1], "second reconcile")
	require.Eventually(t, func() bool {
		_, err := w.st.Get(w.ctx, "machines", "m1", &typesv1.Machine{})
		return errdefs.IsNotFound(err)
	}, 30*time.Second, 10*time.Millisecond, "machine m1 not remediated once its nodeStartupTimeout ran out")
	h := &typesv1.Host{}
	_, err = w.st.Get(w.ctx, "hosts", "h1", h)
	require.NoError(t, err)
	require.Empty(t, h.GetStatus().GetMachine(), "host h1 still bound to the remediated machine")
}
