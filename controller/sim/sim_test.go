package sim_test

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/provision"
	"github.com/kilnhq/kiln/controller/resources"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// world is a real store (embedded etcd), the real enrollment service for
// check-ins, a simulated fleet and executors over them.
type world struct {
	t      testing.TB
	dir    string
	ctx    context.Context
	client *clientv3.Client
	st     *store.Store
	rec    *events.Recorder
	fleet  *sim.Fleet
	cfg    provision.Config
	// caches are the replica's watch caches, run as kiln-controller runs
	// them: the executors read the hosts' desired state
	// (provision.CachedDesired) and their resync (provision.Deps.Hosts)
	// from them, and idle heartbeats their Host (enrollment.UseHostCache).
	caches *resources.Caches
	// ex is the executor start started last.
	ex *provision.Executor
}

// fastSim are the delays of the tests: short, and in the proportions of a
// rack (boot and lay dominate).
var fastSim = sim.Config{
	BMCLatency:        2 * time.Millisecond,
	BootDelay:         30 * time.Millisecond,
	LayDuration:       80 * time.Millisecond,
	WipeDuration:      20 * time.Millisecond,
	HeartbeatInterval: 500 * time.Millisecond,
	Jitter:            0.5,
}

var fastPlan = hostlife.Config{
	PollInterval: 200 * time.Millisecond,
	Backoff:      backoff.Policy{Base: 20 * time.Millisecond, Max: 200 * time.Millisecond, Factor: 2},
	MaxAttempts:  5,
}

func newWorld(t testing.TB, simCfg sim.Config) *world {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	dir := filepath.Join(t.TempDir(), "etcd")
	e, err := store.StartEmbedded(ctx, store.EmbeddedConfig{DataDir: dir, Compaction: compactionFromEnv(t)})
	require.NoError(t, err)
	t.Cleanup(e.Close)
	c, err := store.Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	st := store.New(c, store.WithGroupCommit(groupCommitFromEnv(t)))
	log := slog.New(slog.DiscardHandler)
	rec := events.NewWithConfig(c, events.Config{Read: st.GetKey}, log)
	enr := enrollment.New(st, nil, rec, enrollment.Config{}, log)
	w := &world{t: t, dir: dir, ctx: ctx, client: c, st: st, rec: rec, caches: resources.NewCaches(st)}
	enr.UseHostCache(w.caches.Kind("hosts"), st)
	cctx, stopCaches := context.WithCancel(ctx)
	var cachesDone sync.WaitGroup
	cachesDone.Go(func() { w.caches.Run(cctx) })
	cachesDone.Go(func() { enr.RunHostCache(cctx) })
	t.Cleanup(func() { stopCaches(); cachesDone.Wait() }) // before etcd closes
	w.fleet = sim.NewFleet(ctx, simCfg, sim.EnrollmentCheckIn(enr))
	w.cfg = provision.Config{
		Workers:        16,
		Plan:           fastPlan,
		ISOURL:         func(h string) string { return "http://boot.sim/boot/iso/" + h + ".iso" },
		ResyncInterval: time.Second,
	}
	return w
}

// groupCommitFromEnv is the store's grouping of writes and Gets
// (store.GroupCommit) as KILN_BENCH_GROUP_COMMIT sets it: "off" sends
// every write and every Get alone, N allows N grouped transactions (and
// N read groups) in flight; unset, the default. KILN_BENCH_GROUP_READS=off
// sends every Get alone, the writes still grouped.
// KILN_BENCH_GROUP_MAX_OPS=N sets its op bound (the embedded etcd takes
// store.MaxBatchOps).
// compactionFromEnv is the embedded member's compaction: the defaults,
// but for KILN_BENCH_MAX_HISTORY_MIB (store.Compaction.MaxHistoryBytes,
// in MiB) when set.
func compactionFromEnv(t testing.TB) store.Compaction {
	var c store.Compaction
	if v := os.Getenv("KILN_BENCH_MAX_HISTORY_MIB"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		require.NoError(t, err, "KILN_BENCH_MAX_HISTORY_MIB")
		c.MaxHistoryBytes = n << 20
	}
	return c
}

