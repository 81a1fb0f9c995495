// Package clusterexec runs what the planners decide for each Cluster: it
// gathers the cluster's ControlPlanes, MachineDeployments, HealthChecks,
// Machines and the Hosts, calls the pure planners of controller/clusterplan,
// stores their status and performs their actions (CreateMachine, Drain,
// RemoveEtcdMember, DeleteMachine). It then plans every Machine of the
// cluster with controller/machineplan and performs what that planner
// decides: bind the host (Host.status.machine, compare-and-swap, so two
// planners never take one host), bootstrap the node through its agent
// (Prepare, Preflight, then KubeadmInit or KubeadmJoin) or re-attach to the
// operation an earlier controller started, probe it, tear it down. The
// executor chooses no phase, retry or clean-up: it records what happened
// (the attempt it starts, before it starts it; an operation's outcome) in
// the store, where the next plan reads it, and it plans a cluster again
// when a planner asks to (their Requeue, through the work queue's
// AddAfter).
//
// The credentials kubeadm init returns (join token, certificate key,
// admin kubeconfig) are kept sealed in a store secret
// (BootstrapSecretPath); only the CA hash goes into Cluster.status.
//
// Only the leader runs an Executor.
package clusterexec

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/utils/clock"

	"github.com/kilnhq/kiln/controller/cacheindex"
	"github.com/kilnhq/kiln/controller/clusterplan"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/machineplan"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Store kinds.
const (
	ClustersKind           = "clusters"
	ControlPlanesKind      = "controlplanes"
	MachineDeploymentsKind = "machinedeployments"
	MachinesKind           = "machines"
	HostsKind              = "hosts"
	HealthChecksKind       = "healthchecks"
	ImagesKind             = "images"
)

// Machine annotations, phases and conditions: the Machine planner's
// (controller/machineplan), named here too for the executor's users.
const (
	AnnotationBootstrap  = machineplan.AnnotationBootstrap
	AnnotationAttempt    = machineplan.AnnotationAttempt
	AnnotationClusterUID = machineplan.AnnotationClusterUID

	PhasePending       = machineplan.PhasePending
	PhaseProvisioning  = machineplan.PhaseProvisioning
	PhaseBootstrapping = machineplan.PhaseBootstrapping
	PhaseWaiting       = machineplan.PhaseWaiting
	PhaseRunning       = machineplan.PhaseRunning
	PhaseFailed        = machineplan.PhaseFailed
	PhaseDeleting      = machineplan.PhaseDeleting

	ConditionBootstrapped    = machineplan.ConditionBootstrapped
	ConditionBootstrapFailed = machineplan.ConditionBootstrapFailed
	ConditionHostProvisioned = machineplan.ConditionHostProvisioned
)

// ReasonRemediated is the reason of the Cluster event recorded when a
// HealthCheck remediates one of its machines.
const ReasonRemediated = "Remediated"

// Store is what the executor needs of the store (*store.Store).
type Store interface {
	Get(ctx context.Context, kind, name string, into proto.Message) (int64, error)
	Create(ctx context.Context, kind, name string, m proto.Message) (int64, error)
	Update(ctx context.Context, kind, name string, m proto.Message, expectRev int64) (int64, error)
	Delete(ctx context.Context, kind, name string, expectRev int64) error
	List(ctx context.Context, kind string, newMsg func() proto.Message, opts store.ListOptions) ([]store.Item, string, error)
	PutSecret(ctx context.Context, path string, plaintext []byte) error
	GetSecret(ctx context.Context, path string) ([]byte, error)
	DeleteSecret(ctx context.Context, path string) error
	// CheckFence returns an error (store.ErrFenced) once this leader's
	// term is over (store.Store.Fenced); the executor checks it before
	// every step whose start writes nothing.
	CheckFence(ctx context.Context) error
}

var _ Store = (*store.Store)(nil)

// Recorder records events (*events.Recorder).
type Recorder interface {
	Record(ctx context.Context, kind, name, typ, reason, message string)
}

// AgentDialer returns a client of the agent of a host
// (provision.AgentPool.Dial).
type AgentDialer func(ctx context.Context, h *typesv1.Host) (agentv1.AgentClient, error)

// DrainFunc drains node through the cluster's admin kubeconfig
// (drain.Drain).
type DrainFunc func(ctx context.Context, kubeconfig []byte, node string, timeout time.Duration) error

// DeleteNodeFunc deletes a Node object from a cluster (drain.DeleteNode).
type DeleteNodeFunc func(ctx context.Context, kubeconfig []byte, node string) error

