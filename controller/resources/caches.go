package resources

import (
	"context"
	"sync"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/kilnhq/kiln/controller/store"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// Index names of the caches (Caches.Kind(...).ByIndex).
const (
	// IndexCluster finds objects by spec.cluster (control planes,
	// machine deployments, machines, health checks).
	IndexCluster = "cluster"
	// IndexOwner finds machines by spec.owner ("ControlPlane/NAME",
	// "MachineDeployment/NAME").
	IndexOwner = "owner"
	// IndexHost finds machines by spec.host.
	IndexHost = "host"
	// IndexMachine finds hosts by status.machine.
	IndexMachine = "machine"
)

// Caches is a replica's watch caches of the resource kinds: one
// store.Cache, so one etcd watch, per kind, each with the indexes its
// kind's spec allows (IndexCluster, IndexOwner, IndexHost,
// IndexMachine). Every replica runs them, leader or not: every replica
// serves the API, whose List reads them (Service.UseCaches), and the
// agents' heartbeats read the Hosts from them.
type Caches struct {
	byKind map[string]*store.Cache
}

// NewCaches returns the caches of every kind of Kinds; they fill once Run
// runs.
func NewCaches(st *store.Store) *Caches {
	c := &Caches{byKind: map[string]*store.Cache{}}
	for _, k := range Kinds {
		kc := store.NewCache(st, k.Plural, k.New)
		for _, idx := range []struct{ name, msg, field string }{
			{IndexCluster, "spec", "cluster"},
			{IndexOwner, "spec", "owner"},
			{IndexHost, "spec", "host"},
			{IndexMachine, "status", "machine"},
		} {
			if fn := stringFieldIndex(k.New(), idx.msg, idx.field); fn != nil {
				kc.AddIndex(idx.name, fn)
			}
		}
		c.byKind[k.Plural] = kc
	}
	return c
}

// stringFieldIndex returns an index of the string field sub.name of
// objects like obj, or nil when they have no such field.
func stringFieldIndex(obj proto.Message, sub, name string) store.IndexFunc {
	sf := field(obj, sub)
	if sf == nil || sf.Message() == nil {
		return nil
	}
	f := sf.Message().Fields().ByName(protoreflect.Name(name))
	if f == nil || f.Kind() != protoreflect.StringKind || f.IsList() {
		return nil
	}
	return func(it store.Item) []string {
		v := it.Msg.ProtoReflect().Get(sf).Message().Get(f).String()
		if v == "" {
			return nil
		}
		return []string{v}
	}
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
		obj := proto.Clone(it.Msg) // the cache's message is shared
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
