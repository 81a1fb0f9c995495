package sim_test

import (
	"bufio"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/resources"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/testenv"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// benchSim is a rack's timing scaled down 100 times: a BMC call 0.5 s ->
// 5 ms, power on to the boot agent's check-in 90 s -> 0.9 s, laying an
// image 2 min -> 1.2 s. Heartbeats keep their real 10 s interval, so the
// store carries the real per-second heartbeat load of the fleet.
var benchSim = sim.Config{
	BMCLatency:        5 * time.Millisecond,
	BootDelay:         900 * time.Millisecond,
	LayDuration:       1200 * time.Millisecond,
	WipeDuration:      300 * time.Millisecond,
	HeartbeatInterval: 10 * time.Second,
	Jitter:            0.5,
}

// BenchmarkProvision provisions a fleet of simulated hosts from
// registration to Provisioned through the real store (embedded etcd),
// enrollment heartbeats, planner and executor, and reports the time to
// converge, the process's peak RSS (controller and its embedded etcd),
// what it holds at the end (reportMemory) and the etcd database's size
// (reportDB). Run one size at a time, once:
//
//	go test ./controller/sim/ -run '^$' -bench 'Provision/hosts=10000$' -benchtime 1x -timeout 30m
//
// KILN_BENCH_MAX_IN_FLIGHT=N sets the executor's admission limit
// (provision.Config.MaxInFlight; default provision.DefaultMaxInFlight,
// -1: none). KILN_BENCH_GROUP_COMMIT=off sends every store write in a
// transaction of its own and every Get in a request of its own;
// KILN_BENCH_GROUP_READS=off only the Gets (groupCommitFromEnv).
func BenchmarkProvision(b *testing.B) {
	for _, n := range []int{100, 1000, 10000, 100000} {
		b.Run("hosts="+strconv.Itoa(n), func(b *testing.B) {
			for range b.N {
				benchWave(b, n)
			}
		})
	}
}

func benchWave(b *testing.B, n int) {
	b.StopTimer()
	w := newWorld(b, benchSim)
	w.cfg.Workers = 0 // the executor's default (provision.Config.Workers), as kiln-controller runs it
	w.cfg.ResyncInterval = time.Minute
	w.cfg.Plan = hostlife.Config{PollInterval: time.Second}
	if v := os.Getenv("KILN_BENCH_MAX_IN_FLIGHT"); v != "" {
		k, err := strconv.Atoi(v)
		require.NoError(b, err, "KILN_BENCH_MAX_IN_FLIGHT")
		w.cfg.MaxInFlight = k
	}
	_, err := sim.Populate(w.ctx, w.st, n, "rack")
	require.NoError(b, err)
	rev0 := w.revision()
	wc := w.countWrites(rev0)
	ev0 := w.rec.Stats()
	b.StartTimer()
	start := time.Now()
	stop := w.start()
	defer stop()
	// The benchmark watches the wave from the replica's Host cache, once
	// a second: reading it decodes nothing. (It listed every Host from
	// etcd before, every 10 s at 100,000 hosts: 8 % of the wave's
	// allocations, and up to 10 s late on the time to converge.)
	const poll = time.Second
	logged := time.Now()
	for {
		done, errs := w.countCached()
		require.Zero(b, errs, "hosts in Error")
		if done == n {
			break
		}
		if time.Since(logged) >= time.Minute {
			inflight, waiting := w.ex.InFlight()
			b.Logf("%d of %d hosts Provisioned after %s; %d in flight, %d waiting for a slot, %d queued; RSS %d MiB",
				done, n, time.Since(start).Round(time.Second), inflight, waiting, w.ex.QueueLen(), rss(b)>>20)
			logged = time.Now()
		}
		time.Sleep(poll)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	end := w.revision()
	writes := end - rev0
	wc.waitSeen(b, end)
	lays := 0
	for _, h := range w.fleet.Hosts() {
		lays += h.Lays()
	}
	require.Equal(b, n, lays, "image lays")
	b.ReportMetric(elapsed.Seconds(), "s-to-converge")
	b.ReportMetric(float64(peakRSS(b))/(1<<20), "MiB-peak-RSS")
	w.reportMemory(b)
	w.reportDB(b, end)
	b.ReportMetric(float64(n)/elapsed.Seconds(), "hosts/s")
	b.ReportMetric(float64(writes)/elapsed.Seconds(), "etcd-writes/s")
	b.ReportMetric(float64(writes)/float64(n), "etcd-writes/host")
	// Object writes (a Host's, or events alone) per second: with group
	// commit several go in one etcd write.
	b.ReportMetric(float64(wc.hostWrites+wc.eventOnlyWrites+wc.otherWrites)/elapsed.Seconds(), "object-writes/s")
	// What the writes were: with a Host (status, heartbeats, progress; the
	// lifecycle's events ride in them), events alone (by reason in the
	// log), and the event keys put.
	b.ReportMetric(float64(wc.hostWrites)/float64(n), "host-writes/host")
	b.ReportMetric(float64(wc.eventOnlyWrites)/float64(n), "event-only-writes/host")
	// Events recorded (new or folded into an alike one), and the event
	// keys put for them: an object's log is one key, rewritten with each
	// of its writes.
	ev := w.rec.Stats()
	b.ReportMetric(float64(ev.Written+ev.Aggregated-ev0.Written-ev0.Aggregated)/float64(n), "events/host")
	b.ReportMetric(float64(ev.Logged-ev0.Logged)/float64(n), "events-logged/host")
	b.ReportMetric(float64(wc.eventPuts)/float64(n), "event-puts/host")
	b.Logf("events written alone, by reason: %v; other writes: %d", wc.eventOnly, wc.otherWrites)
}

// reportMemory reports, at the end of the wave with everything still
// running, what the process holds: its resident set split into anonymous
// memory (Go's heap and stacks, the controller's, etcd's and the
// simulated fleet's) and file pages (etcd's database, which bbolt maps,
// and the test binary's own pages),
// Go's heap after a collection (in use, and held from the system:
// in use plus free spans not yet returned), its goroutines and their
// stacks. KILN_BENCH_HEAP_PROFILE=FILE
// writes the heap profile there (-test.memprofile writes its profile
// after the benchmark's world is torn down: it shows nothing of the run).
func (w *world) reportMemory(b *testing.B) {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	b.ReportMetric(float64(ms.HeapInuse)/(1<<20), "MiB-heap-inuse")
	b.ReportMetric(float64(ms.HeapSys-ms.HeapReleased)/(1<<20), "MiB-heap-held")
	b.ReportMetric(float64(ms.StackInuse)/(1<<20), "MiB-stacks")
	b.ReportMetric(float64(runtime.NumGoroutine()), "goroutines")
	b.ReportMetric(float64(procStatus(b, "RssAnon:"))/(1<<20), "MiB-RSS-anon")
	b.ReportMetric(float64(procStatus(b, "RssFile:"))/(1<<20), "MiB-RSS-file")
	if path := os.Getenv("KILN_BENCH_HEAP_PROFILE"); path != "" {
		f, err := os.Create(path)
		require.NoError(b, err)
		require.NoError(b, pprof.Lookup("heap").WriteTo(f, 0))
		require.NoError(b, f.Close())
	}
}

// reportDB reports etcd's database: the file (MiB-etcd-db), its size as
// etcd reports it and counts against its quota (MiB-etcd-db-size: the
// pages up to the highest used; the file can be a growth step, up to 16
// MiB, larger), the part in use (MiB-etcd-db-in-use; the rest is pages
// freed by compactions, reused by later writes), and the file after
// compacting every revision
// before end and defragmenting (MiB-etcd-db-compacted), with the
// defragmentation's duration (the member serves nothing meanwhile).
func (w *world) reportDB(b *testing.B, end int64) {
	file := filepath.Join(w.dir, "member", "snap", "db")
	fi, err := os.Stat(file)
	require.NoError(b, err)
	b.ReportMetric(float64(fi.Size())/(1<<20), "MiB-etcd-db")
	ep := w.client.Endpoints()[0]
	st, err := w.client.Status(w.ctx, ep)
	require.NoError(b, err)
	b.ReportMetric(float64(st.DbSize)/(1<<20), "MiB-etcd-db-size")
	b.ReportMetric(float64(st.DbSizeInUse)/(1<<20), "MiB-etcd-db-in-use")
	_, err = w.client.Compact(w.ctx, end, clientv3.WithCompactPhysical())
	if err != nil && !errors.Is(err, rpctypes.ErrCompacted) {
		require.NoError(b, err)
	}
	start := time.Now()
	_, err = w.client.Defragment(w.ctx, ep)
	require.NoError(b, err)
	b.ReportMetric(time.Since(start).Seconds(), "s-etcd-defrag")
	fi, err = os.Stat(file)
	require.NoError(b, err)
	b.ReportMetric(float64(fi.Size())/(1<<20), "MiB-etcd-db-compacted")
}

// revision is etcd's current revision: it grows by one per committed
// write (a put, a delete or a transaction that changed something), so its
// growth over a run counts the run's writes, events and leases included.
func (w *world) revision() int64 {
	resp, err := w.client.Get(w.ctx, "/kiln/revision-probe")
	require.NoError(w.t, err)
	return resp.Header.Revision
}

// countCached counts the Provisioned hosts and those in Error in the
// replica's Host cache (which may lag the store by its watch's delay), by
// its State index: it decodes no host (the cache keeps Hosts encoded).
// Before the cache's first listing it counts none.
func (w *world) countCached() (done, errs int) {
	c := w.caches.Kind("hosts")
	return c.IndexLen(resources.IndexState, typesv1.HostState_HOST_STATE_PROVISIONED.String()),
		c.IndexLen(resources.IndexState, typesv1.HostState_HOST_STATE_ERROR.String())
}

// count lists the hosts page by page: provisioned ones and ones in Error.
func (w *world) count() (done, errs int) {
	cont := ""
	for {
		items, next, err := w.st.List(w.ctx, "hosts", func() proto.Message { return &typesv1.Host{} }, store.ListOptions{Limit: 1000, Continue: cont})
		require.NoError(w.t, err)
		d, e := tally(items)
		done, errs = done+d, errs+e
		if next == "" {
			return done, errs
		}
		cont = next
	}
}

// tally counts the Provisioned hosts and those in Error among items.
func tally(items []store.Item) (done, errs int) {
	for _, it := range items {
		switch it.Msg.(*typesv1.Host).GetStatus().GetState() {
		case typesv1.HostState_HOST_STATE_PROVISIONED:
			done++
		case typesv1.HostState_HOST_STATE_ERROR:
			errs++
		}
	}
	return done, errs
}

// peakRSS is the process's peak resident set (VmHWM), in bytes.
func peakRSS(b *testing.B) int64 { return procStatus(b, "VmHWM:") }

// rss is the process's resident set now (VmRSS), in bytes.
func rss(b *testing.B) int64 { return procStatus(b, "VmRSS:") }

// procStatus is the kB field of /proc/self/status, in bytes.
func procStatus(b *testing.B, field string) int64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		testenv.Skipf(b, "no /proc/self/status: %v", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), field); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10
		}
	}
	return 0
}