// Config configures an Executor.
type Config struct {
	// Interval is how often every cluster is planned and its machines
	// probed (default 10s).
	Interval time.Duration
	// OperationTimeout bounds one kubeadm operation (default 15m).
	OperationTimeout time.Duration
	// CallTimeout bounds a short agent call: Probe (default 30s).
	CallTimeout time.Duration
	// PreflightTimeout bounds the agent's Preflight (default 1m): its
	// version queries may take up to preflight.VersionTimeout each on a
	// slow host.
	PreflightTimeout time.Duration
	// Workers is how many machines of a cluster are worked on at once,
	// and how many bootstraps run at once in all (default 16).
	Workers int
	// ClusterWorkers is how many clusters are reconciled at once
	// (default 8). One cluster is never reconciled by two at once.
	ClusterWorkers int
	// LongActions is how many long actions (drain, kubeadm reset with
	// etcd member removal, machine deletion) run at once across all
	// clusters (default 16); each cluster runs at most one at a time.
	LongActions int
	// DrainTimeout is the deadline of a drain whose action names none: a
	// control-plane machine's, or a MachineDeployment's without
	// nodeDrainTimeout (default DefaultDrainTimeout). When it passes the
	// removal halts with Drained=False, reason DrainTimeout, and the
	// drain is tried again.
	DrainTimeout time.Duration
	// Machines is the Machine planner's policy (attempts, backoff).
	Machines machineplan.Config
	// Clock is the time source (time.Now).
	Clock func() time.Time
	// QueueClock is the work queue's clock, which times the planners'
	// requeues (AddAfter) and the retries of failed reconciles; nil is
	// the real clock. Tests give a fake one alongside Clock.
	QueueClock clock.WithTicker
}

// DefaultDrainTimeout is Config.DrainTimeout's default.
const DefaultDrainTimeout = 5 * time.Minute

// Deps are the executor's collaborators.
type Deps struct {
	Store    Store
	Recorder Recorder
	Agents   AgentDialer
	// Drain drains nodes; nil skips draining (condition Drained True,
	// reason DrainSkipped).
	Drain DrainFunc
	// DeleteNode removes a deleted machine's Node object, so that its
	// host can join again under the same name; nil leaves it.
	DeleteNode DeleteNodeFunc
	// KubeClient builds a client of a cluster from its admin kubeconfig,
	// for the upgrade steps (upgrade.go); nil uses client-go's.
	KubeClient KubeClientFunc
	// Observer, when set, is told of finished operations and of each
	// cluster reconcile (metrics).
	Observer Observer
	// Hosts, when set, is where a reconcile reads every Host for the
	// planners' choice of spare hosts: a store.Cache of HostsKind, run by
	// the caller. Hosts are the fleet's largest kind and each cluster
	// reconcile read them all, so without it a pass over the clusters
	// costs clusters × hosts. A host changed by someone else may be stale
	// there (binding it is a compare-and-swap on the stored host), but
	// never older than the executor's own last bind or unbind: a reconcile
	// waits for the cache to hold it first (read-your-writes), and reads
	// etcd when that takes longer than HostCacheWait. Nil lists them from
	// Store.
	Hosts HostCache
}

// HostCache is a store.Cache of hosts with the cacheindex.State index
// (NewHostCache, or the replica's resources.Caches).
type HostCache interface {
	// RangeIndex calls fn with each host the index puts under value
	// (read only), until fn returns false.
	RangeIndex(name, value string, fn func(store.Item) bool)
	// WaitRevision returns once the cache holds revision rev.
	WaitRevision(ctx context.Context, rev int64) error
}

// HostCacheWait bounds how long a reconcile waits for Deps.Hosts to hold
// the executor's own last host write before it lists the hosts from etcd
// instead.
const HostCacheWait = 5 * time.Second

// HostCacheWaitMsg is the Debug message of a reconcile that waited 10 ms
// or more for the host cache to hold its own last host write (attribute
// "waited").
const HostCacheWaitMsg = "waited for the host cache to hold the executor's own host write"

// HostCacheFallbackMsg is the Debug message of a reconcile that waited
// HostCacheWait for the host cache in vain and lists the hosts from etcd.
const HostCacheFallbackMsg = "host cache behind the executor's own host write; listing hosts from etcd"

// NewHostCache returns a cache of the Hosts of st for Deps.Hosts; the
// caller runs it (Run) while the Executor runs.
func NewHostCache(st *store.Store) *store.Cache {
	c := store.NewCache(st, HostsKind, func() proto.Message { return &typesv1.Host{} })
	c.KeepEncoded() // as the replica's cache of Hosts
	cacheindex.Add(c, &typesv1.Host{})
	return c
}

