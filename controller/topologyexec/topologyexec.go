// Package topologyexec runs what controller/topologyplan decides: for each
// Cluster with spec.topology it reads the cluster's ClusterClass and the
// objects derived from it (labelled kiln.dev/topology-owned), calls the
// planner, creates, updates (compare-and-swap) and deletes the derived
// objects, records the planner's events (a reverted user edit is a
// Warning), and sets Cluster.status.topology (the pin) and the
// TopologyReconciled condition. The objects of a deleted topology cluster
// are deleted with it; a paused cluster (spec.paused) is left as it is.
// For each ClusterClass it records the revisions PlanClass decides and
// creates the Rollout of a new revision.
//
// It is woken by watches on clusters, classes and derived objects, and
// looks at everything every Interval. Only the leader runs an Executor.
package topologyexec

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/client-go/util/workqueue"

	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/topologyplan"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Store kinds.
const (
	ClustersKind           = "clusters"
	ClusterClassesKind     = "clusterclasses"
	ControlPlanesKind      = "controlplanes"
	MachineDeploymentsKind = "machinedeployments"
	HealthChecksKind       = "healthchecks"
	RolloutsKind           = "rollouts"
)

// Store is what the executor needs of the store (*store.Store).
type Store interface {
	Get(ctx context.Context, kind, name string, into proto.Message) (int64, error)
	Create(ctx context.Context, kind, name string, m proto.Message) (int64, error)
	Update(ctx context.Context, kind, name string, m proto.Message, expectRev int64) (int64, error)
	Delete(ctx context.Context, kind, name string, expectRev int64) error
	List(ctx context.Context, kind string, newMsg func() proto.Message, opts store.ListOptions) ([]store.Item, string, error)
	Watch(ctx context.Context, kind string, fromRev int64) <-chan store.WatchEvent
}

var _ Store = (*store.Store)(nil)

// Recorder records events (*events.Recorder).
type Recorder interface {
	Record(ctx context.Context, kind, name, typ, reason, message string)
}

// Config configures an Executor.
type Config struct {
	// Interval is how often every cluster and class is looked at besides
	// the watches (default 30s).
	Interval time.Duration
	// Workers is how many keys are reconciled at once (default 4).
	Workers int
	// Clock is the time source (time.Now).
	Clock func() time.Time
}

// Executor reconciles topology clusters and cluster classes.
type Executor struct {
	st  Store
	rec Recorder
	cfg Config
	log *slog.Logger

	mu sync.Mutex
	// seen is what PlanClass reads of each cluster the watch saw, as
	// classView: its class is queued when that changes, not on every
	// status write of the cluster (each would list every cluster).
	seen map[string]string
}

// New returns an Executor.
func New(st Store, rec Recorder, cfg Config, log *slog.Logger) *Executor {
	if cfg.Interval <= 0 {
		cfg.Interval = 30 * time.Second
	}
	if cfg.Workers <= 0 {
		cfg.Workers = 4
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	return &Executor{st: st, rec: rec, cfg: cfg, log: log.With("component", "topology"), seen: map[string]string{}}
}

// Queue keys: "cluster/NAME" and "class/NAME".
const (
	clusterKey = "cluster/"
	classKey   = "class/"
)

// Run reconciles until ctx ends. It blocks.
func (e *Executor) Run(ctx context.Context) error {
	q := workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[string](),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: "topology"})
	var wg sync.WaitGroup
	for range e.cfg.Workers {
		wg.Go(func() {
			for e.work(ctx, q) {
			}
		})
	}
	for _, kind := range []string{ClustersKind, ClusterClassesKind, ControlPlanesKind, MachineDeploymentsKind, HealthChecksKind} {
		wg.Go(func() { e.watch(ctx, q, kind) })
	}
	t := time.NewTicker(e.cfg.Interval)
	defer t.Stop()
	for {
		e.enqueueAll(ctx, q)
		select {
		case <-ctx.Done():
			q.ShutDown()
			wg.Wait()
			return nil
		case <-t.C:
		}
	}
}

