// Package storetest starts a real embedded etcd for tests and wraps a
// store.Store to count what reaches etcd.
package storetest

import (
	"context"
	"log/slog"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// New starts an embedded etcd member in a temporary directory and returns
// a Store on it; both end with the test.
func New(t testing.TB) *store.Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e, err := store.StartEmbedded(ctx, store.EmbeddedConfig{DataDir: filepath.Join(t.TempDir(), "etcd"), Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(e.Close)
	c, err := store.Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return store.New(c, store.WithLogger(slog.New(slog.DiscardHandler)))
}

// ReadCounter is a Store that counts the single-object reads (Get,
// GetUnpaused) that reach etcd.
type ReadCounter struct {
	*store.Store
	Reads atomic.Int64
}

func (c *ReadCounter) Get(ctx context.Context, kind, name string, into proto.Message) (int64, error) {
	c.Reads.Add(1)
	return c.Store.Get(ctx, kind, name, into)
}

func (c *ReadCounter) GetUnpaused(ctx context.Context, kind, name string, into proto.Message) (int64, error) {
	c.Reads.Add(1)
	return c.Store.GetUnpaused(ctx, kind, name, into)
}

// Modify reads kind/name, lets change edit it and writes it back, reading
// again when another writer (an executor writing its status) came in
// between: what a user's apply does. A test that writes an object its
// controllers also write must go through this, or it fails on the race.
func Modify[T proto.Message](t testing.TB, st *store.Store, kind, name string, change func(T)) {
	t.Helper()
	for {
		var zero T
		x := zero.ProtoReflect().New().Interface().(T)
		rev, err := st.Get(context.Background(), kind, name, x)
		require.NoError(t, err)
		change(x)
		_, err = st.Update(context.Background(), kind, name, x, rev)
		if errdefs.IsConflict(err) {
			continue
		}
		require.NoError(t, err)
		return
	}
}
