package dashboard

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"sort"
	"strconv"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/errgrpc"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// kinds are the kinds the dashboard follows, one Watch each (the
// controller allows a caller 32 open watches).
var kinds = []string{"Host", "Image", "Cluster", "ControlPlane", "MachineDeployment", "Machine", "HealthCheck"}

// stateEnded is the journal's state of an operation seen Running and
// then replaced by the next one.
const stateEnded = "Ended"

// journalLen is how many operations the dashboard remembers per host.
const journalLen = 30

// retry is the pause before a broken watch is opened again.
var retry = backoff.Policy{Base: 500 * time.Millisecond, Max: 30 * time.Second, Factor: 2, Jitter: 0.2}

// cache is the dashboard's copy of the fleet: per kind, the objects by
// name, kept current by a Watch and a List after it (and again every
// resync). Stored objects are never modified: a change replaces them.
type cache struct {
	api     API
	timeout time.Duration
	resync  time.Duration
	log     *slog.Logger

	mu      sync.Mutex
	objs    map[string]map[string]*controllerv1.Resource
	errs    map[string]error
	listed  map[string]bool
	journal map[string][]*typesv1.OperationStatus // per host, oldest first
	gen     uint64
	changed chan struct{} // closed at the next change

	synced   chan struct{}
	syncOnce sync.Once
}

func newCache(api API, timeout, resync time.Duration, log *slog.Logger) *cache {
	c := &cache{
		api: api, timeout: timeout, resync: resync, log: log,
		objs: map[string]map[string]*controllerv1.Resource{}, errs: map[string]error{},
		listed: map[string]bool{}, journal: map[string][]*typesv1.OperationStatus{},
		changed: make(chan struct{}), synced: make(chan struct{}),
	}
	for _, k := range kinds {
		c.objs[k] = map[string]*controllerv1.Resource{}
	}
	return c
}

// run follows every kind until ctx ends.
func (c *cache) run(ctx context.Context) {
	var wg sync.WaitGroup
	for _, k := range kinds {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.followKind(ctx, k)
		}()
	}
	wg.Wait()
}

// followKind keeps kind current, opening the watch again with backoff
// after it breaks; the error is shown on every page meanwhile.
func (c *cache) followKind(ctx context.Context, kind string) {
	rnd := rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
	for attempt := 0; ; attempt++ {
		healthy, err := c.follow(ctx, kind)
		if ctx.Err() != nil {
			return
		}
		if healthy {
			attempt = 0
		}
		c.setErr(kind, err)
		d := retry.Delay(attempt, rnd)
		c.log.Warn("watch broke, retrying", "kind", kind, "err", err, "retry_in", d)
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// follow opens a watch of kind, lists it, then applies the watch's events
// (and a fresh list every resync) until the watch or a list fails.
// healthy reports whether it listed at least once.
func (c *cache) follow(ctx context.Context, kind string) (healthy bool, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.api.Watch(ctx, &controllerv1.WatchRequest{Kind: kind})
	if err != nil {
		return false, errgrpc.FromGRPC(err)
	}
	// The controller sends headers once it accepted the watch: a list
	// after them misses no change but one made while the controller
	// starts its own watch, which the next resync corrects.
	if _, err := stream.Header(); err != nil {
		return false, errgrpc.FromGRPC(err)
	}
	if err := c.list(ctx, kind); err != nil {
		return false, err
	}
	events := make(chan *controllerv1.WatchEvent)
	broke := make(chan error, 1)
	go func() {
		for {
			ev, err := stream.Recv()
			if err != nil {
				if errors.Is(err, io.EOF) {
					err = errors.New("the controller ended the watch")
				}
				broke <- errgrpc.FromGRPC(err)
				return
			}
			select {
			case events <- ev:
			case <-ctx.Done():
				return
			}
		}
	}()
	t := time.NewTicker(c.resync)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return true, ctx.Err()
		case err := <-broke:
			return true, err
		case ev := <-events:
			c.apply(kind, ev)
		case <-t.C:
			if err := c.list(ctx, kind); err != nil {
				return true, err
			}
		}
	}
}

