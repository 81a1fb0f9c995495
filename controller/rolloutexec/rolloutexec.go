// Package rolloutexec runs what controller/rolloutplan decides for each
// Rollout: it gathers the Rollout, every Cluster with its ControlPlanes,
// MachineDeployments and HealthChecks, and the remediations their
// HealthChecks made (the clusters' Remediated events), plans, stores the
// Rollout's status, and only then performs the planned moves (a
// ControlPlane's or MachineDeployment's version or image, a Cluster's
// version, a topology version, a class revision pin), each a
// compare-and-swap write. Because the planner moves only clusters the
// stored status records as started, a controller that restarts anywhere
// neither moves a cluster twice nor skips one. It chooses nothing itself.
//
// Only the leader runs an Executor.
package rolloutexec

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"
	"k8s.io/client-go/util/workqueue"

	"github.com/kilnhq/kiln/controller/rolloutplan"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Store kinds.
const (
	RolloutsKind           = "rollouts"
	ClustersKind           = "clusters"
	ControlPlanesKind      = "controlplanes"
	MachineDeploymentsKind = "machinedeployments"
	HealthChecksKind       = "healthchecks"
)

// ReasonRemediated is the reason of the Cluster event the cluster
// executor records when a HealthCheck remediates one of its machines
// (clusterexec.ReasonRemediated).
const ReasonRemediated = "Remediated"

// Store is what the executor needs of the store (*store.Store).
type Store interface {
	Get(ctx context.Context, kind, name string, into proto.Message) (int64, error)
	Update(ctx context.Context, kind, name string, m proto.Message, expectRev int64) (int64, error)
	List(ctx context.Context, kind string, newMsg func() proto.Message, opts store.ListOptions) ([]store.Item, string, error)
}

var _ Store = (*store.Store)(nil)

// Events lists and records events (*events.Recorder).
type Events interface {
	List(ctx context.Context, kind, name string, limit int64) ([]*typesv1.Event, error)
	Record(ctx context.Context, kind, name, typ, reason, message string)
}

// Config configures an Executor.
type Config struct {
	// Interval is how often every Rollout is planned (default 10s).
	Interval time.Duration
	// Clock is the time source (time.Now).
	Clock func() time.Time
}

// Deps are the executor's collaborators.
type Deps struct {
	Store Store
	// Events may be nil: no remediation is seen and nothing recorded.
	Events Events
}

// Executor reconciles Rollouts.
type Executor struct {
	cfg  Config
	deps Deps
	log  *slog.Logger
}

// New returns an Executor; Run starts it.
func New(deps Deps, cfg Config, log *slog.Logger) *Executor {
	if cfg.Interval <= 0 {
		cfg.Interval = 10 * time.Second
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Executor{cfg: cfg, deps: deps, log: log.With("component", "rolloutexec")}
}

// Run reconciles every Rollout each Interval, and a Rollout again when
// its plan asks (a bake or timeout that runs out; at once after it started
// clusters). It blocks until ctx ends.
func (e *Executor) Run(ctx context.Context) error {
	q := workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[string](),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: "rolloutexec"})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			name, shutdown := q.Get()
			if shutdown {
				return
			}
			res, err := e.Reconcile(ctx, name)
			switch {
			case err != nil && ctx.Err() == nil:
				e.log.Warn("reconcile rollout", "rollout", name, "err", err)
				q.AddRateLimited(name)
			case err == nil:
				q.Forget(name)
				if res.Again {
					q.Add(name)
				} else if res.Requeue > 0 {
					q.AddAfter(name, res.Requeue)
				}
			}
			q.Done(name)
		}
	})
	t := time.NewTicker(e.cfg.Interval)
	defer t.Stop()
	for {
		items, _, err := e.deps.Store.List(ctx, RolloutsKind, func() proto.Message { return &typesv1.Rollout{} }, store.ListOptions{})
		if err != nil && ctx.Err() == nil {
			e.log.Warn("list rollouts", "err", err)
		}
		for _, it := range items {
			q.Add(it.Name)
		}
		select {
		case <-ctx.Done():
			q.ShutDown()
			wg.Wait()
			return nil
		case <-t.C:
		}
	}
}

// Result says when to reconcile a Rollout again.
type Result struct {
	// Again: at once (the status records newly started clusters).
	Again bool
	// Requeue: after this long at the latest (0: at the next Interval).
	Requeue time.Duration
}

