package sim_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/provision"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// inFlight follows the hosts in the store through a watch and counts
// those Provisioning after each change, as an operator's `kilnctl get
// hosts -w` would see them.
type inFlight struct {
	mu    sync.Mutex
	state map[string]typesv1.HostState
	count int
	max   int
	// starts counts the hosts that entered Provisioning; over counts
	// those that entered it while limit or more were already in flight.
	starts, over int
	limit        int
}

// follow counts from revision rev until ctx ends; every host must be
// known at rev (states gives their state then).
func (w *world) follow(ctx context.Context, rev int64, limit int) *inFlight {
	f := &inFlight{state: map[string]typesv1.HostState{}, limit: limit}
	items, _, err := w.st.List(ctx, "hosts", func() proto.Message { return &typesv1.Host{} }, store.ListOptions{})
	require.NoError(w.t, err)
	for _, it := range items {
		f.state[it.Name] = it.Msg.(*typesv1.Host).GetStatus().GetState()
		if f.state[it.Name] == typesv1.HostState_HOST_STATE_PROVISIONING {
			f.count++
		}
	}
	f.max = f.count
	evs := w.st.Watch(ctx, "hosts", rev)
	go func() {
		for ev := range evs {
			if ev.Err != nil || len(ev.Value) == 0 {
				continue
			}
			h := &typesv1.Host{}
			if proto.Unmarshal(ev.Value, h) != nil {
				continue
			}
			f.observe(ev.Name, h.GetStatus().GetState())
		}
	}()
	return f
}

func (f *inFlight) observe(name string, st typesv1.HostState) {
	f.mu.Lock()
	defer f.mu.Unlock()
	const prov = typesv1.HostState_HOST_STATE_PROVISIONING
	was := f.state[name]
	f.state[name] = st
	switch {
	case was != prov && st == prov:
		f.starts++
		if f.count >= f.limit {
			f.over++
		}
		f.count++
	case was == prov && st != prov:
		f.count--
	}
	f.max = max(f.max, f.count)
}

func (f *inFlight) get() (count, maxSeen, starts, over int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.count, f.max, f.starts, f.over
}

// TestAdmissionBoundsHostsInFlight: 30 hosts with room for 4 at a time.
// Watched from the store, never more than 4 hosts are Provisioning, 4
// are at some point (the limit is used, not just respected), and every
// host ends Provisioned, laid once.
func TestAdmissionBoundsHostsInFlight(t *testing.T) {
	const n, limit = 30, 4
	w := newWorld(t, fastSim)
	w.cfg.MaxInFlight = limit
	names, err := sim.Populate(w.ctx, w.st, n, "adm")
	require.NoError(t, err)
	f := w.follow(w.ctx, w.revision()+1, limit)
	stop := w.start()
	defer stop()
	w.waitFor(names, "Provisioned", provisioned)
	w.checkProvisionedOnce(names)
	require.Eventually(t, func() bool { _, _, starts, _ := f.get(); return starts == n }, time.Minute, 10*time.Millisecond,
		"the watch sees every host start")
	_, maxSeen, _, over := f.get()
	if maxSeen != limit || over != 0 {
		t.Errorf("hosts Provisioning at once, seen from the store: max %d (%d starts beyond the limit), want max %d and none beyond", maxSeen, over, limit)
	}
	for _, name := range names {
		// Every host that waited says it was admitted.
		c := conditions.Get(w.host(name).GetStatus().GetConditions(), provision.ConditionAdmitted)
		if c != nil && c.GetStatus() != conditions.True {
			t.Errorf("host %s: %s = %v after it was provisioned, want True", name, provision.ConditionAdmitted, c)
		}
	}
}

// startLine starts an executor with limit slots on n new hosts whose lays
// are paused: limit of them lay, the others wait in the line.
func startLine(t *testing.T, n, limit int, prefix string) (*world, []string) {
	w := newWorld(t, fastSim)
	w.cfg.MaxInFlight = limit
	names, err := sim.Populate(w.ctx, w.st, n, prefix)
	require.NoError(t, err)
	w.fleet.PauseLays()
	t.Cleanup(w.start())
	return w, names
}

