package controller

import (
	"context"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/provision"
	"github.com/kilnhq/kiln/controller/shard"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/trust"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// simFleet is the process's simulated fleet in sharded --simulate mode:
// each replica simulates the hosts of the shards it holds.
type simFleet struct {
	fleet   *sim.Fleet
	kubeadm *sim.Kubeadm
}

// startShards runs the shard manager (controller/shard) until ctx ends:
// for each shard this replica holds, the host lifecycle of that shard's
// hosts, fenced on the shard key. With --simulate it first makes the
// process's simulated fleet and the simulated hosts (kept if they exist).
func (c *Controller) startShards(ctx context.Context, wg *sync.WaitGroup, client *clientv3.Client, st *store.Store, rec *events.Recorder, ca *trust.Rotating, enr *enrollment.Service, addr string) {
	if c.cfg.Simulate > 0 {
		// A rack's timings scaled down 20 times, as unsharded.
		fleet := sim.NewFleet(ctx, sim.Config{
			BMCLatency: 25 * time.Millisecond, BootDelay: 3 * time.Second, LayDuration: 6 * time.Second,
			WipeDuration: time.Second, HeartbeatInterval: c.cfg.HeartbeatInterval, Jitter: 0.5,
		}, sim.EnrollmentCheckIn(enr))
		c.simFleet = &simFleet{fleet: fleet, kubeadm: sim.NewKubeadm(fleet, 2*time.Second)}
		if _, err := sim.Populate(ctx, st, c.cfg.Simulate, "sim"); err != nil {
			c.log.Error("simulation: create hosts", "err", err)
		}
		c.log.Info("simulating hosts", "hosts", c.cfg.Simulate, "shards", c.cfg.Shards)
	}
	m := shard.NewManager(client, shard.Config{ID: c.cfg.ID, Shards: c.cfg.Shards, TTL: c.cfg.ElectionTTL, Clock: c.cfg.Clock},
		func(sctx context.Context, s int, fence store.Fence) {
			c.runShard(sctx, s, fence, st, rec, ca, enr, addr)
		}, c.log)
	c.mu.Lock()
	c.shards = m
	c.mu.Unlock()
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = m.Run(ctx)
	}()
}

// runShard runs the host lifecycle of shard s's hosts until ctx ends (the
// shard is released or lost, or the controller stops), every write fenced
// on the shard key's create revision: once the key is gone this replica
// writes nothing more for those hosts and starts no BMC or agent action.
// Paused for a move, it waits as the leader's reconcilers do.
func (c *Controller) runShard(ctx context.Context, s int, fence store.Fence, st *store.Store, rec *events.Recorder, ca *trust.Rotating, enr *enrollment.Service, addr string) {
	owns := func(host string) bool { return shard.Of(host, c.cfg.Shards) == s }
	fenced := st.Fenced(fence)
	log := c.log.With("shard", s)
	log.Info("shard: host lifecycle started", "key", fence.Key, "rev", fence.Rev)
	for ctx.Err() == nil {
		if err := st.WaitResumed(ctx); err != nil {
			break
		}
		rctx, stop := st.UntilPaused(ctx)
		if c.simFleet != nil {
			c.simFleet.adopt(rctx, st, owns)
		}
		deps, cfg, closeDeps := c.hostDeps(rctx, fenced, rec, ca, enr, addr)
		cfg.Owns = owns
		_ = provision.New(deps, cfg, log).Run(rctx)
		closeDeps()
		stop()
	}
	if c.simFleet != nil {
		c.simFleet.drop(owns)
	}
	log.Info("shard: host lifecycle stopped")
}

// adopt rebuilds the simulated machines of the owned hosts from their
// stored status. The simulation of a host lives in the process that holds
// its shard, but the machine it stands for keeps running when its shard
// moves: a Provisioned host (or one waiting for its installed agent) runs
// its installed agent; one waiting for its boot agent, laying, or past the
// lay runs its boot agent (with the image on its disk once laid, and the
// identity in it once written). A host
// at a BMC step (power, boot device) starts powered off: those steps are
// idempotent. A lay cut short by the move is not finished: the new
// holder's agent re-attaches by the operation id and, not knowing it, the
// step lays again once (one lay completes, so one is counted).
func (f *simFleet) adopt(ctx context.Context, st *store.Store, owns func(string) bool) {
	items, err := store.ListAll(ctx, st, provision.HostsKind, func() proto.Message { return &typesv1.Host{} })
	if err != nil {
		return
	}
	for _, it := range items {
		if !owns(it.Name) {
			continue
		}
		h := it.Msg.(*typesv1.Host)
		dev := "cdrom"
		if h.GetSpec().GetBmc().GetProtocol() == "ipmi" {
			dev = "pxe"
		}
		switch step := hostlife.Step(h.GetStatus().GetProvisioningStep()); {
		case h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_PROVISIONED, step == hostlife.StepWaitInstalled:
			f.fleet.Host(it.Name).RunInstalled()
		case step == hostlife.StepWaitBootAgent, step == hostlife.StepLayImage:
			f.fleet.Host(it.Name).RunBootAgent(dev, false, false)
		case step == hostlife.StepWriteIdentity:
			f.fleet.Host(it.Name).RunBootAgent(dev, true, false)
		case step == hostlife.StepBootDisk:
			// Past WriteIdentity: the disk boots into the installed agent.
			f.fleet.Host(it.Name).RunBootAgent(dev, true, true)
		}
	}
}

// drop removes the owned hosts' simulated machines: the replica that takes
// the shard simulates them.
func (f *simFleet) drop(owns func(string) bool) {
	for _, h := range f.fleet.Hosts() {
		if owns(h.Name()) {
			f.fleet.Remove(h.Name())
		}
	}
}