// Observer is told what the executor did (*metrics.Metrics). Its methods
// must not block.
type Observer interface {
	// ObserveOperationOutcome records an operation that ended: op is
	// Prepare, Preflight, KubeadmInit, KubeadmJoin, KubeadmReset, Drain
	// or Remediation; outcome one of hostlife's Outcome*.
	ObserveOperationOutcome(op, outcome string, d time.Duration)
	// ObserveReconcile records one reconcile of a cluster (controller
	// "clusters") and the queue depth after it.
	ObserveReconcile(controller string, err error, d time.Duration, queueDepth int)
}

// observe reports operation op that started at start and ended with err.
func (e *Executor) observe(op string, start time.Time, err error) {
	o := e.deps.Observer
	if o == nil {
		return
	}
	outcome := hostlife.OutcomeSuccess
	switch {
	case err == nil:
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, errdefs.ErrDeadlineExceeded):
		outcome = hostlife.OutcomeTimeout
	default:
		outcome = hostlife.OutcomeFailure
	}
	o.ObserveOperationOutcome(op, outcome, e.cfg.Clock().Sub(start))
}

// Executor runs the cluster planners and bootstraps machines.
type Executor struct {
	cfg  Config
	deps Deps
	log  *slog.Logger

	// Bootstraps run in the background, at most Workers at once, so a
	// kubeadm join that takes minutes holds up no other machine's probe.
	boots   sync.WaitGroup
	bootSem chan struct{}
	// Long actions run in the background, one per cluster and at most
	// LongActions at once (run.go).
	longs   sync.WaitGroup
	longSem chan struct{}
	mu      sync.Mutex
	booting map[string]bool
	running map[string]string // cluster -> its long action in flight
	// hostRev is the newest revision of a host the executor wrote or read
	// to write (updateHost): what a reconcile's read of Deps.Hosts must
	// hold.
	hostRev atomic.Int64
	queue   clusterQueue // set while Run runs
}

