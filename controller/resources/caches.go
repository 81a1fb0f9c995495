package resources

import (
	"context"
	"sync"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/cacheindex"
	"github.com/kilnhq/kiln/controller/store"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// Index names of the caches (Caches.Kind(...).ByIndex); every index is
// defined in controller/cacheindex.
const (
	// IndexCluster finds objects by spec.cluster (control planes,
	// machine deployments, machines, health checks).
	IndexCluster = cacheindex.Cluster
	// IndexOwner finds machines by spec.owner ("ControlPlane/NAME",
	// "MachineDeployment/NAME").
	IndexOwner = cacheindex.Owner
	// IndexHost finds machines by spec.host.
	IndexHost = cacheindex.Host
	// IndexMachine finds hosts by status.machine.
	IndexMachine = cacheindex.Machine
	// IndexState finds objects by their status.state's name.
	IndexState = cacheindex.State
	// IndexConditionNotTrue finds objects by the types of their
	// conditions that do not hold.
	IndexConditionNotTrue = cacheindex.ConditionNotTrue
)

// encodedKinds are the kinds a fleet has one of per host: their caches
// keep each object encoded and decode it per read (store.Cache.KeepEncoded;
// 100,000 decoded Hosts held 330 MiB, encoded 70 MiB). The other kinds
// are few and read whole by the executors: kept decoded.
var encodedKinds = map[string]bool{"hosts": true, "machines": true}

// Caches is a replica's watch caches of the resource kinds: one
// store.Cache, so one etcd watch, per kind, each with the indexes its
// kind's fields allow (cacheindex.Add). Every replica runs them, leader
// or not: every replica serves the API, whose List reads them
// (Service.UseCaches), the agents' heartbeats read the Hosts from them,
// and the leader's executors and sweep read them.
type Caches struct {
	byKind map[string]*store.Cache
}

// NewCaches returns the caches of every kind of Kinds; they fill once Run
// runs.
func NewCaches(st *store.Store) *Caches {
	c := &Caches{byKind: map[string]*store.Cache{}}
	for _, k := range Kinds {
		kc := store.NewCache(st, k.Plural, k.New)
		if encodedKinds[k.Plural] {
			kc.KeepEncoded()
		}
		cacheindex.Add(kc, k.New())
		c.byKind[k.Plural] = kc
	}
	return c
}

// Kind returns the cache of kind (a plural, as Kind.Plural), or nil.
func (c *Caches) Kind(plural string) *store.Cache {
	if c == nil {
		return nil
	}
	return c.byKind[plural]
}

// Run keeps every cache filled until ctx ends. It blocks.
func (c *Caches) Run(ctx context.Context) {
	var wg sync.WaitGroup
	for _, kc := range c.byKind {
		wg.Go(func() { kc.Run(ctx) })
	}
	wg.Wait()
}

// UseCaches makes List serve from c (each page from the kind's cache,
// etcd where the cache cannot serve it: store.Cache.ListPage). Call
// before serving.
func (s *Service) UseCaches(c *Caches) { s.caches = c }

// listCached is List from the kind's cache; served is false when the
// cache cannot serve the page and List reads etcd instead.
func (s *Service) listCached(ctx context.Context, k Kind, selector map[string]string, limit int64, cont string) (out []*controllerv1.Resource, next string, served bool, err error) {
	kc := s.caches.Kind(k.Plural)
	if kc == nil {
		return nil, "", false, nil
	}
	var match func(store.Item) bool
	if len(selector) > 0 {
		match = func(it store.Item) bool { return matches(Meta(it.Msg).GetLabels(), selector) }
	}
	items, next, served, err := kc.ListPage(ctx, store.ListOptions{Limit: limit, Continue: cont, MaxBytes: maxListBytes}, match)
	if err != nil || !served {
		return nil, "", served, err
	}
	out = make([]*controllerv1.Resource, 0, len(items))
	for _, it := range items {
		obj := it.Msg
		if !kc.Encoded() {
			obj = proto.Clone(obj) // the cache's message is shared
		}
		finish(obj, k, it.Rev)
		out = append(out, k.Wrap(obj))
	}
	return out, next, true, nil
}

// watch streams the changes of kind k from now on: from its cache when
// it is synced (store.Cache.Watch), else from an etcd watch of its own.
func (s *Service) watch(ctx context.Context, k Kind) <-chan store.WatchEvent {
	if kc := s.caches.Kind(k.Plural); kc != nil && kc.Synced() {
		return kc.Watch(ctx)
	}
	return s.store.Watch(ctx, k.Plural, 0)
}
