// Package provision runs the host lifecycle that controller/hostlife
// decides: it reads each Host from the store, asks hostlife.Plan what to
// do, stores the planned status first (write-ahead, compare-and-swap on
// the host's revision, retried on conflict), then runs the planned actions
// against the host's BMC and agent and plans again with their outcome.
//
// Hosts are worked on through a per-host queue by a fixed number of
// workers: one host is never worked on by two workers at once, and every
// BMC or agent call has the step's deadline, so a slow or failing BMC
// holds one worker for at most one step timeout and never delays other
// hosts while workers are free.
//
// The BMC and the agent are reached through small interfaces (BMC,
// BMCDialer, AgentDialer): production passes a bmc.Manager and the
// controller's mTLS agent dialer, controller/sim passes simulated ones.
package provision

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	"github.com/kilnhq/kiln/internal/pki"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// HostsKind is the store kind of hosts.
const HostsKind = "hosts"

// BMC is what the executor needs of a host's BMC (*bmc.BMC).
type BMC interface {
	PowerState(ctx context.Context) (string, error)
	PowerOn(ctx context.Context) error
	PowerOff(ctx context.Context) error
	SetBootDevice(ctx context.Context, device string, persistent, efi bool) error
	InsertVirtualMedia(ctx context.Context, url string) error
	// Condition is the BMCReachable condition of the host.
	Condition() *typesv1.Condition
}

// BMCDialer returns the BMC of a host (cached by the implementation).
type BMCDialer func(ctx context.Context, h *typesv1.Host) (BMC, error)

// AgentDialer returns a client of the agent of a host, at the address in
// h.status.agent, authenticated with the controller's certificate. The
// implementation may cache connections by address.
type AgentDialer func(ctx context.Context, h *typesv1.Host) (agentv1.AgentClient, error)

// IdentityFunc makes the identity the installed agent of h gets: a
// certificate issued to the host, the CA, the controller URL. The
// executor fills target and hostname.
type IdentityFunc func(ctx context.Context, h *typesv1.Host) (*agentv1.WriteIdentityRequest, error)

// DesiredFunc says what is wanted of h (see StoreDesired).
type DesiredFunc func(ctx context.Context, h *typesv1.Host) (hostlife.Desired, error)

// Store is what the executor needs of the store (*store.Store).
type Store interface {
	Get(ctx context.Context, kind, name string, into proto.Message) (int64, error)
	Update(ctx context.Context, kind, name string, m proto.Message, expectRev int64) (int64, error)
	// UpdateWith is Update with ops in the same transaction (the events
	// of the status).
	UpdateWith(ctx context.Context, kind, name string, m proto.Message, expectRev int64, ops []clientv3.Op) (int64, []*etcdserverpb.ResponseOp, error)
	List(ctx context.Context, kind string, newMsg func() proto.Message, opts store.ListOptions) ([]store.Item, string, error)
	Watch(ctx context.Context, kind string, fromRev int64) <-chan store.WatchEvent
}

var _ Store = (*store.Store)(nil)

// Fencer is a Store that knows whether this leader's term still holds
// (store.Store.Fenced). With one, the executor starts no BMC or agent
// action once the term is over, even one whose start writes nothing.
type Fencer interface {
	CheckFence(ctx context.Context) error
}

var _ Fencer = (*store.Store)(nil)

// Recorder records events (*events.Recorder): alone (Record), or
// prepared to be stored in the transaction of a status write (Prepare).
type Recorder interface {
	Record(ctx context.Context, kind, name, typ, reason, message string)
	Prepare(ctx context.Context, kind, name string, evs []events.Event) (*events.Batch, error)
}

var _ Recorder = (*events.Recorder)(nil)

// Config configures an Executor.
type Config struct {
	// Workers is how many hosts are worked on at once (default
	// MaxInFlight + 64, DefaultMaxInFlight + 64 with no limit). A step
	// holds a worker until its actions end (a lay for its duration, a
	// BMC call for its seconds), so every host in flight may hold one;
	// the 64 more serve the hosts outside the admission (wipes, errors,
	// deletions). With fewer, the workers, not the admission, bound a
	// wave: 64 workers laid 64 hosts at once, whatever MaxInFlight said.
	// A worker is a goroutine only while it works.
	Workers int
	// Plan tunes the lifecycle (timeouts, backoff, attempts).
	Plan hostlife.Config
	// ISOURL returns the agent boot ISO of a host (bootserver.ISOURL).
	ISOURL func(host string) string
	// ResyncInterval is how often every host is looked at again even
	// without a change (default 1m): the resync plans each host in
	// memory and queues those whose plan would do something (resync).
	ResyncInterval time.Duration
	// FullResyncInterval is how often the resync lists the hosts from
	// etcd rather than from Deps.Hosts (default 10 × ResyncInterval;
	// every resync lists from etcd without Deps.Hosts).
	FullResyncInterval time.Duration
	// Clock is the time source (time.Now).
	Clock func() time.Time
	// ProgressInterval is the longest a running lay's or wipe's stored
	// progress (status.lastOperation.progress) stays behind its agent's
	// reports (default DefaultProgressInterval); ProgressPercent is the
	// gain in percent stored sooner, at most once a second (default
	// DefaultProgressPercent).
	ProgressInterval time.Duration
	ProgressPercent  float64
	// Owns, when set, limits the executor to the hosts it returns true
	// for: the others are neither listed nor queued from the watch (a
	// sharded controller runs one executor per shard it holds,
	// controller/shard). Nil: every host.
	Owns func(host string) bool
	// MaxInFlight is how many hosts may be Provisioning at once (default
	// DefaultMaxInFlight; negative: no limit). A host whose provisioning
	// would start beyond it stays Available with ProvisioningAdmitted
	// False (WaitingForSlot) and starts, in the order they came, as
	// others end (Provisioned, Error, deleted, or their image no longer
	// wanted). Hosts found Provisioning when the executor starts always
	// go on, and count. A sharded controller applies it per shard.
	MaxInFlight int
}

