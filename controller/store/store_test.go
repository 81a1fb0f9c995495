package store

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/seal"
)

// testLogger sends slog output to t.Log.
func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(string(bytes.TrimRight(p, "\n")))
	return len(p), nil
}

// startEtcd runs a single-member embedded etcd in t.TempDir() and returns a
// client to it; both are closed at cleanup.
func startEtcd(t testing.TB) (*Embedded, *clientv3.Client) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e, err := StartEmbedded(ctx, EmbeddedConfig{DataDir: filepath.Join(t.TempDir(), "etcd"), Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(e.Close)
	c, err := Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return e, c
}

func newStore(t testing.TB) (*Store, *clientv3.Client) {
	t.Helper()
	_, c := startEtcd(t)
	s, err := seal.LoadOrCreateKey(filepath.Join(t.TempDir(), "seal.key"))
	require.NoError(t, err)
	return New(c, WithSealer(s), WithLogger(testLogger(t))), c
}

func host(name, mac string) *typesv1.Host {
	return &typesv1.Host{
		Kind:     "Host",
		Metadata: &typesv1.ObjectMeta{Name: name, Labels: map[string]string{"rack": "rack1"}},
		Spec:     &typesv1.HostSpec{BootMac: mac, Online: true},
	}
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func TestCRUD(t *testing.T) {
	s, c := newStore(t)
	ctx := testCtx(t)

	h := host("rack1-01", "52:54:00:00:00:01")
	rev, err := s.Create(ctx, "hosts", "rack1-01", h)
	require.NoError(t, err)
	if _, err := s.Create(ctx, "hosts", "rack1-01", h); !errdefs.IsAlreadyExists(err) {
		t.Errorf("Create(existing) = %v, want AlreadyExists", err)
	}

	// The value is protobuf binary under /kiln/v1/hosts/rack1-01.
	raw, err := c.Get(ctx, "/kiln/v1/hosts/rack1-01")
	require.NoError(t, err)
	require.Len(t, raw.Kvs, 1)
	var fromRaw typesv1.Host
	require.NoError(t, proto.Unmarshal(raw.Kvs[0].Value, &fromRaw))
	if !proto.Equal(&fromRaw, h) {
		t.Errorf("raw etcd value = %v, want %v", &fromRaw, h)
	}

	var got typesv1.Host
	gotRev, err := s.Get(ctx, "hosts", "rack1-01", &got)
	require.NoError(t, err)
	if gotRev != rev || !proto.Equal(&got, h) {
		t.Errorf("Get() = (%v, %d), want (%v, %d)", &got, gotRev, h, rev)
	}

	h.Spec.Online = false
	rev2, err := s.Update(ctx, "hosts", "rack1-01", h, rev)
	require.NoError(t, err)
	if rev2 <= rev {
		t.Errorf("Update() revision = %d, want > %d", rev2, rev)
	}
	if _, err := s.Update(ctx, "hosts", "rack1-01", h, rev); !errdefs.IsConflict(err) {
		t.Errorf("Update(stale revision %d) = %v, want Conflict", rev, err)
	}
	if _, err := s.Update(ctx, "hosts", "nope", h, rev); !errdefs.IsNotFound(err) {
		t.Errorf("Update(absent) = %v, want NotFound", err)
	}
	if _, err := s.Update(ctx, "hosts", "nope", h, 0); !errdefs.IsNotFound(err) {
		t.Errorf("Update(absent, rev 0) = %v, want NotFound", err)
	}
	rev3, err := s.Update(ctx, "hosts", "rack1-01", h, 0)
	require.NoError(t, err, "unconditional update")

	if err := s.Delete(ctx, "hosts", "rack1-01", rev2); !errdefs.IsConflict(err) {
		t.Errorf("Delete(stale revision) = %v, want Conflict", err)
	}
	require.NoError(t, s.Delete(ctx, "hosts", "rack1-01", rev3))
	if _, err := s.Get(ctx, "hosts", "rack1-01", &got); !errdefs.IsNotFound(err) {
		t.Errorf("Get(deleted) = %v, want NotFound", err)
	}
	if err := s.Delete(ctx, "hosts", "rack1-01", 0); !errdefs.IsNotFound(err) {
		t.Errorf("Delete(absent) = %v, want NotFound", err)
	}
}

func TestRejectsBadKindsAndNames(t *testing.T) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	tests := []struct{ kind, name string }{
		{"", "a"},
		{"hosts", ""},
		{"Hosts", "a"},
		{"hosts", "a/b"},
		{"hosts", "a b"},
		{"secrets", "bmc"},
		{"hosts/x", "a"},
	}
	for _, tt := range tests {
		if _, err := s.Create(ctx, tt.kind, tt.name, host("x", "")); !errdefs.IsInvalidArgument(err) {
			t.Errorf("Create(%q, %q) = %v, want InvalidArgument", tt.kind, tt.name, err)
		}
	}
}

// TestConcurrentUpdatesLoseNothing runs read-modify-write loops from many
// goroutines on one key: optimistic concurrency turns every race into a
// Conflict and a retry, so no increment is lost.
func TestConcurrentUpdatesLoseNothing(t *testing.T) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	_, err := s.Create(ctx, "hosts", "counter", host("counter", ""))
	require.NoError(t, err)

	const workers, perWorker = 4, 10
	var wg sync.WaitGroup
	var mu sync.Mutex
	conflicts := 0
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < perWorker; {
				var h typesv1.Host
				rev, err := s.Get(ctx, "hosts", "counter", &h)
				if err != nil {
					errs <- err
					return
				}
				h.Metadata.Generation++
				if _, err := s.Update(ctx, "hosts", "counter", &h, rev); err != nil {
					if errdefs.IsConflict(err) {
						mu.Lock()
						conflicts++
						mu.Unlock()
						continue
					}
					errs <- err
					return
				}
				i++
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("worker: %v", err)
	}
	var h typesv1.Host
	_, err = s.Get(ctx, "hosts", "counter", &h)
	require.NoError(t, err)
	if got, want := h.Metadata.Generation, int64(workers*perWorker); got != want {
		t.Errorf("generation after %d concurrent increments = %d, want %d", want, got, want)
	}
	t.Logf("%d conflicts resolved by retry", conflicts)
}