// New returns an Executor; Run starts it.
func New(deps Deps, cfg Config, log *slog.Logger) *Executor {
	if cfg.Interval <= 0 {
		cfg.Interval = 10 * time.Second
	}
	if cfg.OperationTimeout <= 0 {
		cfg.OperationTimeout = 15 * time.Minute
	}
	if cfg.CallTimeout <= 0 {
		cfg.CallTimeout = 30 * time.Second
	}
	if cfg.PreflightTimeout <= 0 {
		cfg.PreflightTimeout = time.Minute
	}
	if cfg.Workers <= 0 {
		cfg.Workers = 16
	}
	if cfg.ClusterWorkers <= 0 {
		cfg.ClusterWorkers = 8
	}
	if cfg.LongActions <= 0 {
		cfg.LongActions = 16
	}
	if cfg.DrainTimeout <= 0 {
		cfg.DrainTimeout = DefaultDrainTimeout
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Executor{cfg: cfg, deps: deps, log: log.With("component", "clusterexec"),
		bootSem: make(chan struct{}, cfg.Workers), longSem: make(chan struct{}, cfg.LongActions),
		booting: map[string]bool{}, running: map[string]string{}}
}

// Collect runs the fleet-wide clean-up machineplan.PlanCleanup decides:
// it deletes the Machines of deleted Clusters (their nodes are not reset
// one by one: the whole cluster is gone) and the sealed bootstrap
// credentials of those Clusters, and releases the hosts bound to Machines
// that no longer exist (deleted through the API, which skips kubeadm
// reset), which the host lifecycle then wipes and makes Available. A
// deleted cluster's ControlPlane, MachineDeployments and HealthChecks
// stay until they are deleted too (they act again if a Cluster of that
// name is created).
func (e *Executor) Collect(ctx context.Context) error {
	// Hosts, then machines, then clusters (see machineplan.CleanupInput).
	var in machineplan.CleanupInput
	hosts, err := store.ListAll(ctx, e.deps.Store, HostsKind, func() proto.Message { return &typesv1.Host{} })
	if err != nil {
		return err
	}
	for _, it := range hosts {
		in.Hosts = append(in.Hosts, it.Msg.(*typesv1.Host))
	}
	ms, err := store.ListAll(ctx, e.deps.Store, MachinesKind, func() proto.Message { return &typesv1.Machine{} })
	if err != nil {
		return err
	}
	for _, it := range ms {
		in.Machines = append(in.Machines, it.Msg.(*typesv1.Machine))
	}
	cs, err := store.ListAll(ctx, e.deps.Store, ClustersKind, func() proto.Message { return &typesv1.Cluster{} })
	if err != nil {
		return err
	}
	for _, it := range cs {
		in.Clusters = append(in.Clusters, it.Msg.(*typesv1.Cluster))
	}
	var errs []error
	for _, act := range machineplan.PlanCleanup(in) {
		switch a := act.(type) {
		case machineplan.DeleteClusterMachine:
			if err := e.deps.Store.Delete(ctx, MachinesKind, a.Machine, 0); err != nil && !errdefs.IsNotFound(err) {
				errs = append(errs, fmt.Errorf("machine %s of deleted cluster %s: %w", a.Machine, a.Cluster, err))
				continue
			}
			e.log.Info("machine deleted: its cluster is gone", "machine", a.Machine, "cluster", a.Cluster, "host", a.Host)
			e.clusterEvent(ctx, a.Cluster, "Normal", "MachineDeleted",
				fmt.Sprintf("cluster %s was deleted: machine %s deleted; its host %s is released, wiped and becomes Available", a.Cluster, a.Machine, a.Host))
		case machineplan.DeleteCredentials:
			if err := e.deps.Store.DeleteSecret(ctx, BootstrapSecretPath(a.Cluster)); err != nil && !errdefs.IsNotFound(err) {
				errs = append(errs, fmt.Errorf("bootstrap credentials of deleted cluster %s: %w", a.Cluster, err))
			}
		case machineplan.ReleaseHost:
			if err := e.unbind(ctx, a.Host, a.Machine); err != nil {
				errs = append(errs, fmt.Errorf("host %s: %w", a.Host, err))
				continue
			}
			e.log.Info("host released: its machine is gone", "host", a.Host, "machine", a.Machine)
			if e.deps.Recorder != nil {
				e.deps.Recorder.Record(ctx, HostsKind, a.Host, "Normal", "Released", "machine "+a.Machine+" no longer exists; the host is wiped and becomes Available")
			}
		}
	}
	return errors.Join(errs...)
}

// Reconcile plans cluster name once, runs the planned actions and plans
// and brings each of its machines one step forward (machineplan). Short
// actions (CreateMachine, binds, probes, each agent call under its
// deadline) run before it returns; long ones (a drain, an etcd member
// removal, a machine teardown with its kubeadm reset, a bootstrap) are
// started in the background under ctx, one removal per cluster at a time,
// and a later Reconcile sees their outcome (Wait waits for them). It
// returns the errors of the short actions and machines joined; a NotFound
// cluster is no error.
func (e *Executor) Reconcile(ctx context.Context, name string) error {
	_, err := e.reconcile(ctx, name)
	return err
}

// reconcile is Reconcile; it also returns the earliest of the planners'
// requeues (0: none), when Run plans the cluster again even if nothing
// changes.
func (e *Executor) reconcile(ctx context.Context, name string) (time.Duration, error) {
	c := &typesv1.Cluster{}
	if _, err := e.deps.Store.Get(ctx, ClustersKind, name, c); err != nil {
		if errdefs.IsNotFound(err) {
			return 0, nil
		}
		return 0, fmt.Errorf("cluster %s: %w", name, err)
	}
	if c.GetSpec().GetPaused() {
		return 0, nil
	}
	w, err := e.gather(ctx, name)
	if err != nil {
		return 0, fmt.Errorf("cluster %s: %w", name, err)
	}
	now := e.cfg.Clock()
	var requeue time.Duration
	var actions []clusterplan.Action
	var cp *typesv1.ControlPlane
	for _, it := range w.cps {
		x := it.Msg.(*typesv1.ControlPlane)
		p := clusterplan.PlanControlPlane(clusterplan.ControlPlaneInput{Cluster: c, ControlPlane: x, Machines: w.machines, Hosts: w.hosts, Images: w.images}, now)
		e.warnStuck(ctx, ControlPlanesKind, it.Name, x.GetStatus().GetConditions(), p.Status.GetConditions())
		e.storeStatus(ctx, ControlPlanesKind, it.Name, x, func(m proto.Message) { m.(*typesv1.ControlPlane).Status = p.Status })
		x.Status = p.Status
		if cp == nil {
			cp = x
		}
		actions = append(actions, p.Actions...)
		requeue = minPositive(requeue, p.Requeue)
	}
	for _, it := range w.mds {
		x := it.Msg.(*typesv1.MachineDeployment)
		p := clusterplan.PlanMachineDeployment(clusterplan.DeploymentInput{Cluster: c, ControlPlane: cp, MachineDeployment: x, Machines: w.machines, Hosts: w.hosts, Images: w.images}, now)
		e.warnStuck(ctx, MachineDeploymentsKind, it.Name, x.GetStatus().GetConditions(), p.Status.GetConditions())
		e.storeStatus(ctx, MachineDeploymentsKind, it.Name, x, func(m proto.Message) { m.(*typesv1.MachineDeployment).Status = p.Status })
		x.Status = p.Status
		actions = append(actions, p.Actions...)
		requeue = minPositive(requeue, p.Requeue)
	}
	var mine []*typesv1.Machine
	for _, m := range w.machines {
		if m.GetSpec().GetCluster() == name {
			mine = append(mine, m)
		}
	}
	summary := clusterplan.ClusterInput{Cluster: c, Machines: mine}
	for _, it := range w.cps {
		summary.ControlPlanes = append(summary.ControlPlanes, it.Msg.(*typesv1.ControlPlane))
	}
	for _, it := range w.mds {
		summary.MachineDeployments = append(summary.MachineDeployments, it.Msg.(*typesv1.MachineDeployment))
	}
	e.storeStatus(ctx, ClustersKind, name, c, func(m proto.Message) {
		// Planned over the Cluster as stored now: the fields the executor
		// writes (caHash, apiServerVersion, addons, the AddonUpgrade
		// condition) may have moved on since c was read.
		x := m.(*typesv1.Cluster)
		in := summary
		in.Cluster = x
		x.Status = clusterplan.PlanClusterStatus(in, now)
	})
	for _, it := range w.hcs {
		x := it.Msg.(*typesv1.HealthCheck)
		p := clusterplan.PlanHealthCheck(clusterplan.HealthCheckInput{HealthCheck: x, Machines: mine}, now)
		e.warnStuck(ctx, HealthChecksKind, it.Name, x.GetStatus().GetConditions(), p.Status.GetConditions())
		e.storeStatus(ctx, HealthChecksKind, it.Name, x, func(m proto.Message) { m.(*typesv1.HealthCheck).Status = p.Status })
		for machine, why := range p.Unhealthy {
			e.log.Info("machine unhealthy", "machine", machine, "why", why)
		}
		actions = append(actions, p.Actions...)
		requeue = minPositive(requeue, p.Requeue)
	}
	var errs []error
	for _, a := range actions {
		if err := e.do(ctx, c, a); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", a, err))
		}
	}
	// The machines are planned with the cluster as it is now (its CA
	// hash may have come since c was read) and whether its init's
	// credentials are stored.
	// (A new message: actions started above read c in the background.)
	fresh := &typesv1.Cluster{}
	switch _, err := e.deps.Store.Get(ctx, ClustersKind, name, fresh); {
	case err == nil:
		c = fresh
	case !errdefs.IsNotFound(err):
		return 0, fmt.Errorf("cluster %s: %w", name, err)
	}
	_, err = LoadBootstrap(ctx, e.deps.Store, name)
	if err != nil && !errdefs.IsNotFound(err) {
		return 0, err
	}
	mreq, merr := e.advanceAll(ctx, c, err == nil)
	requeue = minPositive(requeue, mreq)
	errs = append(errs, merr)
	errs = append(errs, e.syncAddons(ctx, c, mine))
	return requeue, errors.Join(errs...)
}

