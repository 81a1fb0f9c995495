package fleet

import (
	"context"
	"fmt"
	"time"

	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Snapshot lists the lab's hosts, the cluster's machines and the cluster.
func (l *Lab) Snapshot(ctx context.Context, cluster string) (*Snapshot, error) {
	res, err := l.Client(ctx)
	if err != nil {
		return nil, err
	}
	return SnapshotOf(ctx, res, cluster)
}

// SnapshotOf lists, through any controller's API, every host, and the
// machines, control planes, deployments and health checks of cluster,
// and the cluster (Lab.Snapshot for a controller the lab did not start).
func SnapshotOf(ctx context.Context, res controllerv1.ResourcesClient, cluster string) (*Snapshot, error) {
	s := &Snapshot{Hosts: map[string]*typesv1.Host{}, Machines: map[string]*typesv1.Machine{}}
	hs, err := listAll(ctx, res, "Host")
	if err != nil {
		return nil, err
	}
	for _, r := range hs {
		h := r.GetHost()
		s.Hosts[h.GetMetadata().GetName()] = h
	}
	ms, err := listAll(ctx, res, "Machine")
	if err != nil {
		return nil, err
	}
	for _, r := range ms {
		if m := r.GetMachine(); m.GetSpec().GetCluster() == cluster {
			s.Machines[m.GetMetadata().GetName()] = m
		}
	}
	s.ControlPlanes = map[string]*typesv1.ControlPlane{}
	s.MachineDeployments = map[string]*typesv1.MachineDeployment{}
	s.HealthChecks = map[string]*typesv1.HealthCheck{}
	for _, kind := range []string{"ControlPlane", "MachineDeployment", "HealthCheck"} {
		rs, err := listAll(ctx, res, kind)
		if err != nil {
			return nil, err
		}
		for _, r := range rs {
			switch {
			case r.GetControlPlane().GetSpec().GetCluster() == cluster && r.GetControlPlane() != nil:
				s.ControlPlanes[r.GetControlPlane().GetMetadata().GetName()] = r.GetControlPlane()
			case r.GetMachineDeployment().GetSpec().GetCluster() == cluster && r.GetMachineDeployment() != nil:
				s.MachineDeployments[r.GetMachineDeployment().GetMetadata().GetName()] = r.GetMachineDeployment()
			case r.GetHealthCheck().GetSpec().GetCluster() == cluster && r.GetHealthCheck() != nil:
				s.HealthChecks[r.GetHealthCheck().GetMetadata().GetName()] = r.GetHealthCheck()
			}
		}
	}
	c, err := res.Get(ctx, &controllerv1.GetRequest{Kind: "Cluster", Name: cluster})
	if err == nil {
		s.Cluster = c.GetCluster()
	}
	return s, nil
}

func listAll(ctx context.Context, res controllerv1.ResourcesClient, kind string) ([]*controllerv1.Resource, error) {
	var out []*controllerv1.Resource
	cont := ""
	for {
		r, err := res.List(ctx, &controllerv1.ListRequest{Kind: kind, Limit: 500, Continue: cont})
		if err != nil {
			return nil, fmt.Errorf("list %s: %w", kind, err)
		}
		out = append(out, r.GetItems()...)
		if cont = r.GetContinue(); cont == "" {
			return out, nil
		}
	}
}

// Watch polls the controller every interval, prints each line that
// changed (with the time since the start), and returns the last snapshot
// once done(snapshot) is true, or an error with the last snapshot's lines
// when ctx ends first. It is WatchStall without stall detection.
func (l *Lab) Watch(ctx context.Context, cluster string, interval time.Duration, done func(*Snapshot) bool) (*Snapshot, error) {
	return l.WatchStall(ctx, cluster, interval, 0, done)
}

// WatchStall is Watch that also gives up when nothing in the snapshots
// changed for stall (0: never), with a *StalledError naming the blocked
// objects and their False conditions.
func (l *Lab) WatchStall(ctx context.Context, cluster string, interval, stall time.Duration, done func(*Snapshot) bool) (*Snapshot, error) {
	w := Watcher{
		Snapshot: func(ctx context.Context) (*Snapshot, error) { return l.Snapshot(ctx, cluster) },
		Now:      time.Now,
		Wait: func(ctx context.Context) error {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(interval):
				return nil
			}
		},
		Say:   l.say,
		Stall: stall,
	}
	return w.Run(ctx, done)
}