func TestListPages(t *testing.T) {
	s, c := newStore(t)
	ctx := testCtx(t)
	var want []string
	for i := 0; i < 25; i++ {
		name := fmt.Sprintf("rack1-%02d", i)
		want = append(want, name)
		_, err := s.Create(ctx, "hosts", name, host(name, ""))
		require.NoError(t, err)
	}
	// Another kind sharing the prefix's first letters must not leak in.
	_, err := s.Create(ctx, "hostsets", "x", host("x", ""))
	require.NoError(t, err)

	newHost := func() proto.Message { return &typesv1.Host{} }
	all, next, err := s.List(ctx, "hosts", newHost, ListOptions{})
	require.NoError(t, err)
	if len(all) != 25 || next != "" {
		t.Fatalf("List(no limit) = %d items, next %q; want 25, \"\"", len(all), next)
	}

	var got []string
	var pages int
	opts := ListOptions{Limit: 10}
	for {
		items, next, err := s.List(ctx, "hosts", newHost, opts)
		require.NoError(t, err)
		pages++
		for _, it := range items {
			got = append(got, it.Name)
			if h := it.Msg.(*typesv1.Host); h.Metadata.GetName() != it.Name {
				t.Errorf("item %q decodes to host %q", it.Name, h.Metadata.GetName())
			}
		}
		if pages == 1 {
			// Changes after the first page do not show in later pages:
			// the listing is one snapshot.
			require.NoError(t, s.Delete(ctx, "hosts", "rack1-20", 0))
			_, err := s.Create(ctx, "hosts", "rack1-99", host("rack1-99", ""))
			require.NoError(t, err)
		}
		if next == "" {
			break
		}
		opts.Continue = next
	}
	if pages != 3 {
		t.Errorf("List(limit 10) of 25 took %d pages, want 3", pages)
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("paged names = %v, want %v", got, want)
	}

	if _, _, err := s.List(ctx, "hosts", newHost, ListOptions{Continue: "!!"}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("List(malformed token) = %v, want InvalidArgument", err)
	}

	// A token whose revision was compacted away is refused clearly.
	_, next, err = s.List(ctx, "hosts", newHost, ListOptions{Limit: 5})
	require.NoError(t, err)
	rev, err := s.Create(ctx, "hosts", "rack1-98", host("rack1-98", ""))
	require.NoError(t, err)
	_, err = c.Compact(ctx, rev)
	require.NoError(t, err)
	if _, _, err := s.List(ctx, "hosts", newHost, ListOptions{Limit: 5, Continue: next}); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("List(compacted token) = %v, want FailedPrecondition", err)
	}
}

