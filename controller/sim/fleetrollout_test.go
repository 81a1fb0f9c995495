package sim_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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
	"github.com/kilnhq/kiln/controller/topologyexec"
	"github.com/kilnhq/kiln/controller/topologyplan"
	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/seal"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// image2 is the second simulated image: the class change that the fleet
// rollout carries points the class's machines at it, so every machine of
// every cluster is replaced by one laid with it.
const image2 = "debian12-k8s1.34.4-20261215"

// fleetSize is one run of the fleet simulation.
type fleetSize struct {
	clusters, hosts int
	// classes are the ClusterClasses the clusters are spread over
	// (round robin); every one of them is changed.
	classes int
	// waves are the values of the clusters' upgrade-wave label.
	waves int
	// maxConcurrent is each Rollout's spec.maxConcurrent.
	maxConcurrent int32
	bake          string
	sim           sim.Config
	kubeadm       time.Duration
	// provisionWorkers is the host lifecycle's Workers; clusterWorkers
	// and longActions the cluster executor's.
	provisionWorkers, clusterWorkers, longActions int
	interval                                      time.Duration
	timeout                                       time.Duration
	// progress, when set, is told what is awaited every 30 s.
	progress func(format string, args ...any)
}

// fleetResult is what a run measured.
type fleetResult struct {
	provision time.Duration   // clusters applied -> every cluster Ready
	waves     []time.Duration // class change -> the last Rollout's wave k done
	rollout   time.Duration   // class change -> every Rollout Complete and every machine on image2
	rollouts  []*typesv1.Rollout
	// pins are the class revisions each cluster's pin took after the
	// clusters were Ready, each with when a watcher saw it.
	pins   map[string][]pinMove
	etcdDB int64
	// cacheFallbacks: reconciles that listed the hosts from etcd after
	// waiting HostCacheWait for the host cache.
	cacheFallbacks int64
	// cacheWaits, cacheWaited: reconciles that waited 10 ms or more for
	// the host cache to hold the executor's own host write, and how long
	// they waited in all.
	cacheWaits  int64
	cacheWaited time.Duration
}

// fleetWorld is the controller's executors over a real store (embedded
// etcd) and a simulated fleet with simulated kubeadm: the host lifecycle,
// the cluster executor, the topology executor and the rollout executor,
// wired as the controller's leader wires them (controller.runLifecycle,
// runTopology), with drains skipped (no Kubernetes API in the simulation).
type fleetWorld struct {
	t   testing.TB
	ctx context.Context
	dir string
	st  *store.Store
	// cache counts the cluster executor's waits for its host cache and
	// its fallbacks to etcd.
	cache *countingHandler
}

// countingHandler discards log records: it counts the cluster
// executor's fallbacks from the host cache to etcd and sums its waits for
// the host cache (the Debug records clusterexec.HostCacheFallbackMsg and
// HostCacheWaitMsg).
type countingHandler struct {
	fallbacks, waits atomic.Int64
	waited           atomic.Int64 // nanoseconds
}

func (h *countingHandler) Enabled(_ context.Context, l slog.Level) bool { return l == slog.LevelDebug }
func (h *countingHandler) Handle(_ context.Context, r slog.Record) error {
	switch r.Message {
	case clusterexec.HostCacheFallbackMsg:
		h.fallbacks.Add(1)
	case clusterexec.HostCacheWaitMsg:
		h.waits.Add(1)
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "waited" {
				h.waited.Add(int64(a.Value.Duration()))
			}
			return true
		})
	}
	return nil
}
func (h *countingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *countingHandler) WithGroup(string) slog.Handler      { return h }