func groupCommitFromEnv(t testing.TB) store.GroupCommit {
	var g store.GroupCommit
	switch v := os.Getenv("KILN_BENCH_GROUP_COMMIT"); v {
	case "":
	case "off":
		g.Disabled = true
	default:
		n, err := strconv.Atoi(v)
		require.NoError(t, err, "KILN_BENCH_GROUP_COMMIT: want off or a number of transactions in flight")
		g.MaxInFlight = n
	}
	switch v := os.Getenv("KILN_BENCH_GROUP_READS"); v {
	case "", "on":
	case "off":
		g.DisableReads = true
	default:
		t.Fatalf("KILN_BENCH_GROUP_READS=%q: want off or on", v)
	}
	if v := os.Getenv("KILN_BENCH_GROUP_MAX_OPS"); v != "" {
		n, err := strconv.Atoi(v)
		require.NoError(t, err, "KILN_BENCH_GROUP_MAX_OPS")
		g.MaxOps = n
	}
	return g
}

// start runs an executor until the returned stop is called; stop waits
// for it to end.
func (w *world) start() (stop func()) {
	ctx, cancel := context.WithCancel(w.ctx)
	ex := provision.New(provision.Deps{
		Store:    w.st,
		Recorder: w.rec,
		BMCs:     w.fleet.BMCDialer(),
		Agents:   w.fleet.AgentDialer(),
		Desired:  provision.CachedDesired(w.st, w.caches.Kind("machines"), w.caches.Kind("images")),
		Hosts:    w.caches.Kind("hosts"),
	}, w.cfg, slog.New(slog.DiscardHandler))
	w.ex = ex
	done := make(chan struct{})
	go func() { defer close(done); _ = ex.Run(ctx) }()
	return func() { cancel(); <-done }
}

func (w *world) host(name string) *typesv1.Host {
	h := &typesv1.Host{}
	_, err := w.st.Get(w.ctx, "hosts", name, h)
	require.NoError(w.t, err)
	return h
}