func TestListNamePrefix(t *testing.T) {
	s, _ := newStore(t)
	ctx := testCtx(t)
	for _, name := range []string{"a-control-plane", "a-app", "a-b-control-plane", "a-b-app", "ab-app", "b-app", "a"} {
		_, err := s.Create(ctx, "machinedeployments", name, host(name, ""))
		require.NoError(t, err)
	}
	_, err := s.Create(ctx, "machinedeploymentsx", "a-x", host("a-x", ""))
	require.NoError(t, err)
	newHost := func() proto.Message { return &typesv1.Host{} }
	names := func(items []Item) []string {
		var out []string
		for _, it := range items {
			out = append(out, it.Name)
		}
		return out
	}

	items, err := ListPrefix(ctx, s, "machinedeployments", "a-", newHost)
	require.NoError(t, err)
	require.Equal(t, []string{"a-app", "a-b-app", "a-b-control-plane", "a-control-plane"}, names(items))

	// Paged: the pages stay within the prefix.
	var got []string
	opts := ListOptions{Limit: 3, NamePrefix: "a-"}
	for {
		items, next, err := s.List(ctx, "machinedeployments", newHost, opts)
		require.NoError(t, err)
		got = append(got, names(items)...)
		if next == "" {
			break
		}
		opts.Continue = next
	}
	require.Equal(t, []string{"a-app", "a-b-app", "a-b-control-plane", "a-control-plane"}, got)

	// A continue token of a listing of the whole kind does not lead
	// outside the prefix.
	_, next, err := s.List(ctx, "machinedeployments", newHost, ListOptions{Limit: 1})
	require.NoError(t, err) // after "a"
	items, _, err = s.List(ctx, "machinedeployments", newHost, ListOptions{Continue: next, NamePrefix: "b-"})
	require.NoError(t, err)
	require.Equal(t, []string{"b-app"}, names(items))

	items, err = ListPrefix(ctx, s, "machinedeployments", "zz", newHost)
	require.NoError(t, err)
	require.Empty(t, items)
	_, _, err = s.List(ctx, "machinedeployments", newHost, ListOptions{NamePrefix: "a/"})
	require.True(t, errdefs.IsInvalidArgument(err), "List(prefix with /) = %v, want InvalidArgument", err)
}

func recv(t *testing.T, ch <-chan WatchEvent) WatchEvent {
	t.Helper()
	select {
	case ev, ok := <-ch:
		require.True(t, ok, "watch channel closed early")
		return ev
	case <-time.After(time.Minute):
		t.Fatal("no watch event within a minute")
		return WatchEvent{}
	}
}