func newFleetWorld(t testing.TB, sz fleetSize) *fleetWorld {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	dir := filepath.Join(t.TempDir(), "etcd")
	e, err := store.StartEmbedded(ctx, store.EmbeddedConfig{DataDir: dir})
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
	fleet := sim.NewFleet(ctx, sz.sim, sim.EnrollmentCheckIn(enr))
	kubeadm := sim.NewKubeadm(fleet, sz.kubeadm)
	life := provision.New(provision.Deps{Store: st, Recorder: rec, BMCs: fleet.BMCDialer(), Agents: kubeadm.AgentDialer()},
		provision.Config{
			Workers: sz.provisionWorkers,
			Plan: hostlife.Config{
				PollInterval: 200 * time.Millisecond,
				Backoff:      backoff.Policy{Base: 20 * time.Millisecond, Max: 500 * time.Millisecond, Factor: 2},
				MaxAttempts:  5,
			},
			ISOURL:         func(h string) string { return "http://boot.sim/boot/iso/" + h + ".iso" },
			ResyncInterval: 10 * time.Second,
		}, log)
	hosts := clusterexec.NewHostCache(st)
	cacheLog := &countingHandler{}
	cx := clusterexec.New(clusterexec.Deps{Store: st, Recorder: rec, Agents: clusterexec.AgentDialer(kubeadm.AgentDialer()), Hosts: hosts},
		clusterexec.Config{Interval: sz.interval, ClusterWorkers: sz.clusterWorkers, LongActions: sz.longActions}, slog.New(cacheLog))
	tx := topologyexec.New(st, rec, topologyexec.Config{Interval: sz.interval}, log)
	rx := rolloutexec.New(rolloutexec.Deps{Store: st, Events: rec}, rolloutexec.Config{Interval: sz.interval}, log)
	var wg sync.WaitGroup
	runHosts := func(ctx context.Context) error { hosts.Run(ctx); return nil }
	for _, run := range []func(context.Context) error{runHosts, life.Run, cx.Run, tx.Run, rx.Run} {
		wg.Add(1)
		go func() { defer wg.Done(); _ = run(ctx) }()
	}
	t.Cleanup(func() { cancel(); wg.Wait() })
	return &fleetWorld{t: t, ctx: ctx, dir: dir, st: st, cache: cacheLog}
}

func fleetMeta(name string, labels map[string]string) *typesv1.ObjectMeta {
	return &typesv1.ObjectMeta{Name: name, Generation: 1, CreationTimestamp: timestamppb.Now(), Uid: "uid-" + name, Labels: labels}
}

func clusterName(i int) string { return fmt.Sprintf("store-%04d", i) }

func className(i int) string { return fmt.Sprintf("class-%c", 'a'+i) }

// populate stores both images and the hosts: hosts/clusters of them
// labelled site=<cluster> for each cluster (the rest, if any, are spares
// of no site). No host is bound to a Machine: each registers and waits
// Available until a cluster's machine takes it.
func (w *fleetWorld) populate(sz fleetSize) {
	for _, img := range []string{sim.ImageName, image2} {
		_, err := w.st.Create(w.ctx, "images", img, &typesv1.Image{Metadata: fleetMeta(img, nil), Spec: &typesv1.ImageSpec{
			Url: "http://images.sim/" + img + ".raw.zst", Format: "raw.zst", Sha256: strings.Repeat("ab", 32), KubernetesVersion: "v1.34.4"}})
		require.NoError(w.t, err)
	}
	per := sz.hosts / sz.clusters
	errs := make([]error, sz.hosts)
	var wg sync.WaitGroup
	next := make(chan int)
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				name := sim.HostName("fleet", i+1)
				labels := map[string]string{}
				if c := i / per; c < sz.clusters {
					labels["site"] = clusterName(c)
				}
				_, errs[i] = w.st.Create(w.ctx, "hosts", name, &typesv1.Host{Metadata: fleetMeta(name, labels),
					Spec: &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "redfish", Address: "sim://" + name}, RootDiskHint: "/dev/sda", Online: true}})
			}
		}()
	}
	for i := range sz.hosts {
		next <- i
	}
	close(next)
	wg.Wait()
	require.NoError(w.t, errors.Join(errs...))
}