// Reconcile plans Rollout name once: it stores the new status (CAS on
// the Rollout's revision) and then performs the moves. A conflict returns
// an error of class errdefs.ErrConflict and moves nothing; a missing
// Rollout is no error.
func (e *Executor) Reconcile(ctx context.Context, name string) (Result, error) {
	r := &typesv1.Rollout{}
	rev, err := e.deps.Store.Get(ctx, RolloutsKind, name, r)
	if errdefs.IsNotFound(err) {
		return Result{}, nil
	}
	if err != nil {
		return Result{}, err
	}
	if r.GetMetadata().GetDeletionTimestamp() != nil {
		return Result{}, nil
	}
	in, err := e.gather(ctx, r)
	if err != nil {
		return Result{}, err
	}
	now := e.cfg.Clock()
	p := rolloutplan.Decide(in, now)
	old := r.GetStatus()
	if !proto.Equal(old, p.Status) {
		next := proto.Clone(r).(*typesv1.Rollout)
		next.Status = p.Status
		if _, err := e.deps.Store.Update(ctx, RolloutsKind, name, next, rev); err != nil {
			return Result{}, fmt.Errorf("rollout %q: store status: %w", name, err)
		}
		e.recordChanges(ctx, name, old, p)
	}
	var firstErr error
	for _, a := range p.Actions {
		if err := e.do(ctx, a); err != nil {
			e.log.Warn("move cluster", "rollout", name, "action", a.String(), "err", err)
			if firstErr == nil {
				firstErr = fmt.Errorf("rollout %q: %s: %w", name, a, err)
			}
			continue
		}
	}
	return Result{Again: p.Replan, Requeue: p.Requeue}, firstErr
}

// gather reads what the planner decides from.
func (e *Executor) gather(ctx context.Context, r *typesv1.Rollout) (rolloutplan.Input, error) {
	in := rolloutplan.Input{Rollout: r}
	clusters, err := store.ListAll(ctx, e.deps.Store, ClustersKind, func() proto.Message { return &typesv1.Cluster{} })
	if err != nil {
		return in, err
	}
	cps, err := store.ListAll(ctx, e.deps.Store, ControlPlanesKind, func() proto.Message { return &typesv1.ControlPlane{} })
	if err != nil {
		return in, err
	}
	mds, err := store.ListAll(ctx, e.deps.Store, MachineDeploymentsKind, func() proto.Message { return &typesv1.MachineDeployment{} })
	if err != nil {
		return in, err
	}
	hcs, err := store.ListAll(ctx, e.deps.Store, HealthChecksKind, func() proto.Message { return &typesv1.HealthCheck{} })
	if err != nil {
		return in, err
	}
	byCluster := map[string]*rolloutplan.ClusterInput{}
	var order []string
	for _, it := range clusters {
		c := it.Msg.(*typesv1.Cluster)
		byCluster[it.Name] = &rolloutplan.ClusterInput{Cluster: c}
		order = append(order, it.Name)
	}
	for _, it := range cps {
		cp := it.Msg.(*typesv1.ControlPlane)
		if c := byCluster[cp.GetSpec().GetCluster()]; c != nil {
			c.ControlPlanes = append(c.ControlPlanes, cp)
		}
	}
	for _, it := range mds {
		md := it.Msg.(*typesv1.MachineDeployment)
		if c := byCluster[md.GetSpec().GetCluster()]; c != nil {
			c.Deployments = append(c.Deployments, md)
		}
	}
	for _, it := range hcs {
		hc := it.Msg.(*typesv1.HealthCheck)
		if c := byCluster[hc.GetSpec().GetCluster()]; c != nil {
			c.HealthChecks = append(c.HealthChecks, hc)
		}
	}
	// Remediations matter only for clusters the rollout started.
	if e.deps.Events != nil && r.GetSpec().GetHalt().GetOnRemediation() {
		for _, rc := range r.GetStatus().GetClusters() {
			c := byCluster[rc.GetName()]
			if c == nil {
				continue
			}
			evs, err := e.deps.Events.List(ctx, ClustersKind, rc.GetName(), 100)
			if err != nil {
				return in, fmt.Errorf("events of cluster %q: %w", rc.GetName(), err)
			}
			for _, ev := range evs {
				if ev.GetReason() == ReasonRemediated {
					c.Remediations = append(c.Remediations, ev.GetTime().AsTime())
				}
			}
		}
	}
	for _, name := range order {
		in.Clusters = append(in.Clusters, *byCluster[name])
	}
	return in, nil
}