// Deps are the executor's collaborators.
type Deps struct {
	Store    Store
	Recorder Recorder
	BMCs     BMCDialer
	Agents   AgentDialer
	Identity IdentityFunc
	// Desired defaults to StoreDesired(Store).
	Desired DesiredFunc
	// Hosts, when set, is the replica's watch cache of Hosts: the
	// periodic resync reads the hosts from it instead of listing them
	// from etcd (but for one resync every Config.FullResyncInterval).
	Hosts HostCache
	// Observer, when set, is told of finished steps and of each
	// reconcile (metrics).
	Observer Observer
}

// HostCache is a watch cache of Hosts (*store.Cache, the replica's
// resources.Caches).
type HostCache interface {
	// Range calls fn with each cached Host (shared: read only), decoding
	// one at a time, until fn returns false; it waits for the first
	// listing.
	Range(ctx context.Context, fn func(store.Item) bool) error
	// Synced reports whether the cache's first listing is in.
	Synced() bool
}

var _ HostCache = (*store.Cache)(nil)

// Observer is told what the executor did (*metrics.Metrics). Its methods
// must not block.
type Observer interface {
	// ObserveOperationOutcome records a step that ended (op is the step,
	// outcome hostlife's Outcome*), d after it started.
	ObserveOperationOutcome(op, outcome string, d time.Duration)
	// ObserveReconcile records one Reconcile of a host (controller
	// "hosts") and the queue depth after it.
	ObserveReconcile(controller string, err error, d time.Duration, queueDepth int)
}

// Executor runs the host lifecycle.
type Executor struct {
	cfg  Config
	deps Deps
	log  *slog.Logger
	q    hostQueue

	mu        sync.Mutex
	transient map[string]int
	bmcs      map[string]BMC
	// written is the revision of each host's last status write, so the
	// watch event of our own write does not queue the host again.
	written map[string]int64

	adm *admission
}

// extraWorkers are the workers beyond the admission limit (Config.Workers).
const extraWorkers = 64

// defaultWorkers is Config.Workers' default for an admission limit of
// maxInFlight (-1: none).
func defaultWorkers(maxInFlight int) int {
	if maxInFlight < 0 {
		maxInFlight = DefaultMaxInFlight
	}
	return maxInFlight + extraWorkers
}

