package rolloutexec_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/clusterexec"
	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/provision"
	"github.com/kilnhq/kiln/controller/rolloutexec"
	"github.com/kilnhq/kiln/controller/rolloutplan"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/seal"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// world is a real store (embedded etcd), a simulated fleet with
// simulated kubeadm, and the host lifecycle and cluster executors over
// them: the clusters really roll (machines created on spare hosts, old
// ones drained, removed from etcd and wiped), only the hosts are
// simulated.
type world struct {
	t   *testing.T
	ctx context.Context
	st  *store.Store
	rec *events.Recorder
}

func newWorld(t *testing.T) *world {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	e, err := store.StartEmbedded(ctx, store.EmbeddedConfig{DataDir: filepath.Join(t.TempDir(), "etcd")})
	require.NoError(t, err)
	t.Cleanup(e.Close)
	c, err := store.Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	sealer, err := seal.New(bytes.Repeat([]byte{7}, seal.KeySize))
	require.NoError(t, err)
	st := store.New(c, store.WithSealer(sealer))
	log := slog.New(slog.DiscardHandler)
	rec := events.New(c, time.Hour, nil, log)
	enr := enrollment.New(st, nil, rec, enrollment.Config{}, log)
	fleet := sim.NewFleet(ctx, sim.Config{
		BMCLatency: 2 * time.Millisecond, BootDelay: 30 * time.Millisecond, LayDuration: 80 * time.Millisecond,
		WipeDuration: 20 * time.Millisecond, HeartbeatInterval: 500 * time.Millisecond,
	}, sim.EnrollmentCheckIn(enr))
	kubeadm := sim.NewKubeadm(fleet, 0)
	life := provision.New(provision.Deps{Store: st, Recorder: rec, BMCs: fleet.BMCDialer(), Agents: kubeadm.AgentDialer()},
		provision.Config{
			Workers: 8,
			Plan: hostlife.Config{
				PollInterval: 100 * time.Millisecond,
				Backoff:      backoff.Policy{Base: 20 * time.Millisecond, Max: 200 * time.Millisecond, Factor: 2},
				MaxAttempts:  5,
			},
			ISOURL:         func(h string) string { return "http://boot.sim/boot/iso/" + h + ".iso" },
			ResyncInterval: time.Second,
		}, log)
	cx := clusterexec.New(clusterexec.Deps{Store: st, Recorder: rec, Agents: clusterexec.AgentDialer(kubeadm.AgentDialer())},
		clusterexec.Config{Interval: 100 * time.Millisecond}, log)
	lifeDone, cxDone := make(chan struct{}), make(chan struct{})
	go func() { _ = life.Run(ctx); close(lifeDone) }()
	go func() { _ = cx.Run(ctx); close(cxDone) }()
	t.Cleanup(func() { cancel(); <-lifeDone; <-cxDone })
	return &world{t: t, ctx: ctx, st: st, rec: rec}
}

// startRollouts runs a new rollout executor (as a new leader would) until
// the returned stop is called.
func (w *world) startRollouts() (stop func()) {
	ctx, cancel := context.WithCancel(w.ctx)
	rx := rolloutexec.New(rolloutexec.Deps{Store: w.st, Events: w.rec}, rolloutexec.Config{Interval: 100 * time.Millisecond},
		slog.New(slog.NewTextHandler(testWriter{w.t}, nil)))
	done := make(chan struct{})
	go func() { _ = rx.Run(ctx); close(done) }()
	return func() { cancel(); <-done }
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

func meta(name string) *typesv1.ObjectMeta {
	return &typesv1.ObjectMeta{Name: name, Generation: 1, CreationTimestamp: timestamppb.Now(), Uid: "uid-" + name}
}

func (w *world) create(kind, name string, m proto.Message) {
	w.t.Helper()
	_, err := w.st.Create(w.ctx, kind, name, m)
	require.NoError(w.t, err)
}

// image stores an Image named name (the simulated hosts lay any).
func (w *world) image(name string) {
	w.create("images", name, &typesv1.Image{Metadata: meta(name), Spec: &typesv1.ImageSpec{
		Url: "http://images.sim/" + name + ".raw.zst", Format: "raw.zst", Sha256: strings.Repeat("ab", 32), KubernetesVersion: "v1.34.4"}})
}

// cluster stores two hosts labelled pool=name (one for the control
// plane, one spare for its rollout) and a cluster of one control-plane
// machine (rolloutMaxSurge 1) in wave.
func (w *world) cluster(name, wave, image string) {
	for i := 1; i <= 2; i++ {
		h := fmt.Sprintf("%s-h%d", name, i)
		m := meta(h)
		m.Labels = map[string]string{"pool": name}
		w.create("hosts", h, &typesv1.Host{Metadata: m,
			Spec: &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "redfish", Address: "sim://" + h}, RootDiskHint: "/dev/sda", Online: true}})
	}
	cm := meta(name)
	cm.Labels = map[string]string{"env": "test", "upgrade-wave": wave}
	w.create("clusters", name, &typesv1.Cluster{Metadata: cm, Spec: &typesv1.ClusterSpec{
		KubernetesVersion: "v1.34.4", PodCidr: "10.244.0.0/16", ServiceCidr: "10.96.0.0/12", ControlPlaneEndpoint: "10.0.0.10:6443", DnsDomain: "cluster.local"}})
	w.create("controlplanes", name+"-cp", &typesv1.ControlPlane{Metadata: meta(name + "-cp"), Spec: &typesv1.ControlPlaneSpec{
		Cluster: name, Replicas: 1, Version: "v1.34.4", Image: image, HostSelector: map[string]string{"pool": name}, RolloutMaxSurge: 1}})
}