// world is what the planners read of one cluster.
type world struct {
	cps, mds, hcs []store.Item
	machines      []*typesv1.Machine
	hosts         []*typesv1.Host
	images        []*typesv1.Image
}

func (e *Executor) gather(ctx context.Context, cluster string) (*world, error) {
	w := &world{}
	st := e.deps.Store
	cps, err := store.ListAll(ctx, st, ControlPlanesKind, func() proto.Message { return &typesv1.ControlPlane{} })
	if err != nil {
		return nil, err
	}
	for _, it := range cps {
		if it.Msg.(*typesv1.ControlPlane).GetSpec().GetCluster() == cluster {
			w.cps = append(w.cps, it)
		}
	}
	mds, err := store.ListAll(ctx, st, MachineDeploymentsKind, func() proto.Message { return &typesv1.MachineDeployment{} })
	if err != nil {
		return nil, err
	}
	for _, it := range mds {
		if it.Msg.(*typesv1.MachineDeployment).GetSpec().GetCluster() == cluster {
			w.mds = append(w.mds, it)
		}
	}
	hcs, err := store.ListAll(ctx, st, HealthChecksKind, func() proto.Message { return &typesv1.HealthCheck{} })
	if err != nil {
		return nil, err
	}
	for _, it := range hcs {
		if it.Msg.(*typesv1.HealthCheck).GetSpec().GetCluster() == cluster {
			w.hcs = append(w.hcs, it)
		}
	}
	// All machines: a host bound to another cluster's machine is not
	// spare for this one.
	ms, err := store.ListAll(ctx, st, MachinesKind, func() proto.Message { return &typesv1.Machine{} })
	if err != nil {
		return nil, err
	}
	for _, it := range ms {
		w.machines = append(w.machines, it.Msg.(*typesv1.Machine))
	}
	if w.hosts, err = e.availableHosts(ctx); err != nil {
		return nil, err
	}
	imgs, err := store.ListAll(ctx, st, ImagesKind, func() proto.Message { return &typesv1.Image{} })
	if err != nil {
		return nil, err
	}
	for _, it := range imgs {
		w.images = append(w.images, it.Msg.(*typesv1.Image))
	}
	return w, nil
}

