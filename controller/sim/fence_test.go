package sim_test

import (
	"context"
	"errors"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/controller/provision"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store"
)

// TestDeposedLeaderProvisionsNothing: a host lifecycle whose store is
// fenced on a leader term that has ended (its lease revoked) neither
// writes the host nor powers, boots or lays it; the lifecycle of the
// current term then provisions the host, laying it once.
func TestDeposedLeaderProvisionsNothing(t *testing.T) {
	w := newWorld(t, fastSim)
	names, err := sim.Populate(w.ctx, w.st, 1, "rack1")
	require.NoError(t, err)
	name := names[0]
	term := func(key string) (store.Fence, clientv3.LeaseID) {
		lease, err := w.client.Grant(w.ctx, 60)
		require.NoError(t, err)
		put, err := w.client.Put(w.ctx, key, "leader", clientv3.WithLease(lease.ID))
		require.NoError(t, err)
		return store.Fence{Key: key, Rev: put.Header.Revision}, lease.ID
	}
	old, lease := term("/kiln/v1/election/controller/old")
	_, err = w.client.Revoke(w.ctx, lease)
	require.NoError(t, err)
	before, err := w.st.Get(w.ctx, "hosts", name, w.host(name))
	require.NoError(t, err)

	deposed := provision.New(provision.Deps{Store: w.st.Fenced(old), Recorder: w.rec, BMCs: w.fleet.BMCDialer(), Agents: w.fleet.AgentDialer()},
		w.cfg, slog.New(slog.DiscardHandler))
	_, err = deposed.Reconcile(w.ctx, name)
	require.True(t, errors.Is(err, store.ErrFenced), "deposed lifecycle's Reconcile(%s) = %v, want store.ErrFenced", name, err)
	t.Logf("deposed leader's host step refused: %v", err)
	after, err := w.st.Get(w.ctx, "hosts", name, w.host(name))
	require.NoError(t, err)
	require.Equal(t, before, after, "host %s written by the deposed leader", name)
	require.False(t, w.fleet.Host(name).Powered(), "host %s powered by the deposed leader", name)
	require.Zero(t, w.fleet.Host(name).Lays(), "host %s laid by the deposed leader", name)

	current, _ := term("/kiln/v1/election/controller/current")
	leader := provision.New(provision.Deps{Store: w.st.Fenced(current), Recorder: w.rec, BMCs: w.fleet.BMCDialer(), Agents: w.fleet.AgentDialer()},
		w.cfg, slog.New(slog.DiscardHandler))
	ctx, cancel := context.WithCancel(w.ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = leader.Run(ctx) }()
	defer func() { cancel(); <-done }()
	w.waitFor(names, "Provisioned", provisioned)
	w.checkProvisionedOnce(names)
}
