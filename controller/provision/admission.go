package provision

import (
	"container/list"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// DefaultMaxInFlight is how many hosts an executor has provisioning at
// once unless Config.MaxInFlight says otherwise.
const DefaultMaxInFlight = 2000

// Condition type and reasons of admission control.
const (
	// ConditionAdmitted is False (WaitingForSlot) on a host whose
	// provisioning waits for a slot, and True (Admitted) once a host that
	// waited started.
	ConditionAdmitted = "ProvisioningAdmitted"
	ReasonWaiting     = "WaitingForSlot"
	ReasonAdmitted    = "Admitted"
)

// admission bounds the hosts in flight: a host starts provisioning (its
// state becomes Provisioning, the write that records its first step) only
// while fewer than limit hosts are Provisioning. Hosts already
// Provisioning always go on and count: after a restart they are read back
// from the store before anyone is admitted (synced).
//
// A host refused a slot is stored as waiting (ConditionAdmitted False)
// and joins a first-in first-out line; each slot that frees wakes the
// next host of the line (queues it for a worker) and keeps the slot for
// it until it was planned. A host of the line is not planned meanwhile
// (Waiting): nothing it waits on can change but a slot.
//
// What it counts is what the store says: a host is in flight from the
// moment a worker reserves its slot (before the write that makes it
// Provisioning) to the write or delete that ends its Provisioning, so the
// Provisioning hosts in the store never outnumber limit, except for hosts
// already in flight when the executor started.
type admission struct {
	limit int // < 0: no limit
	wake  func(name string)

	mu sync.Mutex
	// inflight maps the hosts in flight to the revision at which they
	// were seen Provisioning; reserved for a slot taken and not yet
	// stored.
	inflight map[string]int64
	// line is the waiting hosts in order (of names); inLine indexes it.
	line   *list.List
	inLine map[string]*list.Element
	// woken are hosts taken from the line and queued, planning those a
	// worker plans now (begin); each holds a slot until it is planned.
	woken, planning map[string]bool
	// poked are hosts of the line changed in the store since they were
	// last planned (poke): planned once more.
	poked map[string]bool
	// synced is set once every host was listed; before, admission waits
	// (deferred hosts are queued again then).
	synced   bool
	deferred map[string]bool
	// full is whether hosts wait (for the logs).
	full bool
}

// reserved marks a slot taken whose Provisioning status is not stored
// yet: no observation of the host's stored state removes it.
const reserved = math.MaxInt64

func newAdmission(limit int, wake func(string)) *admission {
	return &admission{
		limit:    limit,
		wake:     wake,
		inflight: map[string]int64{},
		line:     list.New(),
		inLine:   map[string]*list.Element{},
		woken:    map[string]bool{},
		planning: map[string]bool{},
		poked:    map[string]bool{},
		deferred: map[string]bool{},
	}
}

// observe records the stored state of host name at revision rev: a
// Provisioning host counts, one in another state frees its slot (unless
// the observation is older than what made it count).
func (a *admission) observe(name string, rev int64, state typesv1.HostState) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if state == typesv1.HostState_HOST_STATE_PROVISIONING {
		if r, ok := a.inflight[name]; !ok || (r != reserved && r < rev) {
			a.inflight[name] = rev
		}
		return
	}
	if r, ok := a.inflight[name]; ok && r < rev {
		delete(a.inflight, name)
		a.wakeLocked()
	}
}

// listed records a host's state as the executor's first listing of the
// hosts found it, before any host is admitted (sync). Later listings are
// not used: a page of one can be seconds older than the writes that moved
// its hosts since (a host that ended counted again), and every change of
// a host's state is the executor's own write (stored) or is read by the
// reconcile that its watch event queues (observe).
func (a *admission) listed(name string, rev int64, state typesv1.HostState) {
	a.mu.Lock()
	synced := a.synced
	a.mu.Unlock()
	if !synced {
		a.observe(name, rev, state)
	}
}

// stored records the status write of name at rev that reserved (or did
// not reserve) its slot: the reservation becomes what the store says.
func (a *admission) stored(name string, rev int64, state typesv1.HostState) {
	a.mu.Lock()
	if r, ok := a.inflight[name]; ok && r == reserved {
		a.inflight[name] = rev - 1 // let the observation below decide
	}
	a.mu.Unlock()
	a.observe(name, rev, state)
}

// release gives back a slot reserved for name whose write failed: the
// host is read again and planned from what is stored.
func (a *admission) release(name string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.inflight[name] == reserved {
		delete(a.inflight, name)
		a.wakeLocked()
	}
}

// forget drops a deleted host.
func (a *admission) forget(name string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	_, counted := a.inflight[name]
	delete(a.inflight, name)
	if e := a.inLine[name]; e != nil {
		a.line.Remove(e)
		delete(a.inLine, name)
	}
	delete(a.deferred, name)
	delete(a.poked, name)
	if counted || a.woken[name] || a.planning[name] {
		delete(a.woken, name)
		delete(a.planning, name)
		a.wakeLocked()
	}
}

// decision is what admit says.
type decision int

const (
	slotTaken   decision = iota
	slotRefused          // no slot: store the host as waiting, then call wait
	notSynced            // in-flight hosts not known yet: plan again after sync
)