// TestDefaultWorkersLayEveryAdmittedHost: with the executor's default
// workers, every admitted host lays at once. A lay holds a worker for its
// duration; the default was 64 workers whatever the admission limit, so a
// wave of 2,000 admitted hosts laid 64 at a time. Here 100 hosts, 80
// slots, lays held: 80 lay at once, 20 wait for a slot.
func TestDefaultWorkersLayEveryAdmittedHost(t *testing.T) {
	const n, limit = 100, 80
	w := newWorld(t, fastSim)
	w.cfg.MaxInFlight = limit
	w.cfg.Workers = 0 // the default
	names, err := sim.Populate(w.ctx, w.st, n, "wrk")
	require.NoError(t, err)
	w.fleet.PauseLays()
	t.Cleanup(w.start())
	laying, waiting := 0, 0
	require.Eventually(t, func() bool {
		laying, waiting = 0, 0
		for _, name := range names {
			h := w.host(name)
			switch {
			case h.GetStatus().GetProvisioningStep() == string(hostlife.StepLayImage):
				laying++
			case isWaiting(h):
				waiting++
			}
		}
		return laying == limit && waiting == n-limit
	}, 2*time.Minute, 50*time.Millisecond, "want %d hosts laying at once and %d waiting for a slot", limit, n-limit)
	w.fleet.ResumeLays()
	w.waitFor(names, "Provisioned", provisioned)
	w.checkProvisionedOnce(names)
}

// isWaiting reports whether h rests Available waiting for a slot.
func isWaiting(h *typesv1.Host) bool {
	c := conditions.Get(h.GetStatus().GetConditions(), provision.ConditionAdmitted)
	return h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_AVAILABLE &&
		c.GetStatus() == conditions.False && c.GetReason() == provision.ReasonWaiting
}

// TestWaitingHostsSayWhy is what an operator checks when hosts do not
// start: with 2 slots and the first 2 hosts' lays held, the other hosts
// are Available and say they wait for a slot, how many are in flight and
// the limit (what `kilnctl describe host` shows under Conditions, and
// `kilnctl get hosts` as the blocking condition); once the lays go on,
// they start and end Provisioned, admitted.
func TestWaitingHostsSayWhy(t *testing.T) {
	const n, limit = 6, 2
	w, names := startLine(t, n, limit, "why")
	var laying, waiting []string
	require.Eventually(t, func() bool {
		laying, waiting = nil, nil
		for _, name := range names {
			h := w.host(name)
			switch {
			case h.GetStatus().GetProvisioningStep() == string(hostlife.StepLayImage):
				laying = append(laying, name)
			case isWaiting(h):
				waiting = append(waiting, name)
			}
		}
		return len(laying) == limit && len(waiting) == n-limit
	}, time.Minute, 20*time.Millisecond, "%d hosts laying and %d waiting for a slot", limit, n-limit)

	for _, name := range waiting {
		h := w.host(name)
		c := conditions.Get(h.GetStatus().GetConditions(), provision.ConditionAdmitted)
		want := "waiting for a provisioning slot (2 in flight, limit 2)"
		if !strings.Contains(c.GetMessage(), want) || !strings.Contains(c.GetMessage(), "--provision-max-in-flight") {
			t.Errorf("host %s: %s message %q, want it to say %q and name the flag", name, provision.ConditionAdmitted, c.GetMessage(), want)
		}
		if got := conditions.Blocking(h.GetStatus().GetConditions()); len(got) == 0 || got[0].GetType() != provision.ConditionAdmitted {
			t.Errorf("host %s: blocking conditions %v, want %s first", name, got, provision.ConditionAdmitted)
		}
		if got := w.fleet.Host(name).Lays(); got != 0 {
			t.Errorf("host %s waiting: laid %d times, want 0", name, got)
		}
	}

	w.fleet.ResumeLays()
	w.waitFor(names, "Provisioned", provisioned)
	w.checkProvisionedOnce(names)
	for _, name := range waiting {
		c := conditions.Get(w.host(name).GetStatus().GetConditions(), provision.ConditionAdmitted)
		if c.GetStatus() != conditions.True || c.GetReason() != provision.ReasonAdmitted {
			t.Errorf("host %s after it was provisioned: %s = %v, want True (%s)", name, provision.ConditionAdmitted, c, provision.ReasonAdmitted)
		}
	}
}