func TestWatch(t *testing.T) {
	s, c := newStore(t)
	ctx := testCtx(t)
	rev0, err := s.Create(ctx, "hosts", "before", host("before", ""))
	require.NoError(t, err)

	wctx, cancel := context.WithCancel(ctx)
	ch := s.Watch(wctx, "hosts", rev0+1)

	h := host("rack1-01", "52:54:00:00:00:01")
	rev1, err := s.Create(ctx, "hosts", "rack1-01", h)
	require.NoError(t, err)
	_, err = s.Create(ctx, "images", "other-kind", host("x", ""))
	require.NoError(t, err)
	h.Spec.Online = false
	rev2, err := s.Update(ctx, "hosts", "rack1-01", h, rev1)
	require.NoError(t, err)
	require.NoError(t, s.Delete(ctx, "hosts", "rack1-01", rev2))

	want := []struct {
		typ  EventType
		name string
		rev  int64
	}{{EventPut, "rack1-01", rev1}, {EventPut, "rack1-01", rev2}, {EventDelete, "rack1-01", 0}}
	for i, w := range want {
		ev := recv(t, ch)
		require.NoError(t, ev.Err)
		if ev.Type != w.typ || ev.Name != w.name || (w.rev != 0 && ev.Rev != w.rev) {
			t.Errorf("event %d = %v %q rev %d, want %v %q rev %d", i, ev.Type, ev.Name, ev.Rev, w.typ, w.name, w.rev)
		}
		if i == 1 {
			var got typesv1.Host
			require.NoError(t, proto.Unmarshal(ev.Value, &got))
			if !proto.Equal(&got, h) {
				t.Errorf("event %d value = %v, want %v", i, &got, h)
			}
		}
	}
	cancel()
	for range ch { // Closes once ctx ends.
	}

	// A watch from a compacted revision reports it and ends.
	cur, err := s.Create(ctx, "hosts", "after", host("after", ""))
	require.NoError(t, err)
	_, err = c.Compact(ctx, cur)
	require.NoError(t, err)
	ch = s.Watch(ctx, "hosts", rev0)
	ev := recv(t, ch)
	if !errdefs.IsFailedPrecondition(ev.Err) {
		t.Errorf("Watch(compacted revision) first event = %+v, want FailedPrecondition error", ev)
	}
	if _, ok := <-ch; ok {
		t.Error("watch channel still open after a compaction error")
	}
}

func TestSecretsAreSealedAtRest(t *testing.T) {
	s, c := newStore(t)
	ctx := testCtx(t)
	password := []byte("bmc-password-0f3c9a")

	require.NoError(t, s.PutSecret(ctx, "bmc/rack1-01", password))
	raw, err := c.Get(ctx, "/kiln/v1/secrets/bmc/rack1-01")
	require.NoError(t, err)
	require.Len(t, raw.Kvs, 1)
	if bytes.Contains(raw.Kvs[0].Value, password) {
		t.Fatal("etcd holds the plaintext password")
	}
	got, err := s.GetSecret(ctx, "bmc/rack1-01")
	require.NoError(t, err)
	if !bytes.Equal(got, password) {
		t.Errorf("GetSecret() = %q, want %q", got, password)
	}

	// A sealed value copied to another host's path does not open there.
	_, err = c.Put(ctx, "/kiln/v1/secrets/bmc/rack1-02", string(raw.Kvs[0].Value))
	require.NoError(t, err)
	if _, err := s.GetSecret(ctx, "bmc/rack1-02"); !errdefs.IsPermissionDenied(err) {
		t.Errorf("GetSecret(value moved from another path) = %v, want PermissionDenied", err)
	}
	// A controller with another key file cannot read it.
	otherKey, err := seal.LoadOrCreateKey(filepath.Join(t.TempDir(), "other.key"))
	require.NoError(t, err)
	if _, err := New(c, WithSealer(otherKey)).GetSecret(ctx, "bmc/rack1-01"); !errdefs.IsPermissionDenied(err) {
		t.Errorf("GetSecret(with another key) = %v, want PermissionDenied", err)
	}
	if err := New(c).PutSecret(ctx, "bmc/x", password); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("PutSecret(no sealer) = %v, want FailedPrecondition", err)
	}
	for _, p := range []string{"", "../x", "bmc//x", "bmc/a b"} {
		if err := s.PutSecret(ctx, p, password); !errdefs.IsInvalidArgument(err) {
			t.Errorf("PutSecret(%q) = %v, want InvalidArgument", p, err)
		}
	}
	require.NoError(t, s.DeleteSecret(ctx, "bmc/rack1-01"))
	if _, err := s.GetSecret(ctx, "bmc/rack1-01"); !errdefs.IsNotFound(err) {
		t.Errorf("GetSecret(deleted) = %v, want NotFound", err)
	}
	// Secrets never show up as a resource kind.
	if _, _, err := s.List(ctx, "secrets", func() proto.Message { return &typesv1.Host{} }, ListOptions{}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("List(secrets) = %v, want InvalidArgument", err)
	}
}