// classSpec is a class whose control plane (one machine, rolled with one
// surge host) and worker pool "general" (rolled one surge host at a time)
// take the hosts of the cluster's site and are laid with image.
func classSpec(sz fleetSize, image string) *typesv1.ClusterClassSpec {
	site := map[string]string{"site": "${site}"}
	return &typesv1.ClusterClassSpec{
		Variables: []*typesv1.ClusterClassVariable{{Name: "site", Type: "string", Required: true}},
		Cluster: &typesv1.ClusterSpec{PodCidr: "10.244.0.0/16", ServiceCidr: "10.96.0.0/12", DnsDomain: "cluster.local",
			ControlPlaneEndpoint: "10.0.0.10:6443"},
		ControlPlane: &typesv1.ClusterClassMachines{HostSelector: site, Image: image, RolloutMaxSurge: 1},
		Workers: []*typesv1.ClusterClassWorker{{Name: "general", Template: &typesv1.ClusterClassMachines{HostSelector: site, Image: image,
			Strategy: &typesv1.RolloutStrategy{Type: "RollingUpdate", MaxSurge: "1", MaxUnavailable: "0"}}}},
		Rollout: &typesv1.RolloutSpec{WaveLabel: "upgrade-wave", Bake: sz.bake, MaxConcurrent: sz.maxConcurrent},
	}
}

// clusters lists the clusters: how many are Ready with their topology
// reconciled at the pinned revision rev (0: any).
func (w *fleetWorld) readyClusters(rev int64) (ready int, example string) {
	items, _, err := w.st.List(w.ctx, "clusters", func() proto.Message { return &typesv1.Cluster{} }, store.ListOptions{})
	require.NoError(w.t, err)
	for _, it := range items {
		c := it.Msg.(*typesv1.Cluster)
		if conditions.IsTrue(c.GetStatus().GetConditions(), "Ready") && topologyplan.Reconciled(c) &&
			(rev == 0 || c.GetStatus().GetTopology().GetClassRevision() == rev) {
			ready++
			continue
		}
		example = fmt.Sprintf("%s: phase %q, conditions %v", it.Name, c.GetStatus().GetPhase(), c.GetStatus().GetConditions())
	}
	return ready, example
}

