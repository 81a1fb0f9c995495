package sim_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/liveness"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store/storetest"
	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// BenchmarkIdleHeartbeats runs a fleet of provisioned, idle simulated
// hosts whose installed agents heartbeat at the real 10 s interval
// through the real Agents.Heartbeat handler (enrollment.Service, the same
// code the gRPC adapter calls) into a real store (embedded etcd), with
// the replica's liveness monitor running. After every agent has checked
// in once and one more interval has passed, it measures a steady-state
// window (KILN_IDLE_WINDOW, default 60s) and reports etcd writes/s (the
// growth of etcd's revision), heartbeats/s, and the CPU the process used
// (controller handler, monitor, embedded etcd and the simulated agents
// together: an upper bound for the controller). Then it stops the agents
// of 10 hosts and checks that the monitor marks each unreachable within 3
// intervals and a check (s-to-mark-silent). Run one size at a time:
//
//	go test ./controller/sim/ -run '^$' -bench 'IdleHeartbeats/agents=100000$' -benchtime 1x -timeout 30m
//
// KILN_IDLE_AGENTS=N runs a fleet of N instead (profiling at sizes
// between the fixed ones).
func BenchmarkIdleHeartbeats(b *testing.B) {
	sizes := []int{1000, 10000, 100000}
	if v := os.Getenv("KILN_IDLE_AGENTS"); v != "" {
		n, err := strconv.Atoi(v)
		require.NoError(b, err, "KILN_IDLE_AGENTS")
		sizes = []int{n}
	}
	for _, n := range sizes {
		b.Run("agents="+strconv.Itoa(n), func(b *testing.B) {
			for range b.N {
				benchIdle(b, n)
			}
		})
	}
}

