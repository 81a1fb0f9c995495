package controller

import (
	"context"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/provision"
	"github.com/kilnhq/kiln/controller/shardlife"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/trust"
)

// startShards runs the shard manager (controller/shardlife) until ctx
// ends: for each shard this replica holds, the host lifecycle of that
// shard's hosts, fenced on the shard key. With --simulate it first makes
// the process's simulated fleet and the simulated hosts (kept if they
// exist).
func (c *Controller) startShards(ctx context.Context, wg *sync.WaitGroup, client *clientv3.Client, st *store.Store, rec *events.Recorder, ca *trust.Rotating, enr *enrollment.Service, addr string) {
	if c.cfg.Simulate > 0 {
		// A rack's timings scaled down 20 times, as unsharded.
		fleet := sim.NewFleet(ctx, sim.Config{
			BMCLatency: 25 * time.Millisecond, BootDelay: 3 * time.Second, LayDuration: 6 * time.Second,
			WipeDuration: time.Second, HeartbeatInterval: c.cfg.HeartbeatInterval, Jitter: 0.5,
		}, sim.EnrollmentCheckIn(enr))
		c.simFleet = &shardlife.SimFleet{Fleet: fleet, Kubeadm: sim.NewKubeadm(fleet, 2*time.Second)}
		if _, err := sim.Populate(ctx, st, c.cfg.Simulate, "sim"); err != nil {
			c.log.Error("simulation: create hosts", "err", err)
		}
		c.log.Info("simulating hosts", "hosts", c.cfg.Simulate, "shards", c.cfg.Shards)
	}
	m := shardlife.New(client, st, shardlife.Config{ID: c.cfg.ID, Shards: c.cfg.Shards, TTL: c.cfg.ElectionTTL, Clock: c.cfg.Clock},
		func(sctx context.Context, fenced *store.Store) (provision.Deps, provision.Config, func()) {
			return c.hostDeps(sctx, fenced, rec, ca, enr, addr)
		}, c.simFleet, c.log)
	c.mu.Lock()
	c.shards = m
	c.mu.Unlock()
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = m.Run(ctx)
	}()
}
