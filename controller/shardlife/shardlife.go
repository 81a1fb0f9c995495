// Package shardlife runs the host lifecycle of the shards a replica
// holds (controller/shard; docs/scale.md, "Several active controllers"):
// for each, the lifecycle executor (controller/provision) over that
// shard's hosts, every write fenced on the shard's key, paused for a move
// as the leader's reconcilers are, and in --simulate mode the simulated
// machines of its hosts adopted and dropped as the shard comes and goes.
package shardlife

import (
	"context"
	"log/slog"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/provision"
	"github.com/kilnhq/kiln/controller/shard"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// SimFleet is the process's simulated fleet in sharded --simulate mode:
// each replica simulates the hosts of the shards it holds.
type SimFleet struct {
	Fleet   *sim.Fleet
	Kubeadm *sim.Kubeadm
}

// Config configures the shards' lifecycle.
type Config struct {
	// ID names this replica among the shard holders.
	ID string
	// Shards is the number of shards (> 0), the same on every replica.
	Shards int
	// TTL is the shard leases' (the election TTL).
	TTL time.Duration
	// Clock is the time source.
	Clock func() time.Time
}

// HostDeps builds the lifecycle executor's collaborators and
// configuration on st (fenced on the shard by the caller); the returned
// function releases them once the executor ended.
type HostDeps func(ctx context.Context, st *store.Store) (provision.Deps, provision.Config, func())

// New returns the shard manager that, for each shard this replica holds,
// runs the host lifecycle of that shard's hosts on st (runShard) until
// the shard is released or lost; fleet is nil unless simulating. Run the
// manager until the replica stops.
func New(client *clientv3.Client, st *store.Store, cfg Config, hostDeps HostDeps, fleet *SimFleet, log *slog.Logger) *shard.Manager {
	return shard.NewManager(client, shard.Config{ID: cfg.ID, Shards: cfg.Shards, TTL: cfg.TTL, Clock: cfg.Clock},
		func(sctx context.Context, s int, fence store.Fence) {
			runShard(sctx, s, cfg.Shards, fence, st, hostDeps, fleet, log)
		}, log)
}

// runShard runs the host lifecycle of shard s's hosts until ctx ends (the
// shard is released or lost, or the controller stops), every write fenced
// on the shard key's create revision: once the key is gone this replica
// writes nothing more for those hosts and starts no BMC or agent action.
// Paused for a move, it waits as the leader's reconcilers do.
func runShard(ctx context.Context, s, shards int, fence store.Fence, st *store.Store, hostDeps HostDeps, fleet *SimFleet, log *slog.Logger) {
	owns := func(host string) bool { return shard.Of(host, shards) == s }
	fenced := st.Fenced(fence)
	log = log.With("shard", s)
	log.Info("shard: host lifecycle started", "key", fence.Key, "rev", fence.Rev)
	for ctx.Err() == nil {
		if err := st.WaitResumed(ctx); err != nil {
			break
		}
		rctx, stop := st.UntilPaused(ctx)
		if fleet != nil {
			fleet.adopt(rctx, st, owns, log)
		}
		deps, cfg, closeDeps := hostDeps(rctx, fenced)
		cfg.Owns = owns
		_ = provision.New(deps, cfg, log).Run(rctx)
		closeDeps()
		stop()
	}
	if fleet != nil {
		fleet.drop(owns)
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
func (f *SimFleet) adopt(ctx context.Context, st *store.Store, owns func(string) bool, log *slog.Logger) {
	// Until the listing succeeds: a shard whose hosts were not adopted
	// would run their lifecycle against machines that are not there (their
	// agents refuse, the steps time out, and hosts past the lay are laid
	// again). The 3,000-host kill test, on a loaded 3-member etcd, saw it.
	var items []store.Item
	for {
		var err error
		if items, err = store.ListAll(ctx, st, provision.HostsKind, func() proto.Message { return &typesv1.Host{} }); err == nil {
			break
		}
		if ctx.Err() != nil {
			return
		}
		log.Warn("simulation: list the hosts to adopt, retrying", "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
	}
	adopted := 0
	for _, it := range items {
		if !owns(it.Name) {
			continue
		}
		adopted++
		h := it.Msg.(*typesv1.Host)
		dev := "cdrom"
		if h.GetSpec().GetBmc().GetProtocol() == "ipmi" {
			dev = "pxe"
		}
		switch step := hostlife.Step(h.GetStatus().GetProvisioningStep()); {
		case h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_PROVISIONED, step == hostlife.StepWaitInstalled:
			f.Fleet.Host(it.Name).RunInstalled()
		case step == hostlife.StepWaitBootAgent, step == hostlife.StepLayImage:
			f.Fleet.Host(it.Name).RunBootAgent(dev, false, false)
		case step == hostlife.StepWriteIdentity:
			f.Fleet.Host(it.Name).RunBootAgent(dev, true, false)
		case step == hostlife.StepBootDisk:
			// Past WriteIdentity: the disk boots into the installed agent.
			f.Fleet.Host(it.Name).RunBootAgent(dev, true, true)
		}
	}
	log.Info("simulation: machines of the shard's hosts adopted", "hosts", adopted)
}

// drop removes the owned hosts' simulated machines: the replica that takes
// the shard simulates them.
func (f *SimFleet) drop(owns func(string) bool) {
	for _, h := range f.Fleet.Hosts() {
		if owns(h.Name()) {
			f.Fleet.Remove(h.Name())
		}
	}
}