// admit asks for a slot for name, whose plan starts its provisioning. It
// also says how many hosts are in flight, for the host's condition, and
// whether this refusal is the first since the line was last empty (for
// the logs).
func (a *admission) admit(name string) (d decision, inflight int, first bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.limit < 0 {
		return slotTaken, len(a.inflight), false
	}
	if !a.synced {
		a.deferred[name] = true
		return notSynced, len(a.inflight), false
	}
	delete(a.planning, name)
	if _, ok := a.inflight[name]; ok {
		return slotTaken, len(a.inflight), false
	}
	if a.used() >= a.limit {
		first = !a.full
		a.full = true
		return slotRefused, a.used(), first
	}
	a.inflight[name] = reserved
	return slotTaken, len(a.inflight), false
}

// wait puts name, stored as waiting, at the end of the line.
func (a *admission) wait(name string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.inLine[name] == nil && !a.woken[name] {
		a.inLine[name] = a.line.PushBack(name)
	}
	a.wakeLocked() // a slot may have freed since admit
}

// waiting reports whether name is in the line.
func (a *admission) waiting(name string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.inLine[name] != nil
}

// poke marks name, changed in the store, to be planned once even while
// it waits in the line: the change may mean it wants no slot any more.
func (a *admission) poke(name string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.inLine[name] != nil {
		a.poked[name] = true
	}
}

// skip reports whether a worker need not plan name now: it waits in the
// line (which wakes it) and was not poked since it was last planned.
func (a *admission) skip(name string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.poked[name] {
		delete(a.poked, name)
		return false
	}
	return a.inLine[name] != nil
}

// leave takes name out of the line: it wants no slot now.
func (a *admission) leave(name string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if e := a.inLine[name]; e != nil {
		a.line.Remove(e)
		delete(a.inLine, name)
	}
	delete(a.poked, name)
	if a.line.Len() == 0 {
		a.full = false
	}
}

// counted reports whether name holds a slot (in flight or reserved).
func (a *admission) counted(name string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	_, ok := a.inflight[name]
	return ok
}

// isSynced reports whether the first listing is in (sync).
func (a *admission) isSynced() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.synced
}

// begin is called when a worker starts planning name: a woken host's
// slot stays kept for it while it is planned.
func (a *admission) begin(name string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.woken[name] {
		delete(a.woken, name)
		a.planning[name] = true
	}
}

// settle is called once a host was planned: a woken host that did not
// ask for its slot (it no longer wants an image, it failed to be read)
// gives it to the next one.
func (a *admission) settle(name string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.planning[name] {
		delete(a.planning, name)
		a.wakeLocked()
	}
}

// used is the slots in flight or kept for woken hosts.
func (a *admission) used() int { return len(a.inflight) + len(a.woken) + len(a.planning) }

// sync marks the in-flight hosts known (the first full listing) and
// queues the hosts deferred until then.
func (a *admission) sync() {
	a.mu.Lock()
	if a.synced {
		a.mu.Unlock()
		return
	}
	a.synced = true
	names := make([]string, 0, len(a.deferred))
	for n := range a.deferred {
		names = append(names, n)
	}
	a.deferred = nil
	a.mu.Unlock()
	for _, n := range names {
		a.wake(n)
	}
}

// wakeLocked queues as many hosts of the line as there are free slots.
func (a *admission) wakeLocked() {
	if a.limit < 0 {
		return
	}
	for a.used() < a.limit && a.line.Len() > 0 {
		e := a.line.Front()
		name := a.line.Remove(e).(string)
		delete(a.inLine, name)
		a.woken[name] = true
		a.wake(name)
	}
	if a.line.Len() == 0 {
		a.full = false
	}
}

// counts says how many hosts are in flight and waiting.
func (a *admission) counts() (inflight, waiting int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.inflight), a.line.Len()
}

// waitingCondition is the condition of a host refused a slot.
func waitingCondition(inflight, limit int) *typesv1.Condition {
	return conditions.New(ConditionAdmitted, conditions.False, ReasonWaiting,
		fmt.Sprintf("waiting for a provisioning slot (%d in flight, limit %d): hosts start as others finish or fail; kiln-controller run --provision-max-in-flight sets the limit",
			inflight, limit))
}

// markWaiting sets the waiting condition on st, keeping the message of
// one already there (its counts are those of when the wait began, and a
// host waiting is not written again for new counts).
func markWaiting(st *typesv1.HostStatus, inflight, limit int, now time.Time) {
	if c := conditions.Get(st.GetConditions(), ConditionAdmitted); c != nil && c.GetStatus() == conditions.False && c.GetReason() == ReasonWaiting {
		return
	}
	st.Conditions, _ = conditions.Set(st.Conditions, waitingCondition(inflight, limit), now)
}

// clearWaiting removes a waiting condition from st, the planned status of
// a host that does not start provisioning; it reports whether there was
// one.
func clearWaiting(st *typesv1.HostStatus) bool {
	c := conditions.Get(st.GetConditions(), ConditionAdmitted)
	if c == nil || c.GetStatus() != conditions.False {
		return false
	}
	st.Conditions, _ = conditions.Remove(st.Conditions, ConditionAdmitted)
	return true
}

// markAdmitted turns a waiting condition on st True.
func markAdmitted(st *typesv1.HostStatus, inflight, limit int, now time.Time) {
	if c := conditions.Get(st.GetConditions(), ConditionAdmitted); c == nil || c.GetStatus() == conditions.True {
		return
	}
	st.Conditions, _ = conditions.Set(st.Conditions, conditions.New(ConditionAdmitted, conditions.True, ReasonAdmitted,
		fmt.Sprintf("provisioning slot taken (%d in flight, limit %d)", inflight, limit)), now)
}