func TestEmbeddedRestartKeepsData(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "etcd")
	ctx := testCtx(t)
	e, err := StartEmbedded(ctx, EmbeddedConfig{DataDir: dir})
	require.NoError(t, err)
	c, err := Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	_, err = New(c).Create(ctx, "hosts", "rack1-01", host("rack1-01", "52:54:00:00:00:01"))
	require.NoError(t, err)
	c.Close()
	e.Close()

	e, err = StartEmbedded(ctx, EmbeddedConfig{DataDir: dir})
	require.NoError(t, err)
	defer e.Close()
	c, err = Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	defer c.Close()
	var h typesv1.Host
	_, err = New(c).Get(ctx, "hosts", "rack1-01", &h)
	require.NoError(t, err)
	if h.Spec.GetBootMac() != "52:54:00:00:00:01" {
		t.Errorf("after restart Get() boot MAC = %q, want %q", h.Spec.GetBootMac(), "52:54:00:00:00:01")
	}
}

// TestUpdateWith: a resource and extra ops (a status and its events) are
// one etcd write; when the compare fails neither is stored.
func TestUpdateWith(t *testing.T) {
	s, c := newStore(t)
	ctx := context.Background()
	rev, err := s.Create(ctx, "hosts", "h1", host("h1", "aa:bb:cc:dd:ee:01"))
	require.NoError(t, err)
	h := &typesv1.Host{}
	_, err = s.Get(ctx, "hosts", "h1", h)
	require.NoError(t, err)
	h.Status = &typesv1.HostStatus{Power: "on"}
	newRev, answers, err := s.UpdateWith(ctx, "hosts", "h1", h, rev, []clientv3.Op{clientv3.OpPut("/kiln/v1/events/hosts/h1/1", "ev")})
	require.NoError(t, err)
	require.Equal(t, rev+1, newRev, "the host and the event: one revision")
	require.Len(t, answers, 1, "one answer per extra op")
	require.NotNil(t, answers[0].GetResponsePut(), "the answer to the event's put")
	got, err := c.Get(ctx, "/kiln/v1/events/hosts/h1/1")
	require.NoError(t, err)
	require.Len(t, got.Kvs, 1)
	require.Equal(t, newRev, got.Kvs[0].ModRevision)

	// GetKey reads a key that is no resource.
	kv, err := s.GetKey(ctx, "/kiln/v1/events/hosts/h1/1")
	require.NoError(t, err)
	require.Equal(t, "ev", string(kv.Value))
	require.Equal(t, newRev, kv.ModRevision)
	kv, err = s.GetKey(ctx, "/kiln/v1/events/hosts/h1/absent")
	require.NoError(t, err)
	require.Nil(t, kv, "an absent key")

	_, _, err = s.UpdateWith(ctx, "hosts", "h1", h, rev, []clientv3.Op{clientv3.OpPut("/kiln/v1/events/hosts/h1/2", "ev")})
	require.True(t, errdefs.IsConflict(err), "UpdateWith at a stale revision = %v, want Conflict", err)
	got, err = c.Get(ctx, "/kiln/v1/events/hosts/h1/2")
	require.NoError(t, err)
	require.Empty(t, got.Kvs, "the event of a write that lost its compare")
}