// availableHosts returns the Hosts the planners may choose spares from
// (clusterplan picks the Available, unbound ones that match a selector):
// from Deps.Hosts' State index once the cache holds the executor's own
// last host write (read-your-writes: a reconcile must not plan with a
// host older than its own bind), else every Host from etcd. From the
// cache, each Available host is decoded in turn and kept only as what the
// planners read of it (name, labels, state, machine): a fleet of
// provisioned hosts costs a reconcile no decode, and 100,000 Available
// ones not 330 MiB held at once.
func (e *Executor) availableHosts(ctx context.Context) ([]*typesv1.Host, error) {
	if e.deps.Hosts != nil {
		rev := e.hostRev.Load()
		start := time.Now()
		wctx, cancel := context.WithTimeout(ctx, HostCacheWait)
		err := e.deps.Hosts.WaitRevision(wctx, rev)
		cancel()
		if waited := time.Since(start); waited >= 10*time.Millisecond {
			e.log.Debug(HostCacheWaitMsg, "revision", rev, "waited", waited)
		}
		if err == nil {
			var out []*typesv1.Host
			e.deps.Hosts.RangeIndex(cacheindex.State, typesv1.HostState_HOST_STATE_AVAILABLE.String(), func(it store.Item) bool {
				out = append(out, spareView(it.Msg.(*typesv1.Host)))
				return true
			})
			return out, nil
		}
		if ctx.Err() != nil {
			return nil, err
		}
		e.log.Debug(HostCacheFallbackMsg, "revision", rev, "err", err)
	}
	items, err := store.ListAll(ctx, e.deps.Store, HostsKind, func() proto.Message { return &typesv1.Host{} })
	if err != nil {
		return nil, err
	}
	out := make([]*typesv1.Host, len(items))
	for i, it := range items {
		out[i] = it.Msg.(*typesv1.Host)
	}
	return out, nil
}

// spareView is what the planners read of a host to choose spares: its
// name, labels, state and machine.
func spareView(h *typesv1.Host) *typesv1.Host {
	return &typesv1.Host{
		Metadata: &typesv1.ObjectMeta{Name: h.GetMetadata().GetName(), Labels: h.GetMetadata().GetLabels()},
		Status:   &typesv1.HostStatus{State: h.GetStatus().GetState(), Machine: h.GetStatus().GetMachine()},
	}
}

// sawHost notes revision rev of a host the executor read to change or
// wrote (hostRev).
func (e *Executor) sawHost(rev int64) {
	for {
		cur := e.hostRev.Load()
		if rev <= cur || e.hostRev.CompareAndSwap(cur, rev) {
			return
		}
	}
}

// warnStuck records a Warning event for each condition that newly holds
// the object back (clusterplan.Stuck), so `kilnctl get events` and
// describe show it when it happens.
func (e *Executor) warnStuck(ctx context.Context, kind, name string, before, after []*typesv1.Condition) {
	if e.deps.Recorder == nil {
		return
	}
	for _, c := range after {
		if !clusterplan.Stuck(c) {
			continue
		}
		if old := conditions.Get(before, c.GetType()); old != nil && old.GetStatus() == c.GetStatus() && old.GetReason() == c.GetReason() && old.GetMessage() == c.GetMessage() {
			continue
		}
		e.deps.Recorder.Record(ctx, kind, name, "Warning", c.GetReason(), c.GetType()+": "+c.GetMessage())
	}
}

// storeStatus writes a planner's status unless it is unchanged; a
// conflict is left to the next pass.
func (e *Executor) storeStatus(ctx context.Context, kind, name string, old proto.Message, set func(proto.Message)) {
	fresh := old.ProtoReflect().New().Interface()
	rev, err := e.deps.Store.Get(ctx, kind, name, fresh)
	if err != nil {
		return
	}
	next := proto.Clone(fresh)
	set(next)
	if proto.Equal(fresh, next) {
		return
	}
	if _, err := e.deps.Store.Update(ctx, kind, name, next, rev); err != nil && !errdefs.IsConflict(err) && ctx.Err() == nil {
		e.log.Warn("store status", "kind", kind, "name", name, "err", err)
	}
}

