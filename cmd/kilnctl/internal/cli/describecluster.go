package cli

import (
	"context"
	"io"
	"strings"

	"github.com/kilnhq/kiln/cmd/kilnctl/internal/describe"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// listAll reads every object of kind, page by page.
func (a *app) listAll(ctx context.Context, c controllerv1.ResourcesClient, kind string) ([]*controllerv1.Resource, error) {
	var out []*controllerv1.Resource
	cont := ""
	for {
		cctx, cancel := a.call(ctx)
		resp, err := c.List(cctx, &controllerv1.ListRequest{Kind: kind, Limit: 500, Continue: cont})
		cancel()
		if err != nil {
			return nil, a.rpcError("list "+strings.ToLower(kind)+"s", err)
		}
		out = append(out, resp.GetItems()...)
		if cont = resp.GetContinue(); cont == "" {
			return out, nil
		}
	}
}

// loadCluster gets cluster name and lists its control planes,
// deployments, machines, health checks and the hosts of its machines.
func (a *app) loadCluster(ctx context.Context, c controllerv1.ResourcesClient, name string) (*describe.ClusterObjects, error) {
	cctx, cancel := a.call(ctx)
	r, err := c.Get(cctx, &controllerv1.GetRequest{Kind: "Cluster", Name: name})
	cancel()
	if err != nil {
		return nil, a.rpcError("describe cluster/"+name, err)
	}
	var all []*controllerv1.Resource
	for _, kind := range []string{"ControlPlane", "MachineDeployment", "Machine", "HealthCheck", "Host"} {
		items, err := a.listAll(ctx, c, kind)
		if err != nil {
			return nil, err
		}
		all = append(all, items...)
	}
	return describe.Collect(r.GetCluster(), all), nil
}

// describeCluster writes `kilnctl describe cluster NAME`: the tree of
// the cluster's objects with every condition, then the cluster's recent
// events.
func (a *app) describeCluster(ctx context.Context, out io.Writer, c controllerv1.ResourcesClient, name string, events int64) error {
	o, err := a.loadCluster(ctx, c, name)
	if err != nil {
		return err
	}
	now := a.opts.Now()
	if err := describe.WriteTree(out, describe.ClusterTree(o, now)); err != nil {
		return err
	}
	cctx, cancel := a.call(ctx)
	defer cancel()
	evs, err := c.ListEvents(cctx, &controllerv1.ListEventsRequest{ObjectKind: "Cluster", ObjectName: name, Limit: events})
	if err != nil {
		return a.rpcError("describe cluster/"+name+": events", err)
	}
	return writeEvents(out, evs.GetEvents(), now)
}
