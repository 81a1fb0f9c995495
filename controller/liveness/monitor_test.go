package liveness_test

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/liveness"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/factshash"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

const (
	interval = 10 * time.Second
	silence  = 3 * interval
)

// clock is a settable time source.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }

func (c *clock) Add(d time.Duration) { c.mu.Lock(); defer c.mu.Unlock(); c.now = c.now.Add(d) }

// env is a real store (embedded etcd) with hosts and controller replicas
// over it: each replica an enrollment service (the Agents.Heartbeat
// handler's domain side) and a liveness monitor sharing its tracker.
type env struct {
	t      *testing.T
	ctx    context.Context
	client *clientv3.Client
	st     *store.Store
	rec    *events.Recorder
	clock  *clock
	live   map[string]bool
}

type replica struct {
	enr *enrollment.Service
	mon *liveness.Monitor
}

func newEnv(t *testing.T) *env {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	e, err := store.StartEmbedded(ctx, store.EmbeddedConfig{DataDir: filepath.Join(t.TempDir(), "etcd")})
	require.NoError(t, err)
	t.Cleanup(e.Close)
	c, err := store.Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	clk := &clock{now: time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)}
	return &env{t: t, ctx: ctx, client: c, st: store.New(c), rec: events.New(c, time.Hour, clk.Now, slog.New(slog.DiscardHandler)), clock: clk, live: map[string]bool{}}
}

func (e *env) replica(id string) *replica {
	e.live[id] = true
	tr := liveness.NewTracker()
	log := slog.New(slog.DiscardHandler)
	return &replica{
		enr: enrollment.New(e.st, nil, e.rec, enrollment.Config{HeartbeatInterval: interval, Clock: e.clock.Now, Replica: id, Tracker: tr}, log),
		mon: liveness.NewMonitor(e.st, e.rec, tr, liveness.MonitorConfig{
			Replica: id, Silence: silence, Clock: e.clock.Now,
			Live: func(context.Context) (map[string]bool, error) { return e.live, nil },
		}, log),
	}
}

func (e *env) hosts(n int) []string {
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("idle-%03d", i)
		_, err := e.st.Create(e.ctx, "hosts", names[i], &typesv1.Host{
			ApiVersion: "kiln.dev/v1", Kind: "Host",
			Metadata: &typesv1.ObjectMeta{Name: names[i], Generation: 1},
			Spec:     &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "none"}},
		})
		require.NoError(e.t, err)
	}
	return names
}

// beat sends host's heartbeat to r as a current agent does: the hash
// always, the facts when r asks for them.
func (e *env) beat(r *replica, host string) {
	e.t.Helper()
	facts := &typesv1.Facts{Hostname: host, AgentMode: "installed", BootSource: "disk", AgentVersion: "v1"}
	req := enrollment.HeartbeatRequest{AgentAddress: host + ":7441", Version: "v1", FactsSHA256: factshash.Sum(facts)}
	res, err := r.enr.SimulatedHeartbeat(e.ctx, host, req)
	require.NoError(e.t, err)
	if res.FactsWanted {
		req.Facts = facts
		res, err = r.enr.SimulatedHeartbeat(e.ctx, host, req)
		require.NoError(e.t, err)
		require.False(e.t, res.FactsWanted, "facts asked for again after they were sent")
	}
}

// revision is etcd's revision: it grows by one with every write.
func (e *env) revision() int64 {
	resp, err := e.client.Get(e.ctx, "/kiln/probe")
	require.NoError(e.t, err)
	return resp.Header.Revision
}

func (e *env) host(name string) *typesv1.Host {
	h := &typesv1.Host{}
	_, err := e.st.Get(e.ctx, "hosts", name, h)
	require.NoError(e.t, err)
	return h
}

func (e *env) reachable(name string) string {
	return conditions.Get(e.host(name).GetStatus().GetConditions(), liveness.ConditionAgentReachable).GetStatus()
}

// TestIdleAgentsWriteNothing: idle agents heartbeating for many intervals
// cost no etcd write after their first check-in, and each one is tracked
// in memory instead.
func TestIdleAgentsWriteNothing(t *testing.T) {
	e := newEnv(t)
	a := e.replica("a")
	names := e.hosts(50)
	for _, n := range names {
		e.beat(a, n)
	}
	for _, n := range names {
		h := e.host(n)
		require.Equal(t, "installed", h.GetStatus().GetAgent().GetMode(), "facts recorded at the first check-in")
		require.Equal(t, "a", h.GetStatus().GetAgent().GetController())
	}
	// Every write of the first check-ins (hosts, AgentReachable events)
	// is done: the events recorder writes synchronously.
	before := e.revision()
	for range 6 {
		e.clock.Add(interval)
		for _, n := range names {
			e.beat(a, n)
		}
		marked, err := a.mon.Check(e.ctx)
		require.NoError(t, err)
		require.Empty(t, marked, "hosts marked silent while heartbeating")
	}
	if got := e.revision() - before; got != 0 {
		t.Errorf("etcd writes during 6 intervals of %d idle agents = %d, want 0", len(names), got)
	}
	if got := a.enr.Tracker().Len(); got != len(names) {
		t.Errorf("tracked agents = %d, want %d", got, len(names))
	}
}