func (w *world) get(kind, name string, m proto.Message) proto.Message {
	w.t.Helper()
	_, err := w.st.Get(w.ctx, kind, name, m)
	require.NoError(w.t, err)
	return m
}

func (w *world) rollout() *typesv1.Rollout {
	return w.get("rollouts", "img2", &typesv1.Rollout{}).(*typesv1.Rollout)
}

// edit changes a stored object under compare-and-swap, as kubectl-style
// apply does.
func (w *world) edit(kind, name string, m proto.Message, change func()) {
	w.t.Helper()
	for {
		proto.Reset(m)
		rev, err := w.st.Get(w.ctx, kind, name, m)
		require.NoError(w.t, err)
		change()
		if _, err = w.st.Update(w.ctx, kind, name, m, rev); err == nil {
			return
		}
	}
}

func (w *world) ready(name string) bool {
	c := w.get("clusters", name, &typesv1.Cluster{}).(*typesv1.Cluster)
	return conditions.IsTrue(c.GetStatus().GetConditions(), "Ready")
}

// cpHost is the host of cluster's control-plane machine.
func (w *world) cpHost(cluster string) string {
	items, _, err := w.st.List(w.ctx, "machines", func() proto.Message { return &typesv1.Machine{} }, store.ListOptions{})
	require.NoError(w.t, err)
	var hosts []string
	for _, it := range items {
		m := it.Msg.(*typesv1.Machine)
		if m.GetSpec().GetCluster() == cluster && m.GetMetadata().GetDeletionTimestamp() == nil {
			hosts = append(hosts, m.GetSpec().GetHost())
		}
	}
	require.Len(w.t, hosts, 1, "machines of cluster %s", cluster)
	return hosts[0]
}

// waves is the status as kilnctl get rollouts shows it, one wave a line.
func waves(r *typesv1.Rollout) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s:", r.GetStatus().GetPhase())
	for _, wv := range r.GetStatus().GetWaves() {
		fmt.Fprintf(&b, " %s=%s", wv.GetValue(), wv.GetState())
	}
	return b.String()
}