// New returns an Executor; Run starts it.
func New(deps Deps, cfg Config, log *slog.Logger) *Executor {
	if cfg.ResyncInterval <= 0 {
		cfg.ResyncInterval = time.Minute
	}
	if cfg.FullResyncInterval <= 0 {
		cfg.FullResyncInterval = 10 * cfg.ResyncInterval
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if cfg.ISOURL == nil {
		cfg.ISOURL = func(string) string { return "" }
	}
	if deps.Desired == nil {
		deps.Desired = StoreDesired(deps.Store)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	switch {
	case cfg.MaxInFlight == 0:
		cfg.MaxInFlight = DefaultMaxInFlight
	case cfg.MaxInFlight < 0:
		cfg.MaxInFlight = -1
	}
	if cfg.Workers <= 0 {
		cfg.Workers = defaultWorkers(cfg.MaxInFlight)
	}
	e := &Executor{
		cfg:       cfg,
		deps:      deps,
		log:       log.With("component", "provision"),
		q:         newHostQueue(nil),
		transient: map[string]int{},
		written:   map[string]int64{},
		bmcs:      map[string]BMC{},
	}
	e.adm = newAdmission(cfg.MaxInFlight, e.q.Add)
	return e
}

// Run watches the hosts and works on them until ctx ends.
func (e *Executor) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	wg.Go(func() { e.work(ctx, &wg) })
	wg.Add(1)
	go func() {
		defer wg.Done()
		e.watch(ctx)
	}()
	<-ctx.Done()
	e.q.ShutDown()
	wg.Wait()
	return nil
}

// Queue asks for host name to be planned now.
func (e *Executor) Queue(name string) { e.q.Add(name) }

// QueueLen is the number of hosts waiting for a worker.
func (e *Executor) QueueLen() int { return e.q.Len() }

// InFlight says how many hosts are provisioning (counted against
// Config.MaxInFlight) and how many wait for a slot.
func (e *Executor) InFlight() (inflight, waiting int) { return e.adm.counts() }

// watch queues every host at start, the hosts that need work every
// ResyncInterval, and each host that changes in between.
func (e *Executor) watch(ctx context.Context) {
	// Every fullEvery-th resync lists from etcd (FullResyncInterval).
	fullEvery := max(1, int(e.cfg.FullResyncInterval/e.cfg.ResyncInterval))
	for ctx.Err() == nil {
		wctx, stop := context.WithCancel(ctx)
		events := e.deps.Store.Watch(wctx, HostsKind, 0)
		// A new watch may have missed changes: list from etcd.
		e.resync(ctx, true)
		tick := time.NewTicker(e.cfg.ResyncInterval)
		n := 0
	loop:
		for {
			select {
			case <-ctx.Done():
				break loop
			case <-tick.C:
				n++
				e.resync(ctx, n%fullEvery == 0)
			case ev, ok := <-events:
				if !ok || ev.Err != nil {
					if ev.Err != nil && ctx.Err() == nil {
						e.log.Warn("host watch ended; listing again", "err", ev.Err)
					}
					break loop
				}
				if ev.Type == store.EventDelete {
					e.forgetHost(ev.Name)
					continue
				}
				if e.ownWrite(ev.Name, ev.Rev) || !e.owns(ev.Name) {
					continue
				}
				// A change of a host in the line (not a resync) is planned
				// once: it may no longer want a slot.
				e.adm.poke(ev.Name)
				e.q.Add(ev.Name)
			}
		}
		tick.Stop()
		stop()
	}
}

func (e *Executor) owns(host string) bool { return e.cfg.Owns == nil || e.cfg.Owns(host) }

// resync looks at every host again: the safety net for what the watch
// does not bring (a Machine deleted or an Image changed, a watch event
// missed, a BMC condition that changed in memory).
//
// The first complete listing queues every host and tells admission which
// hosts are in flight: until then, no host starts provisioning. Every
// later resync queues only the hosts that need work (needsWork: the plan
// of the listed host would write or act), so the hosts resting
// Provisioned, Available or in Error, and the hosts waiting for a slot,
// cost no reconcile (a linearizable read each). It lists from Deps.Hosts
// when set and synced, unless fromStore: then from etcd (paged), as the
// first listing always is.
func (e *Executor) resync(ctx context.Context, fromStore bool) {
	first := !e.adm.isSynced()
	if !first && !fromStore && e.deps.Hosts != nil && e.deps.Hosts.Synced() {
		// One host decoded at a time: the cache keeps Hosts encoded, and
		// a list of 100,000 decoded ones is 330 MiB held at once.
		_ = e.deps.Hosts.Range(ctx, func(it store.Item) bool {
			e.queueIfNeedsWork(ctx, it)
			return ctx.Err() == nil
		}) // an error: ctx ended
		return
	}
	cont := ""
	var names []string
	for {
		items, next, err := e.deps.Store.List(ctx, HostsKind, func() proto.Message { return &typesv1.Host{} }, store.ListOptions{Limit: 1000, Continue: cont})
		if err != nil {
			if ctx.Err() == nil {
				e.log.Warn("list hosts", "err", err)
			}
			break
		}
		if !first {
			e.queueNeedingWork(ctx, items)
		}
		for _, it := range items {
			if first && e.owns(it.Name) {
				e.adm.listed(it.Name, it.Rev, it.Msg.(*typesv1.Host).GetStatus().GetState())
				names = append(names, it.Name)
			}
		}
		if next == "" {
			e.adm.sync()
			break
		}
		cont = next
	}
	for _, n := range names {
		e.q.Add(n)
	}
}

// queueNeedingWork queues the hosts of items (listed or cached: read
// only) that this executor owns and that need work.
func (e *Executor) queueNeedingWork(ctx context.Context, items []store.Item) {
	for _, it := range items {
		if ctx.Err() != nil {
			return
		}
		e.queueIfNeedsWork(ctx, it)
	}
}

// queueIfNeedsWork queues the listed host it when this executor owns it
// and it needs work (needsWork).
func (e *Executor) queueIfNeedsWork(ctx context.Context, it store.Item) {
	if e.owns(it.Name) && e.needsWork(ctx, it.Name, it.Msg.(*typesv1.Host)) {
		e.q.Add(it.Name)
	}
}

// needsWork reports whether a reconcile of h, as listed (shared: read
// only), would do anything: it plans h in memory as Reconcile's first
// round would (same desired state, BMC condition and clock) and says yes
// when the plan changes the status, runs actions or wants to be planned
// again at a time (a wait step, a backoff). A host at rest (Provisioned
// with its image wanted, Available with none, Error) plans nothing until
// something changes, and each such change is a watch event or found here
// by the next resync: a Machine gone or bound elsewhere (the desired
// state), a BMC condition seen by this executor. A host waiting for a
// slot is queued only when its plan no longer starts its provisioning
// (its Machine deleted: poked, it leaves the line), else the line wakes
// it. A host admission counts in flight but listed in another state is
// queued, so its reconcile's read frees the slot. Errors say yes: the reconcile reports them.
//
// A listed host older than etcd's is not a risk: every later write of it
// is a watch event that queues it (the executor's own are planned by the
// worker that wrote them), and the periodic listing from etcd
// (FullResyncInterval) finds what a watch missed.
func (e *Executor) needsWork(ctx context.Context, name string, h *typesv1.Host) bool {
	waiting := e.adm.waiting(name)
	state := h.GetStatus().GetState()
	if !waiting && (state == typesv1.HostState_HOST_STATE_PROVISIONING || e.adm.counted(name)) {
		return true
	}
	desired, err := e.deps.Desired(ctx, h)
	if err != nil {
		return true
	}
	out := hostlife.Plan(hostlife.Input{
		Host:     h,
		Desired:  desired,
		Observed: hostlife.Observed{BMCCondition: e.bmcCondition(name)},
		ISOURL:   e.cfg.ISOURL(name),
		Now:      e.cfg.Clock(),
		Config:   e.cfg.Plan,
	})
	if waiting {
		if out.Status.GetState() == typesv1.HostState_HOST_STATE_PROVISIONING {
			return false // still wants its slot: the line wakes it
		}
		// Wants none now (its Machine deleted without a write of the
		// host): planned once, it leaves the line.
		e.adm.poke(name)
		return true
	}
	return out.Changed || len(out.Actions) > 0 || out.Next != hostlife.NextOnChange
}

// work takes the queued hosts one by one, each to a goroutine of its
// own, at most Config.Workers at once, until the queue shuts down; wg
// counts the goroutines. A worker is a goroutine only while it works:
// an idle executor (or each of a sharded controller's) holds one, not
// Workers.
func (e *Executor) work(ctx context.Context, wg *sync.WaitGroup) {
	slots := make(chan struct{}, e.cfg.Workers)
	for {
		slots <- struct{}{}
		name, shutdown := e.q.Get()
		if shutdown {
			return
		}
		if ctx.Err() != nil || e.adm.skip(name) {
			// Draining after ShutDown; or waiting for a provisioning
			// slot, which wakes it.
			e.q.Done(name)
			<-slots
			continue
		}
		wg.Go(func() {
			defer func() { <-slots }()
			e.workOn(ctx, name)
		})
	}
}

// workOn reconciles host name (taken from the queue) and queues it again
// when it asks.
func (e *Executor) workOn(ctx context.Context, name string) {
	e.adm.begin(name)
	start := e.cfg.Clock()
	requeue, err := e.Reconcile(ctx, name)
	e.adm.settle(name)
	if o := e.deps.Observer; o != nil && ctx.Err() == nil {
		o.ObserveReconcile("hosts", err, e.cfg.Clock().Sub(start), e.q.Len())
	}
	if err != nil && ctx.Err() == nil {
		e.log.Warn("reconcile host", "host", name, "err", err)
		requeue = max(requeue, 5*time.Second)
	}
	e.q.Done(name)
	if requeue > 0 && ctx.Err() == nil {
		e.q.AddAfter(name, requeue)
	}
}

// maxRounds bounds the plan/act rounds of one Reconcile.
const maxRounds = 64

// held is a planned status not stored yet (hostlife.Output.Deferrable),
// with the events and finished operations of the plans that made it:
// they are stored, and reported, with the next write.
type held struct {
	events   []hostlife.Event
	finished []hostlife.Finished
}

// Reconcile plans and acts on host name until Plan asks for nothing more
// now; it returns when to look again (0: on the next change).
//
// A planned status is stored before its actions run (write-ahead), with
// the plan's events in the same transaction, unless the plan says it is
// deferrable: then it is held in memory, the actions run, and it is
// stored with the next plan's status. A conflict drops what was held:
// the host is read again and planned from what is stored, which a crash
// would have found too.
//
// A plan that starts the host's provisioning (its state becomes
// Provisioning) needs a slot of admission control (Config.MaxInFlight):
// without one, the host is stored as it would rest with no image wanted
// (Available), with ProvisioningAdmitted False saying why, and waits.
func (e *Executor) Reconcile(ctx context.Context, name string) (time.Duration, error) {
	var result *hostlife.Result
	var h *typesv1.Host
	var stored *typesv1.HostStatus // h's status as stored at rev
	var rev int64
	var hold *held
	// A slot reserved and not stored is given back (a no-op otherwise).
	defer e.adm.release(name)
	for range maxRounds {
		if hold == nil {
			h = &typesv1.Host{}
			var err error
			rev, err = e.deps.Store.Get(ctx, HostsKind, name, h)
			if errdefs.IsNotFound(err) {
				e.forgetHost(name)
				return 0, nil
			}
			if err != nil {
				return 0, fmt.Errorf("host %s: %w", name, err)
			}
			stored = h.GetStatus()
			e.adm.observe(name, rev, stored.GetState())
		}
		desired, err := e.deps.Desired(ctx, h)
		if err != nil {
			return 0, fmt.Errorf("host %s: desired state: %w", name, err)
		}
		now := e.cfg.Clock()
		out := hostlife.Plan(hostlife.Input{
			Host:     h,
			Desired:  desired,
			Observed: hostlife.Observed{Result: result, BMCCondition: e.bmcCondition(name)},
			ISOURL:   e.cfg.ISOURL(name),
			Now:      now,
			Config:   e.cfg.Plan,
		})
		if out.Status.GetState() == typesv1.HostState_HOST_STATE_PROVISIONING && h.GetStatus().GetState() != typesv1.HostState_HOST_STATE_PROVISIONING {
			d, inflight, first := e.adm.admit(name)
			switch d {
			case notSynced:
				return 0, nil // queued again once the hosts in flight are known
			case slotRefused:
				if first {
					e.log.Info("provisioning slots full: hosts wait", "limit", e.cfg.MaxInFlight, "inflight", inflight)
				}
				conflict, err := e.refuse(ctx, name, h, stored, rev, result, hold, out, inflight, now)
				if conflict {
					hold = nil
					continue // read and plan again
				}
				return 0, err
			}
			markAdmitted(out.Status, inflight, e.cfg.MaxInFlight, now)
		} else if clearWaiting(out.Status) {
			// It waited for a slot and wants none now (its Machine went,
			// it is no longer Available): it leaves the line, and no
			// stale WaitingForSlot stays on it.
			e.adm.leave(name)
			out.Changed = true
		}
		evs, finished := out.Events, out.Finished
		if hold != nil {
			evs = append(hold.events, evs...)
			finished = append(hold.finished, finished...)
		}
		defer_ := out.Deferrable && (len(out.Actions) > 0 || out.Next == hostlife.NextNow)
		switch {
		case (out.Changed || hold != nil) && defer_:
			h.Status = out.Status
			hold = &held{events: evs, finished: finished}
			evs, finished = nil, nil
		case out.Changed || hold != nil:
			h.Status = out.Status
			hold = nil
			newRev, err := e.storeStatus(ctx, name, h, rev, evs)
			if err != nil {
				if errdefs.IsConflict(err) {
					continue // a heartbeat or an apply won: read and plan again
				}
				if errdefs.IsNotFound(err) {
					return 0, nil
				}
				return 0, fmt.Errorf("host %s: store status: %w", name, err)
			}
			rev, stored = newRev, h.Status
			e.adm.stored(name, rev, stored.GetState())
			evs = nil // stored with the status
		}
		e.report(ctx, name, finished, evs)
		result = nil
		if len(out.Actions) == 0 {
			switch out.Next {
			case hostlife.NextNow:
				continue // the stored (or held) status decides the next Plan
			case hostlife.NextAfter:
				return out.RequeueAfter, nil
			default:
				return 0, nil
			}
		}
		if f, ok := e.deps.Store.(Fencer); ok {
			if err := f.CheckFence(ctx); err != nil {
				return 0, fmt.Errorf("host %s: %s not started: %w", name, out.Actions[0].Kind, err)
			}
		}
		result = e.act(ctx, h, out.Actions, out.Deadline)
		if ctx.Err() != nil {
			// Shutting down: an action cut short by our own end is no
			// result; the next leader runs the stored step again.
			return 0, ctx.Err()
		}
	}
	if hold != nil {
		// Out of rounds with a status held: store it (the next Reconcile
		// reads the host again).
		if _, err := e.storeStatus(ctx, name, h, rev, hold.events); err != nil && !errdefs.IsConflict(err) && !errdefs.IsNotFound(err) {
			return 0, fmt.Errorf("host %s: store status: %w", name, err)
		}
	}
	return time.Second, nil
}

// refuse stores host h, whose plan out would start its provisioning and
// got no slot, as it rests with no image wanted (hostlife.Plan with an
// empty Desired: Available, after the same steps up to there), with the
// wanted image's ImageResolved condition and ProvisioningAdmitted False;
// then it puts the host in admission's line. stored is the status at
// rev; h may carry a held status (hold), stored with it. It reports a
// conflict (the caller reads and plans again).
func (e *Executor) refuse(ctx context.Context, name string, h *typesv1.Host, stored *typesv1.HostStatus, rev int64, result *hostlife.Result, hold *held, out hostlife.Output, inflight int, now time.Time) (conflict bool, err error) {
	alt := hostlife.Plan(hostlife.Input{
		Host:     h,
		Observed: hostlife.Observed{Result: result, BMCCondition: e.bmcCondition(name)},
		ISOURL:   e.cfg.ISOURL(name),
		Now:      now,
		Config:   e.cfg.Plan,
	})
	if len(alt.Actions) > 0 || alt.Status.GetState() != typesv1.HostState_HOST_STATE_AVAILABLE {
		// Not the path Plan takes: a host reaches Provisioning only
		// from where it rests Available when nothing is wanted.
		return false, errdefs.FailedPrecondition("host %s: no provisioning slot, and resting it Available plans %s with %d actions", name, hostlife.StateName(alt.Status.GetState()), len(alt.Actions))
	}
	st := alt.Status
	if c := conditions.Get(out.Status.GetConditions(), hostlife.ConditionImageResolved); c != nil {
		st.Conditions, _ = conditions.Set(st.Conditions, proto.Clone(c).(*typesv1.Condition), now)
	}
	markWaiting(st, inflight, e.cfg.MaxInFlight, now)
	evs, finished := alt.Events, alt.Finished
	if hold != nil {
		evs = append(hold.events, evs...)
		finished = append(hold.finished, finished...)
	}
	if !proto.Equal(st, stored) {
		h.Status = st
		newRev, err := e.storeStatus(ctx, name, h, rev, evs)
		if errdefs.IsConflict(err) {
			return true, nil
		}
		if errdefs.IsNotFound(err) {
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("host %s: store status: %w", name, err)
		}
		e.adm.stored(name, newRev, st.GetState())
		evs = nil
	}
	e.report(ctx, name, finished, evs)
	e.adm.wait(name)
	return false, nil
}

// storeStatus writes h (read at rev) and the events of its plans in one
// transaction, and returns the new revision. Events that cannot be
// prepared (no lease) are logged and the status is stored without them.
func (e *Executor) storeStatus(ctx context.Context, name string, h *typesv1.Host, rev int64, evs []hostlife.Event) (int64, error) {
	var batch *events.Batch
	if len(evs) > 0 && e.deps.Recorder != nil {
		list := make([]events.Event, len(evs))
		for i, ev := range evs {
			list[i] = events.Event{Type: ev.Type, Reason: ev.Reason, Message: ev.Message}
		}
		b, err := e.deps.Recorder.Prepare(ctx, HostsKind, name, list)
		if err != nil {
			e.log.Warn("events not recorded", "host", name, "err", err)
		} else {
			batch = b
		}
	}
	var ops []clientv3.Op
	if batch != nil {
		ops = batch.Ops()
	}
	newRev, answers, err := e.deps.Store.UpdateWith(ctx, HostsKind, name, h, rev, ops)
	if batch != nil {
		batch.Done(ctx, newRev, answers)
	}
	if err != nil {
		return 0, err
	}
	e.mu.Lock()
	e.written[name] = newRev
	e.mu.Unlock()
	for _, ev := range evs {
		e.log.Info("host "+ev.Reason, "host", name, "message", ev.Message)
	}
	return newRev, nil
}

// report tells the observer of the operations that ended once the status
// that ends them is stored (a conflict plans again and finds them again),
// and records events that came with no status to store.
func (e *Executor) report(ctx context.Context, name string, finished []hostlife.Finished, evs []hostlife.Event) {
	if o := e.deps.Observer; o != nil {
		for _, f := range finished {
			o.ObserveOperationOutcome(string(f.Kind), f.Outcome, f.Duration)
		}
	}
	for _, ev := range evs {
		if e.deps.Recorder != nil {
			e.deps.Recorder.Record(ctx, HostsKind, name, ev.Type, ev.Reason, ev.Message)
		}
		e.log.Info("host "+ev.Reason, "host", name, "message", ev.Message)
	}
}

// act runs actions in order under one deadline and says how they ended.
func (e *Executor) act(ctx context.Context, h *typesv1.Host, actions []hostlife.Action, timeout time.Duration) *hostlife.Result {
	name := h.GetMetadata().GetName()
	r := &hostlife.Result{OperationID: h.GetStatus().GetLastOperation().GetId()}
	if timeout <= 0 {
		timeout = hostlife.DefaultStepTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for _, a := range actions {
		err := e.do(ctx, h, a)
		if err == nil {
			continue
		}
		r.Err = sanitizeMessage(fmt.Sprintf("%s: %v", a.Kind, err))
		r.Failure = classify(a.Kind, err)
		if r.Failure == hostlife.FailTransient || r.Failure == hostlife.FailUnreachable {
			e.mu.Lock()
			e.transient[name]++
			r.Consecutive = e.transient[name]
			e.mu.Unlock()
		}
		return r
	}
	e.mu.Lock()
	delete(e.transient, name)
	e.mu.Unlock()
	return r
}

func isBMC(k hostlife.ActionKind) bool {
	switch k {
	case hostlife.ActCheckBMC, hostlife.ActPowerOff, hostlife.ActPowerOn, hostlife.ActSetBoot, hostlife.ActInsertMedia:
		return true
	}
	return false
}

// classify says whether trying again can help: a BMC failure is
// transient (same step, backoff, no limit); an unreachable agent or a
// broken stream is tried again under the same operation id within the
// step's timeout; an operation the agent ended as failed counts as an
// attempt.
func classify(k hostlife.ActionKind, err error) hostlife.Failure {
	var opErr *operationError
	switch {
	case errdefs.IsNotSupported(err) || errdefs.IsInvalidArgument(err) || errdefs.IsPermissionDenied(err):
		return hostlife.FailPermanent
	case isBMC(k) && errdefs.IsFailedPrecondition(err):
		// The BMC refuses what the spec asks (session auth without a
		// SessionService, an untrusted certificate): only a spec change
		// helps, and it takes the host out of Error.
		return hostlife.FailPermanent
	case isBMC(k):
		return hostlife.FailTransient
	case errors.As(err, &opErr):
		return hostlife.FailAgent
	case errdefs.IsUnavailable(err):
		return hostlife.FailUnreachable
	}
	return hostlife.FailAgent
}

// operationError is an agent operation that ended as failed or
// interrupted (as opposed to a stream that broke while it ran).
type operationError struct{ msg string }

func (e *operationError) Error() string { return e.msg }

func (e *Executor) bmc(ctx context.Context, h *typesv1.Host) (BMC, error) {
	b, err := e.deps.BMCs(ctx, h)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	e.bmcs[h.GetMetadata().GetName()] = b
	e.mu.Unlock()
	return b, nil
}

func (e *Executor) bmcCondition(name string) *typesv1.Condition {
	e.mu.Lock()
	b := e.bmcs[name]
	e.mu.Unlock()
	if b == nil {
		return nil
	}
	c := b.Condition()
	if c != nil {
		c = proto.Clone(c).(*typesv1.Condition)
		c.Message = sanitizeMessage(c.Message)
	}
	return c
}

// maxMessage bounds an error message the executor copies into a host's
// status (lastError, conditions) and events.
const maxMessage = 512

// sanitizeMessage makes an error message fit for status and events, which
// every reader sees: a BMC's error response body can be anything (HTML,
// a stack trace, megabytes, terminal escapes). Control characters become
// spaces, runs of white space one space, and the message is cut to
// maxMessage bytes (on a rune boundary) with a note saying so.
func sanitizeMessage(s string) string {
	var b strings.Builder
	space := false
	for _, r := range s {
		if r == utf8.RuneError || unicode.IsControl(r) || unicode.IsSpace(r) || !unicode.IsPrint(r) {
			space = true
			continue
		}
		if space && b.Len() > 0 {
			b.WriteByte(' ')
		}
		space = false
		if b.Len()+utf8.RuneLen(r) > maxMessage {
			b.WriteString(" ...(truncated)")
			return b.String()
		}
		b.WriteRune(r)
	}
	return b.String()
}

// ownWrite reports whether rev is the executor's own last write of name.
func (e *Executor) ownWrite(name string, rev int64) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.written[name] == rev
}

func (e *Executor) forgetHost(name string) {
	e.mu.Lock()
	delete(e.written, name)
	delete(e.bmcs, name)
	delete(e.transient, name)
	e.mu.Unlock()
	e.adm.forget(name)
}

// do runs one action.
func (e *Executor) do(ctx context.Context, h *typesv1.Host, a hostlife.Action) error {
	if isBMC(a.Kind) {
		b, err := e.bmc(ctx, h)
		if err != nil {
			return err
		}
		efi := h.GetSpec().GetBootMode() != "legacy"
		switch a.Kind {
		case hostlife.ActCheckBMC:
			_, err = b.PowerState(ctx)
		case hostlife.ActPowerOff:
			err = b.PowerOff(ctx)
		case hostlife.ActPowerOn:
			err = b.PowerOn(ctx)
		case hostlife.ActSetBoot:
			err = b.SetBootDevice(ctx, a.Device, a.Persistent, efi)
		case hostlife.ActInsertMedia:
			if a.URL == "" {
				return errdefs.FailedPrecondition("no agent ISO URL configured (boot server public URL)")
			}
			err = b.InsertVirtualMedia(ctx, a.URL)
		}
		return err
	}
	c, err := e.deps.Agents(ctx, h)
	if err != nil {
		return errdefs.Unavailable("dial agent at %q: %w", h.GetStatus().GetAgent().GetAddress(), err)
	}
	switch a.Kind {
	case hostlife.ActLayImage:
		img := a.Image
		stream, err := c.LayImage(ctx, &agentv1.LayImageRequest{
			OperationId:     a.OperationID,
			Url:             img.GetUrl(),
			Sha256:          img.GetSha256(),
			Format:          img.GetFormat(),
			Target:          a.Target,
			RootDeviceHints: a.RootDevice,
			RawSize:         img.GetRawSize(),
			RawSha256:       img.GetRawSha256(),
		})
		if err != nil {
			return errgrpc.FromGRPC(err)
		}
		return follow(stream, e.progressSink(ctx, h.GetMetadata().GetName(), a.OperationID))
	case hostlife.ActWipe:
		stream, err := c.Wipe(ctx, &agentv1.WipeRequest{OperationId: a.OperationID, Target: a.Target, RootDeviceHints: a.RootDevice})
		if err != nil {
			return errgrpc.FromGRPC(err)
		}
		return follow(stream, e.progressSink(ctx, h.GetMetadata().GetName(), a.OperationID))
	case hostlife.ActReattach:
		stream, err := c.Operation(ctx, &agentv1.OperationRequest{OperationId: a.OperationID})
		if err != nil {
			return errgrpc.FromGRPC(err)
		}
		return follow(stream, nil)
	case hostlife.ActWriteIdentity:
		req := &agentv1.WriteIdentityRequest{}
		if e.deps.Identity != nil {
			if req, err = e.deps.Identity(ctx, h); err != nil {
				return fmt.Errorf("identity: %w", err)
			}
			if err := e.recordInstalledSerial(ctx, h.GetMetadata().GetName(), req.GetCertificatePem()); err != nil {
				return fmt.Errorf("identity: %w", err)
			}
		}
		req.Target, req.RootDeviceHints = a.Target, a.RootDevice
		req.Hostname = h.GetMetadata().GetName()
		_, err := c.WriteIdentity(ctx, req)
		return errgrpc.FromGRPC(err)
	case hostlife.ActReboot:
		if a.UnlessAgent != "" {
			// Rebooting is not idempotent: a step run again after a
			// restart asks first whether the reboot already happened.
			f, err := c.Facts(ctx, &agentv1.FactsRequest{})
			if err != nil {
				return errgrpc.FromGRPC(err)
			}
			if f.GetFacts().GetAgentMode() == a.UnlessAgent {
				return nil
			}
		}
		_, err := c.Reboot(ctx, &agentv1.RebootRequest{})
		return errgrpc.FromGRPC(err)
	}
	return errdefs.InvalidArgument("unknown action %q", a.Kind)
}

// recordInstalledSerial makes the certificate the installed agent will use
// the host's latest, before the agent gets it, so that its calls are
// accepted (enrollment.CheckSerial). The certificate in use by the boot
// agent until the reboot stays accepted: the previous one if set (a
// retried step), else the latest.
func (e *Executor) recordInstalledSerial(ctx context.Context, name string, certPEM []byte) error {
	cert, err := pki.ParseCertificatePEM(certPEM)
	if err != nil {
		return fmt.Errorf("installed agent certificate: %w", err)
	}
	for range 10 {
		h := &typesv1.Host{}
		rev, err := e.deps.Store.Get(ctx, HostsKind, name, h)
		if err != nil {
			return err
		}
		a := h.GetStatus().GetAgent()
		inUse := a.GetPreviousCertificateSerial()
		if inUse == "" {
			inUse = a.GetCertificateSerial()
		}
		enrollment.RecordNewSerial(h, inUse, cert)
		_, err = e.deps.Store.Update(ctx, HostsKind, name, h, rev)
		if !errdefs.IsConflict(err) {
			return err
		}
	}
	return errdefs.Unavailable("host %q: too many concurrent updates", name)
}

// eventStream is a server stream of operation events.
type eventStream interface {
	Recv() (*agentv1.OperationEvent, error)
}

// follow reads an operation's events until its terminal one, handing
// each event's progress report to progress (when not nil).
func follow(s eventStream, progress func(*agentv1.Progress)) error {
	for {
		ev, err := s.Recv()
		if errors.Is(err, io.EOF) {
			return errdefs.Unavailable("operation stream ended without a result")
		}
		if err != nil {
			return errgrpc.FromGRPC(err)
		}
		if p := ev.GetProgress(); p != nil && progress != nil {
			progress(p)
		}
		switch ev.GetState() {
		case agentv1.OperationState_OPERATION_STATE_SUCCEEDED:
			return nil
		case agentv1.OperationState_OPERATION_STATE_FAILED:
			return &operationError{fmt.Sprintf("operation %s failed: %s", ev.GetOperationId(), ev.GetError())}
		case agentv1.OperationState_OPERATION_STATE_INTERRUPTED:
			return &operationError{fmt.Sprintf("operation %s interrupted (the agent restarted)", ev.GetOperationId())}
		}
	}
}

// StoreDesired reads what is wanted of a host from the store: the Machine
// named in status.machine, and the Image its spec names. A host without a
// Machine, or whose Machine is gone, wants no image. A Machine being
// deleted still holds its host: the cluster executor resets the node (and
// removes its etcd member) first and only then unbinds the host, which is
// what lets the host be wiped. Both reads are linearizable etcd reads.
func StoreDesired(st Store) DesiredFunc { return CachedDesired(st, nil, nil) }

// DesiredCache is a watch cache of Machines or Images (*store.Cache, the
// replica's resources.Caches).
type DesiredCache interface {
	// Get returns the cached object (shared: read only).
	Get(name string) (store.Item, bool)
	// Synced reports whether the cache's first listing is in.
	Synced() bool
}

var _ DesiredCache = (*store.Cache)(nil)

// CachedDesired is StoreDesired reading the Machine from machines and
// the Image from images where they hold them: no etcd round trip per
// reconcile (two linearizable reads before, 6 % of the CPU of a
// 10,000-host wave, docs/scale.md). A nil or not yet synced cache, a
// Machine or Image the cache does not hold, and a cached Machine bound to
// another host are read from etcd, so every "it does not exist" (a host
// then wants no image, or is blocked on a missing image) is decided on a
// linearizable read, as before.
//
// Why no read-your-writes wait (the cluster executor waits for its own
// host writes): the executor writes neither Machines nor Images, so it
// has no write of its own to wait for, and a wait on the host's revision
// would stall on an idle kind's cache (it moves only with a progress
// notification) for every reconcile. What a cache hit can be behind on:
// a Machine's spec is immutable (validation refuses a change), so a
// cached Machine is the stored one until it is deleted, and a host is
// unbound by a write of the host, which the executor reads from etcd;
// a deleted Machine still cached for the watch's delay is read as
// wanted for as long, which is what a reconcile just before the delete
// would have seen. An Image changed in place (its URL, its sha256) is
// seen after the watch's delay; the executor does not follow Images
// either way (a host's change, or the resync, plans it again).
func CachedDesired(st Store, machines, images DesiredCache) DesiredFunc {
	return func(ctx context.Context, h *typesv1.Host) (hostlife.Desired, error) {
		name := h.GetStatus().GetMachine()
		if name == "" {
			return hostlife.Desired{}, nil
		}
		m, err := cachedGet(ctx, st, machines, "machines", name, func() proto.Message { return &typesv1.Machine{} })
		if errdefs.IsNotFound(err) {
			return hostlife.Desired{}, nil
		}
		if err != nil {
			return hostlife.Desired{}, err
		}
		if bound := m.(*typesv1.Machine).GetSpec().GetHost(); bound != "" && bound != h.GetMetadata().GetName() && machines != nil {
			// A cached Machine bound elsewhere: ask etcd (a stale hit).
			if m, err = cachedGet(ctx, st, nil, "machines", name, func() proto.Message { return &typesv1.Machine{} }); errdefs.IsNotFound(err) {
				return hostlife.Desired{}, nil
			} else if err != nil {
				return hostlife.Desired{}, err
			}
		}
		imgName := m.(*typesv1.Machine).GetSpec().GetImage()
		if imgName == "" {
			return hostlife.Desired{}, nil
		}
		img, err := cachedGet(ctx, st, images, "images", imgName, func() proto.Message { return &typesv1.Image{} })
		if errdefs.IsNotFound(err) {
			return hostlife.Desired{Machine: name, ImageName: imgName, Blocked: &hostlife.Blocked{
				Reason: "ImageNotFound",
				Message: fmt.Sprintf("machine %s names image %s, which does not exist: kilnctl get images lists those that do; apply the image, or delete the machine so its owner creates one with an image that exists",
					name, imgName),
			}}, nil
		}
		if err != nil {
			return hostlife.Desired{}, fmt.Errorf("machine %s: image %s: %w", name, imgName, err)
		}
		return hostlife.Desired{Machine: name, ImageName: imgName, Image: img.(*typesv1.Image).GetSpec()}, nil
	}
}

// cachedGet returns object name of kind from c when it holds it (shared:
// read only), else from etcd (NotFound when etcd has none).
func cachedGet(ctx context.Context, st Store, c DesiredCache, kind, name string, newMsg func() proto.Message) (proto.Message, error) {
	if c != nil && c.Synced() {
		if it, ok := c.Get(name); ok {
			return it.Msg, nil
		}
	}
	m := newMsg()
	if _, err := st.Get(ctx, kind, name, m); err != nil {
		return nil, err
	}
	return m, nil
}