// waitFor watches the hosts until cond holds for every host in names, or
// fails the test after a generous bound (no timing is asserted: the bound
// only stops a hung test).
func (w *world) waitFor(names []string, what string, cond func(*typesv1.Host) bool) {
	w.t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		pending := 0
		var example *typesv1.Host
		for _, n := range names {
			if h := w.host(n); !cond(h) {
				pending++
				example = h
			}
		}
		if pending == 0 {
			return
		}
		if what != "Error" && example.GetStatus().GetState() == typesv1.HostState_HOST_STATE_ERROR {
			w.t.Fatalf("host %s went to Error: %s", example.GetMetadata().GetName(), example.GetStatus().GetErrorReason())
		}
		if time.Now().After(deadline) {
			w.t.Fatalf("%d of %d hosts not %s; e.g. %s in %s step %s, last error %q",
				pending, len(names), what, example.GetMetadata().GetName(), hostlife.StateName(example.GetStatus().GetState()),
				example.GetStatus().GetProvisioningStep(), example.GetStatus().GetLastError())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func provisioned(h *typesv1.Host) bool {
	return h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_PROVISIONED
}

// checkProvisionedOnce asserts what an operator would: every host is
// Provisioned with the image, booted its installed agent, and the image
// was laid on it exactly once (by the agent's count and by the status).
func (w *world) checkProvisionedOnce(names []string) {
	w.t.Helper()
	for _, n := range names {
		h := w.host(n)
		s := h.GetStatus()
		if s.GetState() != typesv1.HostState_HOST_STATE_PROVISIONED || s.GetImage() != sim.ImageName {
			w.t.Errorf("host %s: state %s image %q, want Provisioned with %s", n, hostlife.StateName(s.GetState()), s.GetImage(), sim.ImageName)
		}
		if !conditions.IsTrue(s.GetConditions(), hostlife.ConditionProvisioned) {
			w.t.Errorf("host %s: condition Provisioned = %v, want True", n, conditions.Get(s.GetConditions(), hostlife.ConditionProvisioned))
		}
		if got := w.fleet.Host(n).Lays(); got != 1 {
			w.t.Errorf("host %s: agent laid the image %d times, want 1", n, got)
		}
		if got := s.GetImageLays(); got != 1 {
			w.t.Errorf("host %s: status.image_lays = %d, want 1", n, got)
		}
		if got := w.fleet.Host(n).Running(); got != "installed" {
			w.t.Errorf("host %s: running agent %q, want installed", n, got)
		}
	}
}

func TestFiftyHostsProvisioned(t *testing.T) {
	w := newWorld(t, fastSim)
	names, err := sim.Populate(w.ctx, w.st, 50, "rack1")
	require.NoError(t, err)
	stop := w.start()
	defer stop()
	w.waitFor(names, "Provisioned", provisioned)
	w.checkProvisionedOnce(names)

	// Events tell the story of a host.
	evs, err := w.rec.List(w.ctx, "hosts", names[0], 0)
	require.NoError(t, err)
	var reasons []string
	for _, e := range evs {
		reasons = append(reasons, e.GetReason())
	}
	require.Subset(t, reasons, []string{"Registering", "Available", "Provisioning", "ImageLaid", "Provisioned"})
}

func TestFailingBMCBacksOffAndRecovers(t *testing.T) {
	w := newWorld(t, fastSim)
	names, err := sim.Populate(w.ctx, w.st, 10, "rack2")
	require.NoError(t, err)
	bad := names[3]
	w.fleet.Host(bad).BMC().Fail()
	stop := w.start()
	defer stop()

	others := append(append([]string(nil), names[:3]...), names[4:]...)
	w.waitFor(others, "Provisioned", provisioned)

	// The bad host is still trying: not in Error, BMCReachable=False,
	// a last error, and a backoff before the next try.
	h := w.host(bad)
	s := h.GetStatus()
	if s.GetState() == typesv1.HostState_HOST_STATE_ERROR || provisioned(h) {
		t.Fatalf("host %s with a failing BMC: state %s, want it still in its step", bad, hostlife.StateName(s.GetState()))
	}
	if c := conditions.Get(s.GetConditions(), "BMCReachable"); c.GetStatus() != conditions.False {
		t.Errorf("host %s: BMCReachable = %v, want False", bad, c)
	}
	if s.GetLastError() == "" {
		t.Errorf("host %s: last_error is empty, want the BMC failure", bad)
	}
	calls := w.fleet.Host(bad).BMC().Calls()
	require.Greater(t, calls, 1, "the failing BMC is retried")

	w.fleet.Host(bad).BMC().Heal()
	w.waitFor([]string{bad}, "Provisioned", provisioned)
	w.checkProvisionedOnce(names)
	if c := conditions.Get(w.host(bad).GetStatus().GetConditions(), "BMCReachable"); c.GetStatus() != conditions.True {
		t.Errorf("host %s after the BMC recovered: BMCReachable = %v, want True", bad, c)
	}
}

func TestLyingPowerAndFailedLayRecover(t *testing.T) {
	w := newWorld(t, fastSim)
	names, err := sim.Populate(w.ctx, w.st, 4, "rack3")
	require.NoError(t, err)
	w.fleet.Host(names[0]).BMC().Lie(2)
	w.fleet.Host(names[1]).FailLays(1)
	stop := w.start()
	defer stop()
	w.waitFor(names, "Provisioned", provisioned)
	w.checkProvisionedOnce(names)
}

func TestBootSourceMismatchIsAnError(t *testing.T) {
	w := newWorld(t, fastSim)
	names, err := sim.Populate(w.ctx, w.st, 1, "rack4")
	require.NoError(t, err)
	stop := w.start()
	defer stop()
	w.waitFor(names, "Provisioned", provisioned)
	stop()

	// The image is replaced: the host deprovisions through the boot agent.
	// Its firmware now ignores the one-time override and boots the disk.
	h := w.fleet.Host(names[0])
	h.IgnoreBootOverride(true)
	m := &typesv1.Machine{}
	rev, err := w.st.Get(w.ctx, "machines", "m-"+names[0], m)
	require.NoError(t, err)
	img := &typesv1.Image{}
	_, err = w.st.Get(w.ctx, "images", sim.ImageName, img)
	require.NoError(t, err)
	img.Metadata.Name = "debian12-k8s1.34.5-20261202"
	_, err = w.st.Create(w.ctx, "images", img.Metadata.Name, img)
	require.NoError(t, err)
	m.Spec.Image = img.Metadata.Name
	_, err = w.st.Update(w.ctx, "machines", m.Metadata.Name, m, rev)
	require.NoError(t, err)
	stop = w.start()
	defer stop()
	w.waitFor(names, "Error", func(h *typesv1.Host) bool {
		return h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_ERROR
	})
	got := w.host(names[0]).GetStatus().GetErrorReason()
	require.Contains(t, got, "BootSourceMismatch")
	require.Contains(t, got, "booted from disk")
}

// TestCrashSafety stops the controller's executor at random points of a
// 20-host wave and starts a new one over the same etcd; every host ends
// Provisioned, with its image laid exactly once.
func TestCrashSafety(t *testing.T) {
	w := newWorld(t, fastSim)
	names, err := sim.Populate(w.ctx, w.st, 20, "rack5")
	require.NoError(t, err)
	r := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	// Crashes count only while hosts are still on their way.
	crashes := 0
	for crashes < 6 {
		stop := w.start()
		time.Sleep(time.Duration(5+r.IntN(25)+10*crashes) * time.Millisecond)
		stop()
		done := 0
		for _, n := range names {
			if provisioned(w.host(n)) {
				done++
			}
		}
		if done == len(names) {
			break
		}
		crashes++
		t.Logf("crash %d: %d of %d hosts provisioned", crashes, done, len(names))
	}
	require.GreaterOrEqual(t, crashes, 5, "crashes during the wave")
	stop := w.start()
	defer stop()
	w.waitFor(names, "Provisioned", provisioned)
	w.checkProvisionedOnce(names)
}

// TestUnboundHostIsWipedAndAvailable: a provisioned host whose Machine is
// deleted boots the agent again, has its disk wiped, is powered off and
// becomes Available.
func TestUnboundHostIsWipedAndAvailable(t *testing.T) {
	w := newWorld(t, fastSim)
	names, err := sim.Populate(w.ctx, w.st, 2, "rack6")
	require.NoError(t, err)
	stop := w.start()
	defer stop()
	w.waitFor(names, "Provisioned", provisioned)

	require.NoError(t, w.st.Delete(w.ctx, "machines", "m-"+names[0], 0))
	w.waitFor(names[:1], "Available", func(h *typesv1.Host) bool {
		return h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_AVAILABLE
	})
	h := w.host(names[0])
	if got := h.GetStatus().GetImage(); got != "" {
		t.Errorf("host %s after wiping: status.image = %q, want empty", names[0], got)
	}
	if got := h.GetStatus().GetPower(); got != "off" {
		t.Errorf("host %s after wiping: status.power = %q, want off", names[0], got)
	}
	if got := w.fleet.Host(names[0]).DiskImage(); got != "" {
		t.Errorf("host %s after wiping: disk holds %q, want blank", names[0], got)
	}
	if got := w.fleet.Host(names[0]).Running(); got != "" {
		t.Errorf("host %s after wiping: agent %q runs, want none (powered off)", names[0], got)
	}
	// The other host is untouched.
	w.checkProvisionedOnce(names[1:])
}

// TestLayProgressStored: a simulated lay reports its progress as a real
// agent does, and the executor stores it coarsely in the host's last
// operation, where the API (kilnctl get hosts -w, the dashboard) reads a
// lay part done with its rate and ETA while it runs.
func TestLayProgressStored(t *testing.T) {
	slowLay := fastSim
	slowLay.LayDuration, slowLay.Jitter = 2500*time.Millisecond, 0
	w := newWorld(t, slowLay)
	names, err := sim.Populate(w.ctx, w.st, 1, "rack8")
	require.NoError(t, err)
	stop := w.start()
	defer stop()
	var seen *typesv1.OperationProgress
	w.waitFor(names, "a lay part done", func(h *typesv1.Host) bool {
		op := h.GetStatus().GetLastOperation()
		p := op.GetProgress()
		if op.GetKind() == string(hostlife.StepLayImage) && op.GetState() == hostlife.OpRunning && p.GetPercent() > 0 && p.GetPercent() < 100 {
			seen = p
			return true
		}
		return false
	})
	t.Logf("stored while laying: %v", seen)
	if seen.GetStep() != "fetch" || seen.GetBytesPerSecond() <= 0 || seen.GetEtaSeconds() <= 0 || seen.GetTotalBytes() == 0 || seen.GetUpdated() == nil {
		t.Errorf("stored lay progress = %v, want step fetch with a rate, an ETA, a total and the time stored", seen)
	}
	w.waitFor(names, "Provisioned", provisioned)
	if p := w.host(names[0]).GetStatus().GetLastOperation().GetProgress(); p != nil {
		t.Errorf("host %s Provisioned: last operation progress = %v, want none (the lay's ended with it)", names[0], p)
	}
}

// TestPowerCutMidLay: a host that loses power while its image is laid
// is not stuck: the lay's timeout sends it back to power off and the boot
// agent, and the image is laid once.
func TestPowerCutMidLay(t *testing.T) {
	slowLay := fastSim
	slowLay.LayDuration = 400 * time.Millisecond
	w := newWorld(t, slowLay)
	w.cfg.Plan.Timeouts = map[hostlife.Step]time.Duration{hostlife.StepLayImage: time.Second}
	names, err := sim.Populate(w.ctx, w.st, 2, "rack7")
	require.NoError(t, err)
	stop := w.start()
	defer stop()
	w.waitFor(names[:1], "laying", func(h *typesv1.Host) bool {
		return h.GetStatus().GetProvisioningStep() == string(hostlife.StepLayImage)
	})
	w.fleet.Host(names[0]).PowerCut()
	w.waitFor(names, "Provisioned", provisioned)
	w.checkProvisionedOnce(names)
	if got := w.host(names[0]).GetStatus().GetLastOperation().GetAttempt(); got == 0 {
		t.Errorf("host %s: last operation attempt = 0, want the retry after the power cut counted", names[0])
	}
}

// TestLayEndingAfterItsTimeoutIsNotLaidAgain: an agent slowed down (a
// loaded host, a slow image server) finishes a lay after the controller's
// LayImage timeout but before the retry powers the host off. The retry
// must find the finished lay by its operation id and go on with it, not
// power the host off and lay the image a second time under a new id
// (10,049 lays for 10,000 hosts under load, docs/scale.md).
func TestLayEndingAfterItsTimeoutIsNotLaidAgain(t *testing.T) {
	simCfg := fastSim
	simCfg.Jitter = 0
	w := newWorld(t, simCfg)
	w.cfg.Plan.Timeouts = map[hostlife.Step]time.Duration{hostlife.StepLayImage: time.Second}
	// The retry powers off 500 ms after the timeout: the slow lay ends
	// about 200 ms after the timeout, in between.
	w.cfg.Plan.Backoff = backoff.Policy{Base: 500 * time.Millisecond, Max: time.Second, Factor: 2}
	names, err := sim.Populate(w.ctx, w.st, 1, "rack9")
	require.NoError(t, err)
	w.fleet.Host(names[0]).SlowLays(1, 1200*time.Millisecond)
	stop := w.start()
	defer stop()
	w.waitFor(names, "Provisioned", provisioned)
	w.checkProvisionedOnce(names)
	if got := w.fleet.Host(names[0]).Boots(); got != 2 {
		t.Errorf("host %s: %d boots, want 2 (the boot agent, then the installed agent; no power cycle for a second lay)", names[0], got)
	}
}

// loseOnce is a store whose first write of a host past step past fails
// after delay (as an etcd write does under load: "request timed out"), so
// the executor loses the result of the step before it.
type loseOnce struct {
	*store.Store
	past  string
	delay time.Duration
	lost  atomic.Bool
}

func (s *loseOnce) Update(ctx context.Context, kind, name string, m proto.Message, expectRev int64) (int64, error) {
	rev, _, err := s.UpdateWith(ctx, kind, name, m, expectRev, nil)
	return rev, err
}

// UpdateWith is the executor's status write (with the status's events).
func (s *loseOnce) UpdateWith(ctx context.Context, kind, name string, m proto.Message, expectRev int64, ops []clientv3.Op) (int64, []*etcdserverpb.ResponseOp, error) {
	if h, ok := m.(*typesv1.Host); ok && kind == provision.HostsKind && h.GetStatus().GetProvisioningStep() == s.past && s.lost.CompareAndSwap(false, true) {
		// A slow write that fails: the step before is past its timeout
		// when the executor plans again.
		time.Sleep(s.delay)
		return 0, nil, errdefs.Unavailable("update %s: injected: etcdserver: request timed out", name)
	}
	return s.Store.UpdateWith(ctx, kind, name, m, expectRev, ops)
}

// TestStepAfterLayWithLostResultIsNotLaidAgain: the status write that
// records WriteIdentity's success fails after 1.5 s, and the executor
// comes back to the host past WriteIdentity's 1 s timeout. The step must be
// asked again (it is idempotent), not timed out unasked: that retry starts
// from PowerOff and the boot agent lays the image a second time.
func TestStepAfterLayWithLostResultIsNotLaidAgain(t *testing.T) {
	w := newWorld(t, fastSim)
	w.cfg.Plan.Timeouts = map[hostlife.Step]time.Duration{hostlife.StepWriteIdentity: time.Second}
	names, err := sim.Populate(w.ctx, w.st, 1, "rack10")
	require.NoError(t, err)
	st := &loseOnce{Store: w.st, past: string(hostlife.StepBootDisk), delay: 1500 * time.Millisecond}
	ctx, cancel := context.WithCancel(w.ctx)
	ex := provision.New(provision.Deps{
		Store:    st,
		Recorder: w.rec,
		BMCs:     w.fleet.BMCDialer(),
		Agents:   w.fleet.AgentDialer(),
	}, w.cfg, slog.New(slog.DiscardHandler))
	done := make(chan struct{})
	go func() { defer close(done); _ = ex.Run(ctx) }()
	defer func() { cancel(); <-done }()
	w.waitFor(names, "Provisioned", provisioned)
	require.True(t, st.lost.Load(), "the write after WriteIdentity was not failed: the test tested nothing")
	w.checkProvisionedOnce(names)
}