// TestSilentAgentMarkedWithinThreeIntervals: an agent that stops is
// marked AgentReachable=False by the replica holding it once the silence
// (3 intervals) has passed, not before; its next heartbeat writes it
// reachable again.
func TestSilentAgentMarkedWithinThreeIntervals(t *testing.T) {
	e := newEnv(t)
	a := e.replica("a")
	names := e.hosts(3)
	for _, n := range names {
		e.beat(a, n)
	}
	quiet := names[1]
	for range 3 {
		e.clock.Add(interval)
		e.beat(a, names[0])
		e.beat(a, names[2])
	}
	// 30 s since quiet's last heartbeat: exactly the silence, not more.
	marked, err := a.mon.Check(e.ctx)
	require.NoError(t, err)
	require.Empty(t, marked)
	e.clock.Add(time.Second)
	marked, err = a.mon.Check(e.ctx)
	require.NoError(t, err)
	require.Equal(t, []string{quiet}, marked)
	require.Equal(t, conditions.False, e.reachable(quiet))
	require.Equal(t, conditions.True, e.reachable(names[0]))
	// Marked once: later checks write nothing.
	before := e.revision()
	e.clock.Add(interval)
	e.beat(a, names[0])
	e.beat(a, names[2])
	marked, err = a.mon.Check(e.ctx)
	require.NoError(t, err)
	require.Empty(t, marked)
	require.Zero(t, e.revision()-before, "writes after the host was marked")

	e.beat(a, quiet)
	require.Equal(t, conditions.True, e.reachable(quiet), "AgentReachable after the agent came back")
	evs, err := e.rec.List(e.ctx, "hosts", quiet, 0)
	require.NoError(t, err)
	var reasons []string
	for _, ev := range evs {
		reasons = append(reasons, ev.GetReason())
	}
	require.Contains(t, reasons, liveness.ReasonHeartbeatMissed)
}

// TestReplicas: with two controller replicas, the one that receives an
// agent's heartbeats judges it; an agent that moves costs one write; the
// other replica never marks a host whose agent heartbeats elsewhere; the
// hosts of a replica that died are adopted by a live one and still
// marked when their agent is silent.
func TestReplicas(t *testing.T) {
	e := newEnv(t)
	a, b := e.replica("a"), e.replica("b")
	names := e.hosts(2)
	moving, orphan := names[0], names[1]
	e.beat(a, moving)
	e.beat(b, orphan)

	// moving's agent switches to replica b (a load balancer moved it):
	// one write, recording b as the holder.
	before := e.revision()
	e.clock.Add(interval)
	e.beat(b, moving)
	e.beat(b, orphan)
	require.Equal(t, int64(1), e.revision()-before, "writes when an agent moves to another replica")
	require.Equal(t, "b", e.host(moving).GetStatus().GetAgent().GetController())

	// Replica a still remembers moving from before, but b holds it now.
	for range 4 {
		e.clock.Add(interval)
		e.beat(b, moving)
		e.beat(b, orphan)
	}
	marked, err := a.mon.Check(e.ctx)
	require.NoError(t, err)
	require.Empty(t, marked, "replica a marked a host whose agent heartbeats to b")
	require.Equal(t, conditions.True, e.reachable(moving))

	// Replica b dies, and with it orphan's agent (same rack). Replica a
	// adopts b's hosts and marks the silent one one silence later.
	delete(e.live, "b")
	require.NoError(t, a.mon.Adopt(e.ctx))
	e.clock.Add(silence + time.Second)
	marked, err = a.mon.Check(e.ctx)
	require.NoError(t, err)
	require.ElementsMatch(t, []string{moving, orphan}, marked, "hosts of the dead replica whose agents are silent")

	// moving's agent is alive: it reconnects to a, which writes it back.
	e.beat(a, moving)
	require.Equal(t, conditions.True, e.reachable(moving))
	require.Equal(t, "a", e.host(moving).GetStatus().GetAgent().GetController())
	require.Equal(t, conditions.False, e.reachable(orphan))
}

// TestRestartAdopts: a replica restarted with an empty memory adopts the
// hosts it held, so an agent that died while it was down is still marked
// one silence after the restart, and live agents cost no write.
func TestRestartAdopts(t *testing.T) {
	e := newEnv(t)
	a := e.replica("a")
	names := e.hosts(2)
	for _, n := range names {
		e.beat(a, n)
	}
	a = e.replica("a") // restarted: new tracker
	require.NoError(t, a.mon.Adopt(e.ctx))
	before := e.revision()
	for range 3 {
		e.clock.Add(interval)
		e.beat(a, names[0])
	}
	require.Zero(t, e.revision()-before, "writes of a live agent after the restart")
	e.clock.Add(time.Second)
	marked, err := a.mon.Check(e.ctx)
	require.NoError(t, err)
	require.Equal(t, []string{names[1]}, marked)
}

// TestOldAgent: an agent from before facts hashes (facts in full every
// minute, none in between, no hash) still checks in, and writes only when
// its facts change.
func TestOldAgent(t *testing.T) {
	e := newEnv(t)
	a := e.replica("a")
	name := e.hosts(1)[0]
	facts := &typesv1.Facts{Hostname: name, AgentMode: "boot", BootSource: "pxe"}
	send := func(f *typesv1.Facts) {
		res, err := a.enr.SimulatedHeartbeat(e.ctx, name, enrollment.HeartbeatRequest{AgentAddress: "10.0.0.9:7441", Version: "v0", Facts: f})
		require.NoError(t, err)
		require.False(t, res.FactsWanted, "facts asked of an agent that sends no hash")
	}
	send(facts)
	require.Equal(t, "boot", e.host(name).GetStatus().GetAgent().GetMode())
	before := e.revision()
	for i := range 12 {
		e.clock.Add(interval)
		if i%6 == 5 {
			send(facts)
		} else {
			send(nil)
		}
	}
	require.Zero(t, e.revision()-before, "writes of an old agent whose facts did not change")
	send(&typesv1.Facts{Hostname: name, AgentMode: "installed", BootSource: "disk"})
	h := e.host(name)
	require.Equal(t, "installed", h.GetStatus().GetAgent().GetMode())
	require.True(t, h.GetStatus().GetAgent().GetLastHeartbeat().AsTime().Equal(e.clock.Now()))
}