// watch queues what a change of kind concerns, until ctx ends; a watch
// that fails is started again (the periodic pass covers the gap).
func (e *Executor) watch(ctx context.Context, q workqueue.TypedRateLimitingInterface[string], kind string) {
	for ctx.Err() == nil {
		for ev := range e.st.Watch(ctx, kind, 0) {
			if ev.Err != nil {
				break
			}
			e.route(ctx, q, kind, ev)
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

func (e *Executor) route(ctx context.Context, q workqueue.TypedRateLimitingInterface[string], kind string, ev store.WatchEvent) {
	switch kind {
	case ClustersKind:
		q.Add(clusterKey + ev.Name)
		var view string
		c := &typesv1.Cluster{}
		if ev.Type == store.EventPut && proto.Unmarshal(ev.Value, c) == nil {
			view = classView(c)
		}
		e.mu.Lock()
		old := e.seen[ev.Name]
		if view == "" {
			delete(e.seen, ev.Name)
		} else {
			e.seen[ev.Name] = view
		}
		e.mu.Unlock()
		if view == old {
			return
		}
		// The class the cluster left (or that lost it), and the one it
		// is in now.
		for _, v := range []string{old, view} {
			if cl, _, _ := strings.Cut(v, "\x00"); cl != "" {
				q.Add(classKey + cl)
			}
		}
	case ClusterClassesKind:
		q.Add(classKey + ev.Name)
	default:
		if ev.Type != store.EventPut {
			// A derived object was deleted: which cluster owned it is
			// not in the event; look at every cluster.
			e.enqueueAll(ctx, q)
			return
		}
		var m proto.Message
		switch kind {
		case ControlPlanesKind:
			m = &typesv1.ControlPlane{}
		case MachineDeploymentsKind:
			m = &typesv1.MachineDeployment{}
		default:
			m = &typesv1.HealthCheck{}
		}
		if proto.Unmarshal(ev.Value, m) == nil {
			if owner := metaOf(m).GetLabels()[topologyplan.LabelOwned]; owner != "" {
				q.Add(clusterKey + owner)
			}
		}
	}
}

// classView is what PlanClass reads of cluster c: its class, its pin and
// whether it is reconciled ("" for a cluster without a topology).
func classView(c *typesv1.Cluster) string {
	cl := c.GetSpec().GetTopology().GetClass()
	if cl == "" {
		return ""
	}
	return fmt.Sprintf("%s\x00%d\x00%t", cl, c.GetStatus().GetTopology().GetClassRevision(), topologyplan.Reconciled(c))
}

func (e *Executor) enqueueAll(ctx context.Context, q workqueue.TypedRateLimitingInterface[string]) {
	clusters, err := store.ListAll(ctx, e.st, ClustersKind, func() proto.Message { return &typesv1.Cluster{} })
	if err != nil {
		if ctx.Err() == nil {
			e.log.Warn("list clusters", "err", err)
		}
		return
	}
	exists := map[string]bool{}
	for _, it := range clusters {
		exists[it.Name] = true
		if it.Msg.(*typesv1.Cluster).GetSpec().GetTopology() != nil {
			q.Add(clusterKey + it.Name)
		}
	}
	// The control planes of deleted topology clusters, whose delete event
	// was missed.
	if cps, err := store.ListAll(ctx, e.st, ControlPlanesKind, func() proto.Message { return &typesv1.ControlPlane{} }); err == nil {
		for _, it := range cps {
			if owner := metaOf(it.Msg).GetLabels()[topologyplan.LabelOwned]; owner != "" && !exists[owner] {
				q.Add(clusterKey + owner)
			}
		}
	}
	classes, err := store.ListAll(ctx, e.st, ClusterClassesKind, func() proto.Message { return &typesv1.ClusterClass{} })
	if err != nil {
		if ctx.Err() == nil {
			e.log.Warn("list cluster classes", "err", err)
		}
		return
	}
	for _, it := range classes {
		q.Add(classKey + it.Name)
	}
}

func (e *Executor) work(ctx context.Context, q workqueue.TypedRateLimitingInterface[string]) bool {
	key, shutdown := q.Get()
	if shutdown {
		return false
	}
	defer q.Done(key)
	var err error
	if name, ok := strings.CutPrefix(key, classKey); ok {
		err = e.ReconcileClass(ctx, name, func(cluster string) { q.Add(clusterKey + cluster) })
	} else {
		err = e.ReconcileCluster(ctx, strings.TrimPrefix(key, clusterKey))
	}
	if err != nil && ctx.Err() == nil {
		if !errdefs.IsConflict(err) {
			e.log.Warn("reconcile topology", "key", key, "err", err)
		}
		q.AddRateLimited(key)
		return true
	}
	q.Forget(key)
	return true
}

// ReconcileCluster plans the topology cluster name once and performs the
// plan: the derived objects' creates, updates and deletes, their events,
// then the cluster's status.topology and TopologyReconciled condition,
// written by compare-and-swap on the revision the plan read (a pin moved
// meanwhile is never overwritten). A cluster without a topology, or
// gone, is left alone. It returns Conflict when an object changed under
// it (plan again), or the store's error.
func (e *Executor) ReconcileCluster(ctx context.Context, name string) error {
	c := &typesv1.Cluster{}
	rev, err := e.st.Get(ctx, ClustersKind, name, c)
	if errdefs.IsNotFound(err) {
		return e.deleteDerived(ctx, name)
	}
	if err != nil {
		return err
	}
	t := c.GetSpec().GetTopology()
	if t == nil || c.GetSpec().GetPaused() {
		return nil
	}
	in := topologyplan.Input{Cluster: c}
	class := &typesv1.ClusterClass{}
	switch _, err := e.st.Get(ctx, ClusterClassesKind, t.GetClass(), class); {
	case err == nil:
		in.Class = class
	case !errdefs.IsNotFound(err):
		return err
	}
	if err := e.observe(ctx, name, &in); err != nil {
		return err
	}
	res := topologyplan.Plan(in)
	for _, a := range res.Actions {
		if err := e.do(ctx, name, a); err != nil {
			return fmt.Errorf("cluster %q: %s: %w", name, a, err)
		}
	}
	for _, ev := range res.Events {
		typ := events.Normal
		if ev.Warning {
			typ = events.Warning
			e.log.Info("derived object edit reverted", "cluster", name, "kind", ev.Kind, "name", ev.Name)
		}
		e.rec.Record(ctx, plural(ev.Kind), ev.Name, typ, ev.Reason, ev.Message)
	}
	next := proto.Clone(c).(*typesv1.Cluster)
	if next.Status == nil {
		next.Status = &typesv1.ClusterStatus{}
	}
	next.Status.Topology = res.Topology
	var changed bool
	next.Status.Conditions, changed = conditions.Set(next.Status.Conditions, res.Condition, e.cfg.Clock())
	if !changed && proto.Equal(c.GetStatus().GetTopology(), res.Topology) {
		return nil
	}
	if _, err := e.st.Update(ctx, ClustersKind, name, next, rev); err != nil {
		return fmt.Errorf("cluster %q: status: %w", name, err)
	}
	if old := conditions.Get(c.GetStatus().GetConditions(), topologyplan.ConditionTopologyReconciled); old.GetStatus() != res.Condition.GetStatus() || old.GetReason() != res.Condition.GetReason() {
		typ := events.Normal
		if res.Condition.GetStatus() != "True" {
			typ = events.Warning
		}
		e.rec.Record(ctx, ClustersKind, name, typ, "Topology"+res.Condition.GetReason(), res.Condition.GetMessage())
	}
	return nil
}

// deleteDerived deletes the objects derived from the topology of cluster,
// which was deleted: they are the controller's, not the user's, and would
// act again on a new cluster of that name.
func (e *Executor) deleteDerived(ctx context.Context, cluster string) error {
	var in topologyplan.Input
	if err := e.observe(ctx, cluster, &in); err != nil {
		return err
	}
	var gone []topologyplan.Action
	for _, o := range in.HealthChecks {
		gone = append(gone, topologyplan.Delete{Kind: topologyplan.KindHealthCheck, Name: o.GetMetadata().GetName()})
	}
	for _, o := range in.MachineDeployments {
		gone = append(gone, topologyplan.Delete{Kind: topologyplan.KindMachineDeployment, Name: o.GetMetadata().GetName()})
	}
	for _, o := range in.ControlPlanes {
		gone = append(gone, topologyplan.Delete{Kind: topologyplan.KindControlPlane, Name: o.GetMetadata().GetName()})
	}
	for _, a := range gone {
		if err := e.do(ctx, cluster, a); err != nil {
			return fmt.Errorf("cluster %q deleted: %s: %w", cluster, a, err)
		}
	}
	return nil
}

// observe fills in the objects labelled as derived from cluster. Derived
// objects are named after their cluster (topologyplan.ControlPlaneName,
// PoolName: "<cluster>-..."), so only the names with that prefix are
// read, not every object of the kind: a reconcile costs what the cluster
// has, not what the fleet has. The label decides (cluster "a-b"'s objects
// also start with "a-").
func (e *Executor) observe(ctx context.Context, cluster string, in *topologyplan.Input) error {
	owned := func(m proto.Message) bool { return metaOf(m).GetLabels()[topologyplan.LabelOwned] == cluster }
	prefix := cluster + "-"
	cps, err := store.ListPrefix(ctx, e.st, ControlPlanesKind, prefix, func() proto.Message { return &typesv1.ControlPlane{} })
	if err != nil {
		return err
	}
	for _, it := range cps {
		if owned(it.Msg) {
			in.ControlPlanes = append(in.ControlPlanes, it.Msg.(*typesv1.ControlPlane))
		}
	}
	mds, err := store.ListPrefix(ctx, e.st, MachineDeploymentsKind, prefix, func() proto.Message { return &typesv1.MachineDeployment{} })
	if err != nil {
		return err
	}
	for _, it := range mds {
		if owned(it.Msg) {
			in.MachineDeployments = append(in.MachineDeployments, it.Msg.(*typesv1.MachineDeployment))
		}
	}
	hcs, err := store.ListPrefix(ctx, e.st, HealthChecksKind, prefix, func() proto.Message { return &typesv1.HealthCheck{} })
	if err != nil {
		return err
	}
	for _, it := range hcs {
		if owned(it.Msg) {
			in.HealthChecks = append(in.HealthChecks, it.Msg.(*typesv1.HealthCheck))
		}
	}
	return nil
}

// do performs one action of the plan.
func (e *Executor) do(ctx context.Context, cluster string, a topologyplan.Action) error {
	switch x := a.(type) {
	case topologyplan.Create:
		obj := proto.Clone(x.Object)
		md := metaOf(obj)
		md.Generation = 1
		md.Uid = newUID()
		md.CreationTimestamp = timestamppb.New(e.cfg.Clock())
		_, err := e.st.Create(ctx, plural(x.Kind), md.GetName(), obj)
		if errdefs.IsAlreadyExists(err) {
			return errdefs.FailedPrecondition("%s %q exists and is not derived from cluster %q's topology: delete or rename it", x.Kind, md.GetName(), cluster)
		}
		if err == nil {
			e.rec.Record(ctx, plural(x.Kind), md.GetName(), events.Normal, "TopologyCreated",
				fmt.Sprintf("%s %s created from the topology of cluster %s", x.Kind, md.GetName(), cluster))
		}
		return err
	case topologyplan.Update:
		cur := newOf(x.Kind)
		rev, err := e.st.Get(ctx, plural(x.Kind), x.Name, cur)
		if err != nil {
			return err
		}
		next := proto.Clone(cur)
		setSpec(next, x.Object)
		md, want := metaOf(next), metaOf(x.Object)
		if md.Labels == nil {
			md.Labels = map[string]string{}
		}
		md.Labels[topologyplan.LabelOwned] = cluster
		if md.Annotations == nil {
			md.Annotations = map[string]string{}
		}
		for k, v := range want.GetAnnotations() {
			md.Annotations[k] = v
		}
		if len(x.Fields) > 0 {
			md.Generation++
		}
		_, err = e.st.Update(ctx, plural(x.Kind), x.Name, next, rev)
		return err
	case topologyplan.Delete:
		cur := newOf(x.Kind)
		rev, err := e.st.Get(ctx, plural(x.Kind), x.Name, cur)
		if errdefs.IsNotFound(err) {
			return nil
		}
		if err != nil {
			return err
		}
		if err := e.st.Delete(ctx, plural(x.Kind), x.Name, rev); err != nil && !errdefs.IsNotFound(err) {
			return err
		}
		e.rec.Record(ctx, plural(x.Kind), x.Name, events.Normal, "TopologyDeleted",
			fmt.Sprintf("%s %s deleted: the topology of cluster %s no longer names it", x.Kind, x.Name, cluster))
		return nil
	}
	return errdefs.InvalidArgument("unknown action %T", a)
}

// ReconcileClass records the revisions PlanClass decides for class name,
// creating the Rollout of a new revision first (so a crash between the
// two creates it again, never loses it), then calls wake for each
// cluster of the class.
func (e *Executor) ReconcileClass(ctx context.Context, name string, wake func(cluster string)) error {
	class := &typesv1.ClusterClass{}
	rev, err := e.st.Get(ctx, ClusterClassesKind, name, class)
	if errdefs.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	items, err := store.ListAll(ctx, e.st, ClustersKind, func() proto.Message { return &typesv1.Cluster{} })
	if err != nil {
		return err
	}
	var clusters []*typesv1.Cluster
	for _, it := range items {
		if c := it.Msg.(*typesv1.Cluster); c.GetSpec().GetTopology().GetClass() == name {
			clusters = append(clusters, c)
		}
	}
	res := topologyplan.PlanClass(class, clusters)
	if r := res.Rollout; r != nil {
		r.Metadata.Generation = 1
		r.Metadata.Uid = newUID()
		r.Metadata.CreationTimestamp = timestamppb.New(e.cfg.Clock())
		if _, err := e.st.Create(ctx, RolloutsKind, r.GetMetadata().GetName(), r); err != nil && !errdefs.IsAlreadyExists(err) {
			return fmt.Errorf("class %q: create rollout %q: %w", name, r.GetMetadata().GetName(), err)
		}
	}
	if res.Status != nil {
		next := proto.Clone(class).(*typesv1.ClusterClass)
		next.Status = res.Status
		if _, err := e.st.Update(ctx, ClusterClassesKind, name, next, rev); err != nil {
			return fmt.Errorf("class %q: status: %w", name, err)
		}
		if res.Event != "" {
			e.log.Info("cluster class revisions", "class", name, "revision", res.Status.GetRevision())
			e.rec.Record(ctx, ClusterClassesKind, name, events.Normal, "Revision", res.Event)
		}
	}
	if wake != nil {
		for _, c := range clusters {
			wake(c.GetMetadata().GetName())
		}
	}
	return nil
}

func plural(kind string) string {
	switch kind {
	case topologyplan.KindControlPlane:
		return ControlPlanesKind
	case topologyplan.KindMachineDeployment:
		return MachineDeploymentsKind
	}
	return HealthChecksKind
}

func newOf(kind string) proto.Message {
	switch kind {
	case topologyplan.KindControlPlane:
		return &typesv1.ControlPlane{}
	case topologyplan.KindMachineDeployment:
		return &typesv1.MachineDeployment{}
	}
	return &typesv1.HealthCheck{}
}

func field(m protoreflect.Message, name protoreflect.Name) protoreflect.FieldDescriptor {
	return m.Descriptor().Fields().ByName(name)
}

func metaOf(m proto.Message) *typesv1.ObjectMeta {
	r := m.ProtoReflect()
	fd := field(r, "metadata")
	if !r.Has(fd) {
		r.Set(fd, protoreflect.ValueOfMessage((&typesv1.ObjectMeta{}).ProtoReflect()))
	}
	return r.Get(fd).Message().Interface().(*typesv1.ObjectMeta)
}

func setSpec(dst, src proto.Message) {
	d, s := dst.ProtoReflect(), src.ProtoReflect()
	fd := field(d, "spec")
	d.Set(fd, protoreflect.ValueOfMessage(proto.Clone(s.Get(field(s, "spec")).Message().Interface()).ProtoReflect()))
}

func newUID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
