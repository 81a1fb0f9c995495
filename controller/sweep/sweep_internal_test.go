package sweep

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/cacheindex"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/store/storetest"
	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestLeaderSweepFromCache: the leader that runs the lifecycle clears
// LifecycleRunning=False (left by an API-only replica while no leader
// ran) from the hosts its Host cache shows with it, and writes no other
// host: the untouched host keeps its revision. The replica's cache finds
// them by index, a cache without it by reading every host.
func TestLeaderSweepFromCache(t *testing.T) {
	t.Run("index", func(t *testing.T) { testLeaderSweepFromCache(t, true) })
	t.Run("list", func(t *testing.T) { testLeaderSweepFromCache(t, false) })
}

func testLeaderSweepFromCache(t *testing.T, indexed bool) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st := storetest.New(t)
	host := func(name string, conds ...*typesv1.Condition) {
		_, err := st.Create(ctx, "hosts", name, &typesv1.Host{Metadata: &typesv1.ObjectMeta{Name: name},
			Status: &typesv1.HostStatus{Conditions: conds}})
		require.NoError(t, err)
	}
	host("told", lifecycleDisabled("api-1", 10*time.Second), conditions.New("BMCReachable", conditions.True, "Reachable", ""))
	host("quiet", conditions.New("BMCReachable", conditions.True, "Reachable", ""))
	quietRev, err := st.Get(ctx, "hosts", "quiet", &typesv1.Host{})
	require.NoError(t, err)

	cache := store.NewCache(st, "hosts", func() proto.Message { return &typesv1.Host{} })
	if indexed {
		// As the replica's cache of Hosts is (resources.NewCaches).
		cache.KeepEncoded()
		cacheindex.Add(cache, &typesv1.Host{})
	}
	cctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { cache.Run(cctx) })
	defer func() { stop(); wg.Wait() }()
	require.NoError(t, cache.WaitRevision(ctx, quietRev))

	s := New(Config{ID: "leader-1", Interval: time.Second, Lifecycle: true, Hosts: cache}, nil)
	s.reconcileHosts(ctx, st, nil)

	told := &typesv1.Host{}
	_, err = st.Get(ctx, "hosts", "told", told)
	require.NoError(t, err)
	require.Nil(t, conditions.Get(told.GetStatus().GetConditions(), ConditionLifecycleRunning), "LifecycleRunning=False left on host told")
	require.NotNil(t, conditions.Get(told.GetStatus().GetConditions(), "BMCReachable"), "the sweep removed another condition")
	rev, err := st.Get(ctx, "hosts", "quiet", &typesv1.Host{})
	require.NoError(t, err)
	require.Equal(t, quietRev, rev, "host quiet was written")
}