func benchIdle(b *testing.B, n int) {
	b.StopTimer()
	window := time.Minute
	if v := os.Getenv("KILN_IDLE_WINDOW"); v != "" {
		d, err := time.ParseDuration(v)
		require.NoError(b, err)
		window = d
	}
	const interval = 10 * time.Second
	w := newWorld(b, benchSim)
	log := slog.New(slog.DiscardHandler)
	tr := liveness.NewTracker()
	reads := &storetest.ReadCounter{Store: w.st}
	enr := enrollment.New(reads, nil, w.rec, enrollment.Config{HeartbeatInterval: interval, Replica: "bench", Tracker: tr}, log)
	mon := liveness.NewMonitor(w.st, w.rec, tr, liveness.MonitorConfig{Replica: "bench", Silence: 3 * interval}, log)
	createIdleHosts(b, w, n)

	ctx, cancel := context.WithCancel(w.ctx)
	defer cancel()
	// The replica's watch caches (the world runs them, as kiln-controller
	// does): idle heartbeats read their Host there (KILN_IDLE_NOCACHE=1:
	// from etcd, as before issue 17's caches; the caches still run).
	var cachesDone sync.WaitGroup
	if os.Getenv("KILN_IDLE_NOCACHE") == "" {
		enr.UseHostCache(w.caches.Kind("hosts"), w.st)
		cachesDone.Go(func() { enr.RunHostCache(ctx) })
	}
	defer cachesDone.Wait()
	// First check-ins spread over one interval; then every 10-11 s.
	fleet := sim.NewFleet(ctx, sim.Config{BootDelay: interval, HeartbeatInterval: interval, Jitter: 0.1}, sim.EnrollmentCheckIn(enr))
	hosts := make([]*sim.Host, n)
	for i := range hosts {
		hosts[i] = fleet.Host(sim.HostName("idle", i+1))
	}
	for _, h := range hosts {
		h.RunInstalled()
	}
	checkIns := func() (sum int64, all bool) {
		all = true
		for _, h := range hosts {
			c := h.CheckIns()
			sum += c
			all = all && c > 0
		}
		return sum, all
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); mon.Run(ctx) }()
	defer wg.Wait()
	defer cancel()

	warmup := 10 * time.Minute
	if v := os.Getenv("KILN_IDLE_WARMUP"); v != "" {
		d, err := time.ParseDuration(v)
		require.NoError(b, err)
		warmup = d
	}
	warm, logged := time.Now(), time.Now()
	for {
		if _, all := checkIns(); all {
			break
		}
		if time.Since(logged) >= 30*time.Second {
			in := 0
			for _, h := range hosts {
				if h.CheckIns() > 0 {
					in++
				}
			}
			b.Logf("%d of %d agents checked in after %s", in, n, time.Since(warm).Round(time.Second))
			logged = time.Now()
		}
		require.Less(b, time.Since(warm), warmup, "agents still checking in for the first time (KILN_IDLE_WARMUP)")
		time.Sleep(time.Second)
	}
	b.Logf("all %d agents checked in after %s", n, time.Since(warm).Round(time.Second))
	time.Sleep(interval + interval/5) // the facts round trips and first writes settle

	rev0, beats0, cpu0, t0 := w.revision(), first(checkIns()), cpuTime(b), time.Now()
	reads0 := reads.Reads.Load()
	// Which keys the writes of the window went to: a watch from the
	// window's start, counted by kind (hosts, events, ...).
	wctx, wcancel := context.WithCancel(ctx)
	byKind := map[string]int{}
	var wmu sync.Mutex
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for resp := range w.client.Watch(wctx, "/kiln/", clientv3.WithPrefix(), clientv3.WithRev(rev0+1)) {
			wmu.Lock()
			for _, ev := range resp.Events {
				parts := strings.SplitN(strings.TrimPrefix(string(ev.Kv.Key), "/kiln/v1/"), "/", 2)
				byKind[parts[0]+"/"+ev.Type.String()]++
			}
			wmu.Unlock()
		}
	}()
	b.StartTimer()
	time.Sleep(window)
	b.StopTimer()
	elapsed := time.Since(t0).Seconds()
	writes, beats, cpu := w.revision()-rev0, first(checkIns())-beats0, cpuTime(b)-cpu0
	hostReads := reads.Reads.Load() - reads0
	time.Sleep(time.Second)
	wcancel()
	<-watched
	wmu.Lock()
	b.Logf("writes of the %s window by key kind: %v; silent hosts marked: see events/PUT", window, byKind)
	wmu.Unlock()
	b.ReportMetric(float64(writes)/elapsed, "etcd-writes/s")
	b.ReportMetric(float64(beats)/elapsed, "heartbeats/s")
	b.ReportMetric(float64(hostReads)/elapsed, "etcd-host-reads/s")
	b.ReportMetric(cpu.Seconds()/elapsed, "CPU-cores")
	b.ReportMetric(float64(peakRSS(b))/(1<<20), "MiB-peak-RSS")
	b.ReportMetric(float64(tr.Len()), "tracked")
	require.Equal(b, n, tr.Len(), "agents tracked in memory")

	// Liveness at this size: the agents of 10 hosts stop (power cut);
	// each must be marked AgentReachable=False within 3 intervals of its
	// last heartbeat and one check (Silence/12).
	cut := make([]int, 10)
	for i := range cut {
		cut[i] = i * (n / len(cut))
	}
	lastBeat := map[int]time.Time{}
	for _, i := range cut {
		hosts[i].PowerCut()
		lastBeat[i] = time.Now() // an upper bound for its last heartbeat: none after the cut
	}
	bound := 3*interval + 3*interval/12
	var worst time.Duration
	for len(lastBeat) > 0 {
		for i, at := range lastBeat {
			h := &typesv1.Host{}
			_, err := w.st.Get(ctx, "hosts", hosts[i].Name(), h)
			require.NoError(b, err)
			if c := conditions.Get(h.GetStatus().GetConditions(), liveness.ConditionAgentReachable); c != nil && c.GetStatus() == conditions.False {
				worst = max(worst, time.Since(at))
				delete(lastBeat, i)
				continue
			}
			require.Less(b, time.Since(at), bound+5*time.Second, "host %s not marked unreachable %s after its agent stopped (bound %s)", hosts[i].Name(), time.Since(at).Round(time.Second), bound)
		}
		time.Sleep(250 * time.Millisecond)
	}
	b.Logf("10 stopped agents marked unreachable at most %s after they stopped (bound %s: 3 intervals and a check)", worst.Round(100*time.Millisecond), bound)
	b.ReportMetric(worst.Seconds(), "s-to-mark-silent")
}

func first(v int64, _ bool) int64 { return v }

// createIdleHosts stores n Provisioned hosts named like the fleet's.
func createIdleHosts(b *testing.B, w *world, n int) {
	now := timestamppb.Now()
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	next := make(chan int)
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				name := sim.HostName("idle", i)
				_, err := w.st.Create(w.ctx, "hosts", name, &typesv1.Host{
					ApiVersion: "kiln.dev/v1", Kind: "Host",
					Metadata: &typesv1.ObjectMeta{Name: name, Generation: 1, CreationTimestamp: now, Labels: map[string]string{"rack": fmt.Sprintf("r%04d", (i-1)/40+1)}},
					Spec:     &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "redfish", Address: "sim://" + name}, Online: true},
					Status:   &typesv1.HostStatus{State: typesv1.HostState_HOST_STATE_PROVISIONED, Image: sim.ImageName},
				})
				if err != nil {
					select {
					case errs <- err:
					default:
					}
				}
			}
		}()
	}
	for i := 1; i <= n; i++ {
		next <- i
	}
	close(next)
	wg.Wait()
	close(errs)
	require.NoError(b, <-errs)
}

// cpuTime is the user and system CPU time the process has used.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	require.NoError(b, syscall.Getrusage(syscall.RUSAGE_SELF, &ru))
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