// TestWaitingHostWhoseMachineGoes: a host waiting for a slot whose
// Machine is deleted (the cluster executor unbinds the host, then deletes
// the Machine) leaves the line at once: its ProvisioningAdmitted=False
// goes (no stale WaitingForSlot in kilnctl get hosts), it is never laid,
// and the other hosts still end Provisioned.
func TestWaitingHostWhoseMachineGoes(t *testing.T) {
	const n, limit = 4, 1
	w, names := startLine(t, n, limit, "gone")
	var waiting []string
	require.Eventually(t, func() bool {
		waiting = nil
		for _, name := range names {
			if isWaiting(w.host(name)) {
				waiting = append(waiting, name)
			}
		}
		return len(waiting) == n-limit
	}, time.Minute, 20*time.Millisecond, "%d hosts waiting for a slot", n-limit)

	// Unbind the last in line, as clusterexec's unbind does, and delete
	// its Machine.
	gone := waiting[len(waiting)-1]
	h := &typesv1.Host{}
	rev, err := w.st.Get(w.ctx, "hosts", gone, h)
	require.NoError(t, err)
	machine := h.GetStatus().GetMachine()
	h.Status.Machine = ""
	_, err = w.st.Update(w.ctx, "hosts", gone, h, rev)
	require.NoError(t, err)
	require.NoError(t, w.st.Delete(w.ctx, "machines", machine, 0))

	require.Eventually(t, func() bool {
		_, inLine := w.ex.InFlight()
		return conditions.Get(w.host(gone).GetStatus().GetConditions(), provision.ConditionAdmitted) == nil && inLine == n-limit-1
	}, time.Minute, 20*time.Millisecond, "host %s out of the line, without %s", gone, provision.ConditionAdmitted)
	require.Equal(t, typesv1.HostState_HOST_STATE_AVAILABLE, w.host(gone).GetStatus().GetState())

	w.fleet.ResumeLays()
	var rest []string
	for _, name := range names {
		if name != gone {
			rest = append(rest, name)
		}
	}
	w.waitFor(rest, "Provisioned", provisioned)
	w.checkProvisionedOnce(rest)
	require.Zero(t, w.fleet.Host(gone).Lays(), "host %s laid after its Machine went", gone)
	require.Nil(t, conditions.Get(w.host(gone).GetStatus().GetConditions(), provision.ConditionAdmitted))
}

// TestHostsInFlightAfterRestartCount: a controller restarted with 6 hosts
// laying and a limit of 3 lets the 6 go on and starts no other host until
// fewer than 3 are in flight, as counted from the store; then every host
// ends Provisioned, laid once.
func TestHostsInFlightAfterRestartCount(t *testing.T) {
	const n = 10
	w := newWorld(t, fastSim)
	w.cfg.MaxInFlight = 6
	names, err := sim.Populate(w.ctx, w.st, n, "rst")
	require.NoError(t, err)
	w.fleet.PauseLays()
	stop := w.start()
	countLaying := func() int {
		c := 0
		for _, name := range names {
			if w.host(name).GetStatus().GetProvisioningStep() == string(hostlife.StepLayImage) {
				c++
			}
		}
		return c
	}
	require.Eventually(t, func() bool { return countLaying() == 6 }, time.Minute, 20*time.Millisecond, "6 hosts laying")
	stop()

	const limit = 3
	w.cfg.MaxInFlight = limit
	f := w.follow(w.ctx, w.revision()+1, limit)
	count, _, _, _ := f.get()
	require.Equal(t, 6, count, "hosts Provisioning when the controller restarts")
	stop = w.start()
	defer stop()
	w.fleet.ResumeLays()
	w.waitFor(names, "Provisioned", provisioned)
	w.checkProvisionedOnce(names)
	require.Eventually(t, func() bool { _, _, starts, _ := f.get(); return starts == n-6 }, time.Minute, 10*time.Millisecond,
		"the watch sees the other hosts start")
	if _, maxSeen, _, over := f.get(); maxSeen != 6 || over != 0 {
		t.Errorf("after the restart: max %d Provisioning, %d hosts started with %d or more in flight; want max 6 (those found in flight) and none", maxSeen, over, limit)
	}
}
