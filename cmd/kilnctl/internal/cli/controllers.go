package cli

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/kilnhq/kiln/internal/errdefs"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// isControllersKind reports whether `kilnctl get` was asked for the
// controller replicas rather than a resource kind.
func isControllersKind(k string) bool {
	switch strings.ToLower(k) {
	case "controllers", "controller", "ctl":
		return true
	}
	return false
}

// getControllers prints the controller replicas (ListControllers): which
// leads, and with sharding the shards each holds and its hosts.
func (a *app) getControllers(ctx context.Context, out io.Writer, output string) error {
	if output != "" && output != "json" && output != "wide" {
		return errdefs.InvalidArgument("output format %q: get controllers prints a table (or wide) or json", output)
	}
	c, err := a.client(ctx)
	if err != nil {
		return err
	}
	cctx, cancel := a.call(ctx)
	defer cancel()
	resp, err := c.ListControllers(cctx, &controllerv1.ListControllersRequest{})
	if err != nil {
		return a.rpcError("get controllers", err)
	}
	if output == "json" {
		b, err := protojson.MarshalOptions{Multiline: true, EmitUnpopulated: true}.Marshal(resp)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(out, string(b))
		return err
	}
	return writeControllers(out, resp)
}

// writeControllers writes the replicas as a table:
// NAME LEADER SHARDS HOSTS SHARD-IDS, then a summary line.
func writeControllers(out io.Writer, resp *controllerv1.ListControllersResponse) error {
	w := tabwriter.NewWriter(out, 0, 0, 3, ' ', 0)
	fmt.Fprintln(w, "NAME\tLEADER\tSHARDS\tHOSTS\tSHARD-IDS")
	for _, r := range resp.GetControllers() {
		leader := ""
		if r.GetLeader() {
			leader = "*"
		}
		shards, hosts := "-", "-"
		if resp.GetShards() > 0 && r.GetShardMember() || len(r.GetShards()) > 0 {
			shards, hosts = strconv.Itoa(len(r.GetShards())), strconv.FormatInt(r.GetHosts(), 10)
		}
		name := clean(r.GetId())
		if !r.GetRegistered() {
			name += " (not registered)"
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\n", name, dash(leader), shards, hosts, dash(intList(r.GetShards())))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if resp.GetShards() == 0 {
		_, err := fmt.Fprintf(out, "not sharded: the leader runs the host lifecycle of all %d hosts\n", resp.GetHosts())
		return err
	}
	unowned := "none"
	if len(resp.GetUnownedShards()) > 0 {
		unowned = fmt.Sprintf("%s (%d hosts)", intList(resp.GetUnownedShards()), resp.GetUnownedHosts())
	}
	_, err := fmt.Fprintf(out, "%d shards, %d hosts; unowned shards: %s\n", resp.GetShards(), resp.GetHosts(), unowned)
	return err
}

func intList(v []int32) string {
	s := make([]string, len(v))
	for i, n := range v {
		s[i] = strconv.Itoa(int(n))
	}
	return strings.Join(s, ",")
}
