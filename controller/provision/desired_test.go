package provision

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// etcdReads is a Store whose Get serves objs and counts the reads: the
// linearizable etcd reads CachedDesired makes.
type etcdReads struct {
	Store
	objs  map[string]proto.Message // "kind/name"
	reads int
}

func (s *etcdReads) Get(_ context.Context, kind, name string, into proto.Message) (int64, error) {
	s.reads++
	m, ok := s.objs[kind+"/"+name]
	if !ok {
		return 0, errdefs.NotFound("%s %q not found", kind, name)
	}
	proto.Merge(into, m)
	return 1, nil
}

// mapCache is a DesiredCache over a map.
type mapCache struct {
	objs   map[string]proto.Message
	synced bool
}

func (c mapCache) Get(name string) (store.Item, bool) {
	m, ok := c.objs[name]
	return store.Item{Name: name, Rev: 1, Msg: m}, ok
}
func (c mapCache) Synced() bool { return c.synced }

func machine(name, host, image string) *typesv1.Machine {
	return &typesv1.Machine{Metadata: &typesv1.ObjectMeta{Name: name}, Spec: &typesv1.MachineSpec{Host: host, Image: image}}
}

func image(name, url string) *typesv1.Image {
	return &typesv1.Image{Metadata: &typesv1.ObjectMeta{Name: name}, Spec: &typesv1.ImageSpec{Url: url}}
}

// TestCachedDesired: the Machine and Image come from the caches when they
// hold them (no etcd read), and from etcd when a cache is not synced,
// misses, or holds a Machine bound to another host; "does not exist" is
// only ever decided by etcd.
func TestCachedDesired(t *testing.T) {
	tests := []struct {
		name          string
		etcd          map[string]proto.Message
		machines      mapCache
		images        mapCache
		wantImageURL  string // "" with wantBlocked false: no image wanted
		wantBlocked   bool
		wantEtcdReads int
	}{
		{
			name:          "both cached",
			machines:      mapCache{synced: true, objs: map[string]proto.Message{"m1": machine("m1", "h1", "img")}},
			images:        mapCache{synced: true, objs: map[string]proto.Message{"img": image("img", "http://cache/img")}},
			wantImageURL:  "http://cache/img",
			wantEtcdReads: 0,
		},
		{
			name:          "caches not synced",
			etcd:          map[string]proto.Message{"machines/m1": machine("m1", "h1", "img"), "images/img": image("img", "http://etcd/img")},
			machines:      mapCache{objs: map[string]proto.Message{"m1": machine("m1", "h1", "stale")}},
			images:        mapCache{objs: map[string]proto.Message{"img": image("img", "http://cache/img")}},
			wantImageURL:  "http://etcd/img",
			wantEtcdReads: 2,
		},
		{
			name:          "machine not cached yet (just bound)",
			etcd:          map[string]proto.Message{"machines/m1": machine("m1", "h1", "img")},
			machines:      mapCache{synced: true},
			images:        mapCache{synced: true, objs: map[string]proto.Message{"img": image("img", "http://cache/img")}},
			wantImageURL:  "http://cache/img",
			wantEtcdReads: 1,
		},
		{
			name:          "cached machine bound to another host",
			etcd:          map[string]proto.Message{"machines/m1": machine("m1", "h1", "img")},
			machines:      mapCache{synced: true, objs: map[string]proto.Message{"m1": machine("m1", "h9", "old")}},
			images:        mapCache{synced: true, objs: map[string]proto.Message{"img": image("img", "http://cache/img")}},
			wantImageURL:  "http://cache/img",
			wantEtcdReads: 1,
		},
		{
			name:          "machine gone: etcd says so",
			machines:      mapCache{synced: true},
			images:        mapCache{synced: true},
			wantEtcdReads: 1,
		},
		{
			name:          "image missing: blocked, decided by etcd",
			machines:      mapCache{synced: true, objs: map[string]proto.Message{"m1": machine("m1", "h1", "img")}},
			images:        mapCache{synced: true},
			wantBlocked:   true,
			wantEtcdReads: 1,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st := &etcdReads{objs: tt.etcd}
			h := &typesv1.Host{Metadata: &typesv1.ObjectMeta{Name: "h1"}, Status: &typesv1.HostStatus{Machine: "m1"}}
			got, err := CachedDesired(st, tt.machines, tt.images)(context.Background(), h)
			require.NoError(t, err)
			if got.Image.GetUrl() != tt.wantImageURL || (got.Blocked != nil) != tt.wantBlocked {
				t.Errorf("CachedDesired() = image %q blocked %v, want %q blocked %v", got.Image.GetUrl(), got.Blocked, tt.wantImageURL, tt.wantBlocked)
			}
			if st.reads != tt.wantEtcdReads {
				t.Errorf("CachedDesired() made %d etcd reads, want %d", st.reads, tt.wantEtcdReads)
			}
		})
	}
}