// advanceAll plans and advances each machine of cluster c, Workers at a
// time; it returns the earliest of their requeues (0: none).
func (e *Executor) advanceAll(ctx context.Context, c *typesv1.Cluster, creds bool) (time.Duration, error) {
	cluster := c.GetMetadata().GetName()
	items, err := store.ListAll(ctx, e.deps.Store, MachinesKind, func() proto.Message { return &typesv1.Machine{} })
	if err != nil {
		return 0, err
	}
	var (
		mu      sync.Mutex
		errs    []error
		requeue time.Duration
		wg      sync.WaitGroup
		sem     = make(chan struct{}, e.cfg.Workers)
	)
	// Control-plane machines first: a worker's join needs the init.
	sort.SliceStable(items, func(i, j int) bool {
		return items[i].Msg.(*typesv1.Machine).GetSpec().GetRole() == clusterplan.RoleControlPlane &&
			items[j].Msg.(*typesv1.Machine).GetSpec().GetRole() != clusterplan.RoleControlPlane
	})
	for _, it := range items {
		m := it.Msg.(*typesv1.Machine)
		if m.GetSpec().GetCluster() != cluster {
			continue
		}
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			d, err := e.advance(ctx, c, creds, it.Name)
			mu.Lock()
			defer mu.Unlock()
			requeue = minPositive(requeue, d)
			if err != nil {
				errs = append(errs, fmt.Errorf("machine %s: %w", it.Name, err))
			}
		}()
	}
	wg.Wait()
	return requeue, errors.Join(errs...)
}

// minPositive is the smaller of a and b, ignoring one that is not
// positive.
func minPositive(a, b time.Duration) time.Duration {
	switch {
	case a <= 0:
		return b
	case b <= 0 || a < b:
		return a
	}
	return b
}

// do runs one planned action: CreateMachine at once, the long ones in
// the background (startLong; skipped while the cluster runs another, the
// planners plan it again).
func (e *Executor) do(ctx context.Context, c *typesv1.Cluster, a clusterplan.Action) error {
	cluster := c.GetMetadata().GetName()
	switch a := a.(type) {
	case clusterplan.CreateMachine:
		return e.createMachine(ctx, c, a)
	case clusterplan.Drain:
		e.startLong(ctx, cluster, a.String(), func(ctx context.Context) error { return e.drain(ctx, c, a) })
		return nil
	case clusterplan.RemoveEtcdMember:
		e.startLong(ctx, cluster, a.String(), func(ctx context.Context) error { return e.removeEtcdMember(ctx, a) })
		return nil
	case clusterplan.DeleteMachine:
		e.startLong(ctx, cluster, a.String(), func(ctx context.Context) error {
			start := e.cfg.Clock()
			if a.Remediation && e.deps.Recorder != nil {
				// On the Cluster too: a Rollout halts on a remediation in
				// its wave (controller/rolloutexec reads these events).
				e.deps.Recorder.Record(ctx, ClustersKind, cluster, "Warning", ReasonRemediated, "machine "+a.Machine+": "+a.Reason)
			}
			err := e.deleteMachine(ctx, c, a.Machine, a.Reason)
			if a.Remediation && ctx.Err() == nil {
				e.observe("Remediation", start, err)
			}
			return err
		})
		return nil
	}
	return errdefs.InvalidArgument("unknown action %T", a)
}

// createMachine creates the Machine and binds its host. When another
// planner took the host first, the Machine is deleted again and the next
// pass plans with another host.
func (e *Executor) createMachine(ctx context.Context, c *typesv1.Cluster, a clusterplan.CreateMachine) error {
	now := timestamppb.New(e.cfg.Clock())
	m := &typesv1.Machine{
		ApiVersion: "kiln.dev/v1", Kind: "Machine",
		Metadata: &typesv1.ObjectMeta{
			Name: a.Machine, Generation: 1, CreationTimestamp: now, Uid: newUID(),
			Annotations: map[string]string{AnnotationBootstrap: a.Bootstrap},
			// Labels HealthCheck selectors match on.
			Labels: map[string]string{"cluster": c.GetMetadata().GetName(), "role": a.Role},
		},
		Spec:   &typesv1.MachineSpec{Cluster: c.GetMetadata().GetName(), Role: a.Role, Host: a.Host, Version: a.Version, Image: a.Image, Owner: a.Owner},
		Status: &typesv1.MachineStatus{Phase: PhasePending},
	}
	if md, ok := strings.CutPrefix(a.Owner, "MachineDeployment/"); ok {
		// A worker pool's HealthCheck selects its machines by it
		// (controller/topologyplan).
		m.Metadata.Labels["deployment"] = md
	}
	if uid := c.GetMetadata().GetUid(); uid != "" {
		m.Metadata.Annotations[AnnotationClusterUID] = uid
	}
	if _, err := e.deps.Store.Create(ctx, MachinesKind, a.Machine, m); err != nil {
		if errdefs.IsAlreadyExists(err) {
			return nil // an earlier pass created it; advance binds it
		}
		return fmt.Errorf("create machine: %w", err)
	}
	e.event(ctx, a.Machine, "Normal", "Created", fmt.Sprintf("machine created on host %s (%s, bootstrap %s)", a.Host, a.Role, a.Bootstrap))
	e.log.Info("machine created", "machine", a.Machine, "host", a.Host, "bootstrap", a.Bootstrap)
	// Bound at once, so that no other planner takes the host meanwhile;
	// when one did, the Machine planner tears the new machine down.
	if err := e.bind(ctx, a.Host, a.Machine); err != nil {
		e.event(ctx, a.Machine, "Warning", "HostTaken", err.Error())
		if !errdefs.IsConflict(err) && !errdefs.IsNotFound(err) {
			return err
		}
	}
	return nil
}