// TestRolloutWaves carries an image change to three single-control-plane
// clusters in three waves over a real store and the real cluster
// executor (simulated hosts): wave 1 rolls, bakes, wave 2 starts; wave 2's
// cluster has no spare host (its pool's second host was taken away), so it
// is not done within readyTimeout and the rollout halts saying why, wave 3
// untouched. The rollout executor is replaced mid-way (a new leader)
// without moving anything twice. Once the host is back, resume completes
// the rollout: every control plane moved exactly once (generation 2) and
// runs the new image.
func TestRolloutWaves(t *testing.T) {
	w := newWorld(t)
	w.image("img1")
	w.image("img2")
	w.cluster("c1", "1", "img1")
	w.cluster("c2", "2", "img1")
	w.cluster("c3", "3", "img1")
	for _, c := range []string{"c1", "c2", "c3"} {
		require.Eventually(t, func() bool { return w.ready(c) }, 90*time.Second, 100*time.Millisecond, "cluster %s never Ready", c)
	}
	// The failure of wave 2: its spare host leaves the pool.
	var spare *typesv1.Host
	for _, h := range []string{"c2-h1", "c2-h2"} {
		x := w.get("hosts", h, &typesv1.Host{}).(*typesv1.Host)
		if x.GetStatus().GetMachine() == "" {
			spare = x
		}
	}
	require.NotNil(t, spare, "cluster c2 has a spare host")
	relabel := func(pool string) {
		h := &typesv1.Host{}
		w.edit("hosts", spare.Metadata.Name, h, func() { h.Metadata.Labels["pool"] = pool })
	}
	relabel("repair")

	hostsBefore := map[string]string{}
	for _, c := range []string{"c1", "c2", "c3"} {
		hostsBefore[c] = w.cpHost(c)
	}

	stop := w.startRollouts()
	w.create("rollouts", "img2", &typesv1.Rollout{ApiVersion: "kiln.dev/v1", Kind: "Rollout", Metadata: meta("img2"), Spec: &typesv1.RolloutSpec{
		Change:          &typesv1.RolloutChange{Image: "img2"},
		ClusterSelector: map[string]string{"env": "test"},
		Bake:            "2s",
		Halt:            &typesv1.RolloutHalt{ReadyTimeout: "8s"},
	}})
	start := time.Now()
	timeline := func(what string) { t.Logf("%6s %s", time.Since(start).Round(100*time.Millisecond), what) }

	// Wave 1 starts; a new leader takes over while it moves.
	require.Eventually(t, func() bool { return len(w.rollout().GetStatus().GetClusters()) == 1 }, 10*time.Second, 50*time.Millisecond)
	timeline(waves(w.rollout()))
	stop()
	stop = w.startRollouts()
	defer func() { stop() }()

	require.Eventually(t, func() bool { return w.rollout().GetStatus().GetPhase() == rolloutplan.PhaseBaking }, 60*time.Second, 50*time.Millisecond,
		"wave 1 never baked: %v", w.rollout().GetStatus())
	r := w.rollout()
	timeline(waves(r))
	require.Equal(t, rolloutplan.WaveBaking, r.Status.Waves[0].State)
	require.Contains(t, r.Status.Waves[0].Message, "baking")
	c2 := w.get("controlplanes", "c2-cp", &typesv1.ControlPlane{}).(*typesv1.ControlPlane)
	require.Equal(t, "img1", c2.Spec.Image, "wave 2 moved while wave 1 baked")

	require.Eventually(t, func() bool { return w.rollout().GetStatus().GetPhase() == rolloutplan.PhaseHalted }, 60*time.Second, 100*time.Millisecond,
		"never halted: %v", w.rollout().GetStatus())
	r = w.rollout()
	timeline(waves(r))
	prog := conditions.Get(r.Status.Conditions, rolloutplan.ConditionProgressing)
	timeline("Progressing=False " + prog.GetReason() + ": " + prog.GetMessage())
	require.Equal(t, rolloutplan.ReasonReadyTimeout, prog.GetReason())
	require.Contains(t, prog.GetMessage(), "cluster c2 not done")
	require.Equal(t, []string{rolloutplan.WaveDone, rolloutplan.WaveHalted, rolloutplan.WaveWaiting},
		[]string{r.Status.Waves[0].State, r.Status.Waves[1].State, r.Status.Waves[2].State})
	c3 := w.get("controlplanes", "c3-cp", &typesv1.ControlPlane{}).(*typesv1.ControlPlane)
	require.Equal(t, "img1", c3.Spec.Image, "wave 3 touched")
	require.EqualValues(t, 1, c3.Metadata.Generation, "wave 3 touched")

	// The fix: the host is back in c2's pool; then resume.
	relabel("c2")
	require.Equal(t, rolloutplan.PhaseHalted, w.rollout().GetStatus().GetPhase())
	ro := &typesv1.Rollout{}
	w.edit("rollouts", "img2", ro, func() { ro.Spec.Resume++; ro.Metadata.Generation++ })
	timeline("resumed")

	require.Eventually(t, func() bool { return w.rollout().GetStatus().GetPhase() == rolloutplan.PhaseComplete }, 90*time.Second, 100*time.Millisecond,
		"never complete: %v", w.rollout().GetStatus())
	r = w.rollout()
	timeline(waves(r))
	for _, c := range []string{"c1", "c2", "c3"} {
		cp := w.get("controlplanes", c+"-cp", &typesv1.ControlPlane{}).(*typesv1.ControlPlane)
		require.Equal(t, "img2", cp.Spec.Image, "control plane %s", c)
		require.EqualValues(t, 2, cp.Metadata.Generation, "control plane %s moved once", c)
		require.Equal(t, "img2", cp.Status.Image, "control plane %s", c)
		require.True(t, w.ready(c), "cluster %s Ready", c)
		require.NotEqual(t, hostsBefore[c], w.cpHost(c), "cluster %s: the control plane moved to its spare host", c)
	}
	// Waves in order: each cluster started after the one before was done.
	var prevDone time.Time
	for _, rc := range r.Status.Clusters {
		timeline(fmt.Sprintf("cluster %s wave %s started %s done %s", rc.Name, rc.Wave,
			rc.StartTime.AsTime().Sub(start).Round(100*time.Millisecond), rc.DoneTime.AsTime().Sub(start).Round(100*time.Millisecond)))
		require.True(t, rc.StartTime.AsTime().After(prevDone), "cluster %s started before the wave before was done", rc.Name)
		prevDone = rc.DoneTime.AsTime()
	}
}