// recordChanges records events for what the stored status changed:
// clusters started or done, and the phase.
func (e *Executor) recordChanges(ctx context.Context, name string, old *typesv1.RolloutStatus, p rolloutplan.Plan) {
	ev := e.deps.Events
	if ev == nil {
		return
	}
	for _, c := range p.Started {
		ev.Record(ctx, RolloutsKind, name, "Normal", "ClusterStarted", "cluster "+c+" started")
		ev.Record(ctx, ClustersKind, c, "Normal", "RolloutStarted", "rollout "+name+" started moving the cluster")
	}
	wasDone := map[string]bool{}
	for _, rc := range old.GetClusters() {
		wasDone[rc.GetName()] = rc.GetState() == rolloutplan.ClusterDone
	}
	for _, rc := range p.Status.GetClusters() {
		if rc.GetState() == rolloutplan.ClusterDone && !wasDone[rc.GetName()] {
			ev.Record(ctx, RolloutsKind, name, "Normal", "ClusterDone", "cluster "+rc.GetName()+" done (wave "+rc.GetWave()+")")
		}
	}
	if ph := p.Status.GetPhase(); ph != old.GetPhase() {
		typ, msg := "Normal", "phase "+ph
		for _, c := range p.Status.GetConditions() {
			if c.GetType() == rolloutplan.ConditionProgressing && c.GetStatus() == "False" {
				typ, msg = "Warning", msg+": "+c.GetMessage()
				if ph == rolloutplan.PhasePaused || ph == rolloutplan.PhaseAborted {
					typ = "Normal"
				}
			}
		}
		ev.Record(ctx, RolloutsKind, name, typ, ph, msg)
	}
}

// do performs one move: a read, a change and a compare-and-swap write,
// again on a conflict. A spec change bumps the object's generation.
func (e *Executor) do(ctx context.Context, a rolloutplan.Action) error {
	switch a := a.(type) {
	case rolloutplan.SetControlPlane:
		return e.update(ctx, ControlPlanesKind, a.ControlPlane, &typesv1.ControlPlane{}, func(m proto.Message) bool {
			cp := m.(*typesv1.ControlPlane)
			if cp.Spec == nil {
				cp.Spec = &typesv1.ControlPlaneSpec{}
			}
			if !setFields(a.Set, &cp.Spec.Version, &cp.Spec.Image, &cp.Spec.ImageSelector) {
				return false
			}
			cp.Metadata.Generation++
			return true
		})
	case rolloutplan.SetDeployment:
		return e.update(ctx, MachineDeploymentsKind, a.Deployment, &typesv1.MachineDeployment{}, func(m proto.Message) bool {
			md := m.(*typesv1.MachineDeployment)
			if md.Spec == nil {
				md.Spec = &typesv1.MachineDeploymentSpec{}
			}
			if !setFields(a.Set, &md.Spec.Version, &md.Spec.Image, &md.Spec.ImageSelector) {
				return false
			}
			md.Metadata.Generation++
			return true
		})
	case rolloutplan.SetClusterVersion:
		return e.update(ctx, ClustersKind, a.Cluster, &typesv1.Cluster{}, func(m proto.Message) bool {
			c := m.(*typesv1.Cluster)
			if c.GetSpec().GetKubernetesVersion() == a.Version {
				return false
			}
			if c.Spec == nil {
				c.Spec = &typesv1.ClusterSpec{}
			}
			c.Spec.KubernetesVersion = a.Version
			c.Metadata.Generation++
			return true
		})
	case rolloutplan.SetTopologyVersion:
		return e.update(ctx, ClustersKind, a.Cluster, &typesv1.Cluster{}, func(m proto.Message) bool {
			c := m.(*typesv1.Cluster)
			if c.GetSpec().GetTopology() == nil || c.Spec.Topology.Version == a.Version {
				return false
			}
			c.Spec.Topology.Version = a.Version
			c.Metadata.Generation++
			return true
		})
	case rolloutplan.SetClassRevision:
		return e.update(ctx, ClustersKind, a.Cluster, &typesv1.Cluster{}, func(m proto.Message) bool {
			c := m.(*typesv1.Cluster)
			if c.GetStatus().GetTopology().GetClassRevision() == a.Revision {
				return false
			}
			if c.Status == nil {
				c.Status = &typesv1.ClusterStatus{}
			}
			if c.Status.Topology == nil {
				c.Status.Topology = &typesv1.ClusterTopologyStatus{}
			}
			c.Status.Topology.ClassRevision = a.Revision
			return true
		})
	}
	return errdefs.InvalidArgument("unknown rollout action %T", a)
}

// setFields applies f to an object's version and image reference; false
// when nothing changed.
func setFields(f rolloutplan.Fields, version, image *string, sel *map[string]string) bool {
	changed := false
	if f.Version != "" && *version != f.Version {
		*version, changed = f.Version, true
	}
	if f.SetImage && (*image != f.Image || !maps.Equal(*sel, f.ImageSelector)) {
		*image, *sel, changed = f.Image, maps.Clone(f.ImageSelector), true
	}
	return changed
}

// update reads kind/name into m, applies change (false: write nothing)
// and writes it back under compare-and-swap, again on a conflict.
func (e *Executor) update(ctx context.Context, kind, name string, m proto.Message, change func(proto.Message) bool) error {
	for {
		proto.Reset(m)
		rev, err := e.deps.Store.Get(ctx, kind, name, m)
		if err != nil {
			return err
		}
		if !change(m) {
			return nil
		}
		_, err = e.deps.Store.Update(ctx, kind, name, m, rev)
		if errdefs.IsConflict(err) && ctx.Err() == nil {
			continue
		}
		return err
	}
}