// bind sets host.status.machine to machine with compare-and-swap. It
// returns Conflict when the host is bound to another machine, NotFound
// when it does not exist.
func (e *Executor) bind(ctx context.Context, host, machine string) error {
	return e.updateHost(ctx, host, func(h *typesv1.Host) (bool, error) {
		switch cur := h.GetStatus().GetMachine(); cur {
		case machine:
			return false, nil
		case "":
			if h.Status == nil {
				h.Status = &typesv1.HostStatus{}
			}
			h.Status.Machine = machine
			return true, nil
		default:
			return false, errdefs.Conflict("host %s is bound to machine %s", host, cur)
		}
	})
}

// unbind clears host.status.machine if it names machine; the host
// lifecycle then deprovisions and wipes the host.
func (e *Executor) unbind(ctx context.Context, host, machine string) error {
	err := e.updateHost(ctx, host, func(h *typesv1.Host) (bool, error) {
		if h.GetStatus().GetMachine() != machine {
			return false, nil
		}
		h.Status.Machine = ""
		return true, nil
	})
	if errdefs.IsNotFound(err) {
		return nil
	}
	return err
}

// updateHost reads, changes and writes a host, again on a conflict (the
// host lifecycle and heartbeats write hosts too).
func (e *Executor) updateHost(ctx context.Context, name string, change func(*typesv1.Host) (bool, error)) error {
	for {
		h := &typesv1.Host{}
		rev, err := e.deps.Store.Get(ctx, HostsKind, name, h)
		if err != nil {
			return err
		}
		// What the change decided on (e.g. "already bound to this
		// machine") a later reconcile must see too.
		e.sawHost(rev)
		ok, err := change(h)
		if err != nil || !ok {
			return err
		}
		rev, err = e.deps.Store.Update(ctx, HostsKind, name, h, rev)
		if errdefs.IsConflict(err) && ctx.Err() == nil {
			continue
		}
		if err == nil {
			e.sawHost(rev)
		}
		return err
	}
}

// updateMachine reads, changes and writes a machine, again on a conflict.
// change returning false writes nothing.
func (e *Executor) updateMachine(ctx context.Context, name string, change func(*typesv1.Machine) bool) error {
	for {
		m := &typesv1.Machine{}
		rev, err := e.deps.Store.Get(ctx, MachinesKind, name, m)
		if err != nil {
			return err
		}
		if m.Status == nil {
			m.Status = &typesv1.MachineStatus{}
		}
		if !change(m) {
			return nil
		}
		_, err = e.deps.Store.Update(ctx, MachinesKind, name, m, rev)
		if errdefs.IsConflict(err) && ctx.Err() == nil {
			continue
		}
		return err
	}
}

func (e *Executor) event(ctx context.Context, machine, typ, reason, msg string) {
	if e.deps.Recorder != nil {
		e.deps.Recorder.Record(ctx, MachinesKind, machine, typ, reason, msg)
	}
}

// BootstrapSecretPath is the store secret holding a cluster's bootstrap
// credentials (a JSON Bootstrap).
func BootstrapSecretPath(cluster string) string { return "clusters/" + cluster + "/bootstrap" }

// Bootstrap are the credentials kubeadm init returned. They are sealed in
// the store and never logged.
type Bootstrap struct {
	JoinToken         string `json:"joinToken"`
	CertificateKey    string `json:"certificateKey"`
	Kubeconfig        string `json:"kubeconfig"`
	APIServerEndpoint string `json:"apiServerEndpoint"`
}

// LoadBootstrap reads the bootstrap credentials of cluster. It returns
// NotFound before the cluster's init finished.
func LoadBootstrap(ctx context.Context, st Store, cluster string) (*Bootstrap, error) {
	b, err := st.GetSecret(ctx, BootstrapSecretPath(cluster))
	if err != nil {
		return nil, err
	}
	out := &Bootstrap{}
	if err := json.Unmarshal(b, out); err != nil {
		return nil, fmt.Errorf("cluster %s: bootstrap secret: %w", cluster, err)
	}
	return out, nil
}

func newUID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
