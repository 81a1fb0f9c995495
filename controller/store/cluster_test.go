package store

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// retry runs op until it succeeds or fails with anything but Unavailable,
// as a reconciler does while an etcd cluster elects a new leader. There is
// no timing assertion: the test's context bounds it.
func retry(ctx context.Context, t *testing.T, what string, op func(ctx context.Context, attempt int) error) {
	t.Helper()
	for attempt := 0; ; attempt++ {
		opCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := op(opCtx, attempt)
		cancel()
		if err == nil {
			return
		}
		transient := errdefs.IsUnavailable(err) || errors.Is(err, context.DeadlineExceeded)
		if !transient || ctx.Err() != nil {
			t.Fatalf("%s: %v (attempt %d)", what, err, attempt+1)
		}
		t.Logf("%s: attempt %d: %v; retrying", what, attempt+1, err)
		select {
		case <-ctx.Done():
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// TestThreeMemberClusterSurvivesLosingOne runs a three-member etcd cluster
// on loopback, stops its leader, and checks that the store keeps serving
// writes, reads, lists and its open watch through the surviving two.
func TestThreeMemberClusterSurvivesLosingOne(t *testing.T) {
	if testing.Short() {
		t.Skip("three-member etcd cluster: skipped with -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	const n = 3
	names := make([]string, n)
	peers := make([]string, n)
	clients := make([]string, n)
	for i := range n {
		var err error
		names[i] = fmt.Sprintf("m%d", i)
		peers[i], err = FreeLoopbackURL()
		require.NoError(t, err)
		clients[i], err = FreeLoopbackURL()
		require.NoError(t, err)
	}
	initial := InitialCluster(names, peers)
	dir := t.TempDir()

	// Members of a new cluster start together: none is ready without a quorum.
	members := make([]*Embedded, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			members[i], errs[i] = StartEmbedded(ctx, EmbeddedConfig{
				DataDir:           filepath.Join(dir, names[i]),
				Name:              names[i],
				ClientURL:         clients[i],
				PeerURL:           peers[i],
				InitialCluster:    initial,
				ClusterToken:      "kiln-test-" + filepath.Base(dir),
				HeartbeatInterval: 250 * time.Millisecond,
				ElectionTimeout:   2500 * time.Millisecond,
				ReadyTimeout:      2 * time.Minute,
				Logger:            testLogger(t),
			})
		}()
	}
	wg.Wait()
	stopped := make([]bool, n)
	defer func() {
		for i, m := range members {
			if m != nil && !stopped[i] {
				m.Close()
			}
		}
	}()
	for i, err := range errs {
		require.NoError(t, err, "member %s", names[i])
	}

	c, err := Dial(clients, nil)
	require.NoError(t, err)
	defer c.Close()
	s := New(c, WithLogger(testLogger(t)))

	var lastRev int64
	for i := range 5 {
		name := fmt.Sprintf("rack1-%02d", i)
		retry(ctx, t, "create "+name, func(ctx context.Context, attempt int) error {
			rev, err := s.Create(ctx, "hosts", name, host(name, ""))
			if attempt > 0 && errdefs.IsAlreadyExists(err) {
				return nil // An earlier attempt landed.
			}
			lastRev = max(lastRev, rev)
			return err
		})
	}
	watch := s.Watch(ctx, "hosts", lastRev+1)

	leader := -1
	for i, m := range members {
		if m.etcd.Server.Leader() == m.etcd.Server.MemberID() {
			leader = i
		}
	}
	require.NotEqual(t, -1, leader, "no member reports itself leader")
	// Crash the leader: no leadership transfer, no goodbye to its peers.
	t.Logf("crashing leader %s", names[leader])
	crashed := time.Now()
	members[leader].closing.Store(true)
	members[leader].etcd.Server.HardStop()
	members[leader].etcd.Close()
	stopped[leader] = true
	t.Logf("leader %s down after %v", names[leader], time.Since(crashed).Round(10*time.Millisecond))

	retry(ctx, t, "create after stop", func(ctx context.Context, attempt int) error {
		_, err := s.Create(ctx, "hosts", "rack1-99", host("rack1-99", "52:54:00:00:00:99"))
		if attempt > 0 && errdefs.IsAlreadyExists(err) {
			return nil
		}
		return err
	})
	retry(ctx, t, "update after stop", func(ctx context.Context, _ int) error {
		var h typesv1.Host
		rev, err := s.Get(ctx, "hosts", "rack1-00", &h)
		if err != nil {
			return err
		}
		h.Spec.Online = false
		_, err = s.Update(ctx, "hosts", "rack1-00", &h, rev)
		return err
	})
	t.Logf("first write after the crash done %v after it", time.Since(crashed).Round(10*time.Millisecond))
	var got typesv1.Host
	retry(ctx, t, "get after stop", func(ctx context.Context, _ int) error {
		_, err := s.Get(ctx, "hosts", "rack1-99", &got)
		return err
	})
	if got.Spec.GetBootMac() != "52:54:00:00:00:99" {
		t.Errorf("Get(rack1-99) boot MAC = %q, want 52:54:00:00:00:99", got.Spec.GetBootMac())
	}
	var items []Item
	retry(ctx, t, "list after stop", func(ctx context.Context, _ int) error {
		var err error
		items, _, err = s.List(ctx, "hosts", func() proto.Message { return &typesv1.Host{} }, ListOptions{})
		return err
	})
	if len(items) != 6 {
		t.Errorf("List(hosts) after stop = %d items, want 6", len(items))
	}

	// The watch opened before the stop sees both writes made after it.
	seen := map[string]bool{}
	for len(seen) < 2 {
		select {
		case ev, ok := <-watch:
			require.True(t, ok, "watch closed")
			require.NoError(t, ev.Err)
			seen[ev.Name] = true
		case <-ctx.Done():
			t.Fatalf("watch saw %v before the test deadline, want rack1-00 and rack1-99", seen)
		}
	}
	if !seen["rack1-00"] || !seen["rack1-99"] {
		t.Errorf("watch saw %v, want rack1-00 and rack1-99", seen)
	}
}