// eventually polls cond every 200 ms until it holds or sz.timeout passes.
func (w *fleetWorld) eventually(sz fleetSize, what string, cond func() (bool, string)) {
	w.t.Helper()
	start := time.Now()
	deadline, report := start.Add(sz.timeout), start.Add(30*time.Second)
	for {
		ok, why := cond()
		if ok {
			return
		}
		if sz.progress != nil && time.Now().After(report) {
			sz.progress("%s after %s: %s\n", what, time.Since(start).Round(time.Second), why)
			report = report.Add(30 * time.Second)
		}
		if time.Now().After(deadline) {
			w.t.Fatalf("%s: not after %s: %s", what, sz.timeout, why)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// runFleet builds the fleet, waits until every cluster is Ready, changes
// every class's image and waits until each class's Rollout has carried
// the change to all its clusters, wave by wave.
func runFleet(t testing.TB, sz fleetSize) fleetResult {
	w := newFleetWorld(t, sz)
	w.populate(sz)
	for i := range sz.classes {
		_, err := w.st.Create(w.ctx, "clusterclasses", className(i), &typesv1.ClusterClass{Metadata: fleetMeta(className(i), nil), Spec: classSpec(sz, sim.ImageName)})
		require.NoError(t, err)
	}
	w.eventually(sz, "class revision 1", func() (bool, string) {
		for i := range sz.classes {
			c := &typesv1.ClusterClass{}
			_, err := w.st.Get(w.ctx, "clusterclasses", className(i), c)
			require.NoError(t, err)
			if c.GetStatus().GetRevision() != 1 {
				return false, className(i) + " has no revision"
			}
		}
		return true, ""
	})

	var res fleetResult
	start := time.Now()
	for i := range sz.clusters {
		name := clusterName(i)
		_, err := w.st.Create(w.ctx, "clusters", name, &typesv1.Cluster{
			Metadata: fleetMeta(name, map[string]string{"upgrade-wave": strconv.Itoa(i%sz.waves + 1)}),
			Spec: &typesv1.ClusterSpec{Topology: &typesv1.ClusterTopology{Class: className(i % sz.classes), Version: "v1.34.4",
				ControlPlaneReplicas: 1, Workers: []*typesv1.TopologyWorkerPool{{Name: "app", Class: "general", Replicas: 2}},
				Variables: map[string]string{"site": name}}}})
		require.NoError(t, err)
	}
	w.eventually(sz, "every cluster Ready", func() (bool, string) {
		n, ex := w.readyClusters(1)
		return n == sz.clusters, fmt.Sprintf("%d of %d Ready; e.g. %s", n, sz.clusters, ex)
	})
	res.provision = time.Since(start)

	// Every move of a cluster's pin from here on, as a watcher of the
	// clusters sees it.
	pins := w.watchPins()

	// The change: every class's machines move to image2 (revision 2).
	changed := time.Now()
	for i := range sz.classes {
		for {
			c := &typesv1.ClusterClass{}
			rev, err := w.st.Get(w.ctx, "clusterclasses", className(i), c)
			require.NoError(t, err)
			c.Spec = classSpec(sz, image2)
			c.Metadata.Generation++
			if _, err = w.st.Update(w.ctx, "clusterclasses", className(i), c, rev); err == nil {
				break
			} else if !errdefs.IsConflict(err) {
				require.NoError(t, err)
			}
		}
	}
	res.waves = make([]time.Duration, sz.waves)
	w.eventually(sz, "every Rollout Complete", func() (bool, string) {
		res.rollouts = res.rollouts[:0]
		for i := range sz.classes {
			r := &typesv1.Rollout{}
			_, err := w.st.Get(w.ctx, "rollouts", topologyplan.RolloutName(className(i), 2), r)
			if errdefs.IsNotFound(err) {
				return false, "no Rollout " + topologyplan.RolloutName(className(i), 2)
			}
			require.NoError(t, err)
			require.NotEqual(t, rolloutplan.PhaseHalted, r.GetStatus().GetPhase(), "rollout %s: %v", r.GetMetadata().GetName(), r.GetStatus().GetConditions())
			for k, wv := range r.GetStatus().GetWaves() {
				if d := wv.GetDoneTime(); d != nil && k < len(res.waves) && res.waves[k] < d.AsTime().Sub(changed) {
					res.waves[k] = d.AsTime().Sub(changed)
				}
			}
			res.rollouts = append(res.rollouts, r)
		}
		for _, r := range res.rollouts {
			if r.GetStatus().GetPhase() != rolloutplan.PhaseComplete {
				return false, fmt.Sprintf("rollout %s: %s", r.GetMetadata().GetName(), r.GetStatus().GetPhase())
			}
		}
		n, ex := w.readyClusters(2)
		if n != sz.clusters {
			return false, fmt.Sprintf("%d of %d Ready on revision 2; e.g. %s", n, sz.clusters, ex)
		}
		left := w.machinesNotOn(image2)
		return left == "", left
	})
	res.rollout = time.Since(changed)
	res.pins = pins()
	st, err := os.Stat(filepath.Join(w.dir, "member", "snap", "db"))
	require.NoError(t, err)
	res.etcdDB = st.Size()
	res.cacheFallbacks = w.cache.fallbacks.Load()
	res.cacheWaits = w.cache.waits.Load()
	res.cacheWaited = time.Duration(w.cache.waited.Load())
	return res
}

// pinMove is a cluster's status.topology.classRevision changing.
type pinMove struct {
	rev int64
	at  time.Time
}

// watchPins watches the clusters from now on; the returned function
// stops the watch and returns each cluster's pin moves.
func (w *fleetWorld) watchPins() func() map[string][]pinMove {
	ctx, cancel := context.WithCancel(w.ctx)
	moves := map[string][]pinMove{}
	done := make(chan struct{})
	ch := w.st.Watch(ctx, "clusters", 0)
	go func() {
		defer close(done)
		for ev := range ch {
			if ev.Err != nil || ev.Type != store.EventPut {
				continue
			}
			c := &typesv1.Cluster{}
			if proto.Unmarshal(ev.Value, c) != nil {
				continue
			}
			pin := c.GetStatus().GetTopology().GetClassRevision()
			if ms := moves[ev.Name]; len(ms) == 0 || ms[len(ms)-1].rev != pin {
				moves[ev.Name] = append(ms, pinMove{rev: pin, at: time.Now()})
			}
		}
	}()
	return func() map[string][]pinMove {
		cancel()
		<-done
		return moves
	}
}

// requirePinsFollowWaves asserts what a watcher of the clusters sees: each
// cluster's pin moved once, from revision 1 to 2, and not before every
// cluster of the wave before its own was done (by r's status).
func requirePinsFollowWaves(t testing.TB, r *typesv1.Rollout, pins map[string][]pinMove) {
	t.Helper()
	done := map[string]time.Time{}
	for _, c := range r.GetStatus().GetClusters() {
		done[c.GetName()] = c.GetDoneTime().AsTime()
	}
	var prevDone time.Time
	for _, wv := range r.GetStatus().GetWaves() {
		var waveDone time.Time
		for _, cn := range wv.GetClusters() {
			var revs []int64
			for _, m := range pins[cn] {
				revs = append(revs, m.rev)
			}
			require.Equal(t, []int64{2}, revs, "cluster %s: pin moves after the clusters were Ready", cn)
			require.False(t, pins[cn][0].at.Before(prevDone), "cluster %s of wave %s moved to revision 2 at %s, before the wave before was done (%s)",
				cn, wv.GetValue(), pins[cn][0].at.Format(time.RFC3339Nano), prevDone.Format(time.RFC3339Nano))
			if done[cn].After(waveDone) {
				waveDone = done[cn]
			}
		}
		prevDone = waveDone
	}
}

// machinesNotOn names a machine not Running with image on a host laid
// with it, or "" when every machine runs it.
func (w *fleetWorld) machinesNotOn(image string) string {
	items, _, err := w.st.List(w.ctx, "machines", func() proto.Message { return &typesv1.Machine{} }, store.ListOptions{})
	require.NoError(w.t, err)
	for _, it := range items {
		m := it.Msg.(*typesv1.Machine)
		if m.GetSpec().GetImage() != image || m.GetStatus().GetPhase() != clusterexec.PhaseRunning {
			return fmt.Sprintf("machine %s: image %q phase %s", it.Name, m.GetSpec().GetImage(), m.GetStatus().GetPhase())
		}
		// The host under it was laid with the image, not just relabelled.
		h := &typesv1.Host{}
		_, err := w.st.Get(w.ctx, "hosts", m.GetSpec().GetHost(), h)
		require.NoError(w.t, err)
		if h.GetStatus().GetImage() != image {
			return fmt.Sprintf("machine %s: host %s runs image %q", it.Name, m.GetSpec().GetHost(), h.GetStatus().GetImage())
		}
	}
	return ""
}

// requireWavesInOrder asserts what an operator reads in kilnctl get
// rollout: each wave's clusters started only once every cluster of the
// wave before was done, and every wave holds its clusters.
func requireWavesInOrder(t testing.TB, r *typesv1.Rollout, waves int) {
	t.Helper()
	name := r.GetMetadata().GetName()
	byName := map[string]*typesv1.RolloutCluster{}
	for _, c := range r.GetStatus().GetClusters() {
		byName[c.GetName()] = c
	}
	ws := r.GetStatus().GetWaves()
	require.Len(t, ws, waves, "rollout %s waves", name)
	var prevDone time.Time
	for k, wv := range ws {
		require.Equal(t, strconv.Itoa(k+1), wv.GetValue(), "rollout %s wave %d", name, k)
		require.NotEmpty(t, wv.GetClusters(), "rollout %s wave %s", name, wv.GetValue())
		var done time.Time
		for _, cn := range wv.GetClusters() {
			c := byName[cn]
			require.NotNil(t, c, "rollout %s: cluster %s of wave %s has no status", name, cn, wv.GetValue())
			require.NotNil(t, c.GetStartTime(), "rollout %s: cluster %s never started", name, cn)
			require.NotNil(t, c.GetDoneTime(), "rollout %s: cluster %s never done", name, cn)
			require.False(t, c.GetStartTime().AsTime().Before(prevDone),
				"rollout %s: cluster %s of wave %s started at %s, before wave %d was done (%s)", name, cn, wv.GetValue(),
				c.GetStartTime().AsTime().Format(time.RFC3339Nano), k, prevDone.Format(time.RFC3339Nano))
			if d := c.GetDoneTime().AsTime(); d.After(done) {
				done = d
			}
		}
		prevDone = done
	}
}

// TestFleetClassRollout is the fleet simulation at a size for make test:
// 12 clusters of 3 classes over 60 simulated hosts, in 4 waves. Every
// class's image changes; each class's Rollout replaces every machine of
// its clusters (reimaged with the new image) wave by wave, no cluster
// of a wave starting before the wave before it is done.
func TestFleetClassRollout(t *testing.T) {
	sz := fleetSize{clusters: 12, hosts: 60, classes: 3, waves: 4, maxConcurrent: 2, bake: "1s",
		sim: fastSim, kubeadm: 50 * time.Millisecond, provisionWorkers: 64, clusterWorkers: 12, longActions: 16,
		interval: 500 * time.Millisecond, timeout: 3 * time.Minute}
	res := runFleet(t, sz)
	require.Len(t, res.rollouts, 3)
	for _, r := range res.rollouts {
		requireWavesInOrder(t, r, sz.waves)
		requirePinsFollowWaves(t, r, res.pins)
		require.Len(t, r.GetStatus().GetClusters(), sz.clusters/sz.classes, "rollout %s clusters", r.GetMetadata().GetName())
	}
	t.Logf("provision %s, waves %v, rollout %s, etcd db %d KiB, host cache: %d waits ≥ 10 ms (%s in all), %d fallbacks to etcd", res.provision.Round(time.Millisecond), roundAll(res.waves), res.rollout.Round(time.Millisecond), res.etcdDB>>10, res.cacheWaits, res.cacheWaited.Round(time.Millisecond), res.cacheFallbacks)
}

func roundAll(ds []time.Duration) []time.Duration {
	out := make([]time.Duration, len(ds))
	for i, d := range ds {
		out[i] = d.Round(100 * time.Millisecond)
	}
	return out
}

// BenchmarkFleetClassRollout is issue 16's fleet simulation: C clusters
// (KILN_FLEET_CLUSTERS, default 200) of 3 classes over H simulated hosts
// (KILN_FLEET_HOSTS, default 5000; H/C hosts per cluster's site), in 4
// waves, at benchSim's timings (a rack's scaled down 100 times). It
// reports the time until every cluster is Ready, the time from the class
// change to the end of each wave and of the whole rollout, the peak RSS
// of the process (controller executors, embedded etcd and the simulated
// hosts) and the etcd database size. Run it once:
//
//	go test ./controller/sim/ -run '^$' -bench FleetClassRollout -benchtime 1x -timeout 60m
func BenchmarkFleetClassRollout(b *testing.B) {
	sz := fleetSize{clusters: envInt(b, "KILN_FLEET_CLUSTERS", 200), hosts: envInt(b, "KILN_FLEET_HOSTS", 5000), classes: 3, waves: 4,
		maxConcurrent: 25, bake: "5s", sim: benchSim, kubeadm: 500 * time.Millisecond,
		provisionWorkers: 1000, clusterWorkers: 32, longActions: 64, interval: 5 * time.Second, timeout: 50 * time.Minute,
		progress: func(format string, args ...any) { fmt.Fprintf(os.Stderr, format, args...) }}
	for range b.N {
		res := runFleet(b, sz)
		for _, r := range res.rollouts {
			requireWavesInOrder(b, r, sz.waves)
			requirePinsFollowWaves(b, r, res.pins)
		}
		b.ReportMetric(res.provision.Seconds(), "s-to-ready")
		for k, d := range res.waves {
			b.ReportMetric(d.Seconds(), fmt.Sprintf("s-wave%d-done", k+1))
		}
		b.ReportMetric(res.rollout.Seconds(), "s-rollout")
		b.ReportMetric(float64(peakRSS(b))/(1<<20), "MiB-peak-RSS")
		b.ReportMetric(float64(res.etcdDB)/(1<<20), "MiB-etcd-db")
		b.ReportMetric(float64(res.cacheFallbacks), "host-cache-fallbacks")
		b.ReportMetric(float64(res.cacheWaits), "host-cache-waits")
		b.ReportMetric(res.cacheWaited.Seconds(), "s-host-cache-waited")
	}
}

func envInt(b *testing.B, key string, def int) int {
	v := os.Getenv(key)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	require.NoError(b, err, "%s", key)
	return n
}