// list reads every object of kind and makes the cache hold exactly them.
func (c *cache) list(ctx context.Context, kind string) error {
	var items []*controllerv1.Resource
	cont := ""
	for {
		cctx, cancel := context.WithTimeout(ctx, c.timeout)
		resp, err := c.api.List(cctx, &controllerv1.ListRequest{Kind: kind, Limit: 500, Continue: cont})
		cancel()
		if err != nil {
			return errgrpc.FromGRPC(err)
		}
		items = append(items, resp.GetItems()...)
		if cont = resp.GetContinue(); cont == "" {
			break
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	old := c.objs[kind]
	next := make(map[string]*controllerv1.Resource, len(items))
	for _, r := range items {
		name := metaOf(r).GetName()
		if o, ok := old[name]; ok && rv(o) > rv(r) {
			r = o // a watch event newer than the list
		}
		next[name] = r
		c.noteLocked(r)
	}
	c.objs[kind] = next
	c.listed[kind] = true
	delete(c.errs, kind)
	c.bumpLocked()
	if len(c.listed) == len(kinds) {
		c.syncOnce.Do(func() { close(c.synced) })
	}
	return nil
}

// apply folds one watch event in; an event older than what the cache
// holds (seen in a list first) changes nothing.
func (c *cache) apply(kind string, ev *controllerv1.WatchEvent) {
	r := ev.GetResource()
	name := metaOf(r).GetName()
	c.mu.Lock()
	defer c.mu.Unlock()
	objs := c.objs[kind]
	if ev.GetType() == "DELETED" {
		if _, ok := objs[name]; !ok {
			return
		}
		delete(objs, name)
		if kind == "Host" {
			delete(c.journal, name)
		}
		c.bumpLocked()
		return
	}
	if o, ok := objs[name]; ok && rv(o) >= rv(r) {
		return
	}
	objs[name] = r
	c.noteLocked(r)
	c.bumpLocked()
}

// noteLocked records a host's last operation in its journal: a new
// operation id is a new entry, the same id updates it.
func (c *cache) noteLocked(r *controllerv1.Resource) {
	h := r.GetHost()
	op := h.GetStatus().GetLastOperation()
	if h == nil || op.GetId() == "" {
		return
	}
	name := h.GetMetadata().GetName()
	j := c.journal[name]
	if n := len(j); n > 0 && j[n-1].GetId() == op.GetId() {
		j[n-1] = op
		return
	}
	if n := len(j); n > 0 && j[n-1].GetState() == "Running" {
		// The controller moved on in the same write that ended the
		// operation, so its outcome was never seen here: it ended when
		// the next one started.
		ended := proto.Clone(j[n-1]).(*typesv1.OperationStatus)
		ended.State, ended.Finished = stateEnded, op.GetStarted()
		j[n-1] = ended
	}
	j = append(j, op)
	if len(j) > journalLen {
		j = j[len(j)-journalLen:]
	}
	c.journal[name] = j
}

func (c *cache) setErr(kind string, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.errs[kind] = err
	c.bumpLocked()
}

func (c *cache) bumpLocked() {
	c.gen++
	close(c.changed)
	c.changed = make(chan struct{})
}

// changes returns the current generation and a channel closed when it
// moves on.
func (c *cache) changes() (uint64, <-chan struct{}) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gen, c.changed
}

// fleet is a consistent copy of the cache for one render: every kind
// sorted by name, the watch errors, the host journals.
type fleet struct {
	Hosts              []*typesv1.Host
	Images             []*typesv1.Image
	Clusters           []*typesv1.Cluster
	ControlPlanes      []*typesv1.ControlPlane
	MachineDeployments []*typesv1.MachineDeployment
	Machines           []*typesv1.Machine
	HealthChecks       []*typesv1.HealthCheck
	// Resources are all objects, for describe.Collect.
	Resources []*controllerv1.Resource
	// Errors are the kinds whose watch is broken, and why.
	Errors []string
	// Synced is false until every kind was listed once.
	Synced  bool
	journal map[string][]*typesv1.OperationStatus
}

func (c *cache) snapshot() *fleet {
	c.mu.Lock()
	defer c.mu.Unlock()
	f := &fleet{Synced: len(c.listed) == len(kinds), journal: map[string][]*typesv1.OperationStatus{}}
	for _, k := range kinds {
		names := make([]string, 0, len(c.objs[k]))
		for n := range c.objs[k] {
			names = append(names, n)
		}
		sort.Strings(names)
		for _, n := range names {
			r := c.objs[k][n]
			f.Resources = append(f.Resources, r)
			switch x := r.GetKind().(type) {
			case *controllerv1.Resource_Host:
				f.Hosts = append(f.Hosts, x.Host)
			case *controllerv1.Resource_Image:
				f.Images = append(f.Images, x.Image)
			case *controllerv1.Resource_Cluster:
				f.Clusters = append(f.Clusters, x.Cluster)
			case *controllerv1.Resource_ControlPlane:
				f.ControlPlanes = append(f.ControlPlanes, x.ControlPlane)
			case *controllerv1.Resource_MachineDeployment:
				f.MachineDeployments = append(f.MachineDeployments, x.MachineDeployment)
			case *controllerv1.Resource_Machine:
				f.Machines = append(f.Machines, x.Machine)
			case *controllerv1.Resource_HealthCheck:
				f.HealthChecks = append(f.HealthChecks, x.HealthCheck)
			}
		}
		if err := c.errs[k]; err != nil {
			f.Errors = append(f.Errors, k+": "+err.Error())
		}
	}
	for h, j := range c.journal {
		f.journal[h] = j
	}
	return f
}

// host returns one host and its journal from the cache, without copying
// the fleet.
func (c *cache) host(name string) (*typesv1.Host, []*typesv1.OperationStatus, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.objs["Host"][name]
	return r.GetHost(), c.journal[name], ok
}

func metaOf(r *controllerv1.Resource) *typesv1.ObjectMeta {
	switch x := r.GetKind().(type) {
	case *controllerv1.Resource_Host:
		return x.Host.GetMetadata()
	case *controllerv1.Resource_Image:
		return x.Image.GetMetadata()
	case *controllerv1.Resource_Cluster:
		return x.Cluster.GetMetadata()
	case *controllerv1.Resource_ControlPlane:
		return x.ControlPlane.GetMetadata()
	case *controllerv1.Resource_MachineDeployment:
		return x.MachineDeployment.GetMetadata()
	case *controllerv1.Resource_Machine:
		return x.Machine.GetMetadata()
	case *controllerv1.Resource_HealthCheck:
		return x.HealthCheck.GetMetadata()
	}
	return nil
}

// rv is the object's resource version (the etcd revision of its last
// change); 0 when unknown.
func rv(r *controllerv1.Resource) int64 {
	n, _ := strconv.ParseInt(metaOf(r).GetResourceVersion(), 10, 64)
	return n
}
