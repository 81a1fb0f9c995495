package cli

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kilnhq/kiln/controller/topologyplan"
	"github.com/kilnhq/kiln/internal/conditions"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// describeClusterClass writes `kilnctl describe clusterclass NAME`: the
// class's revisions, variables and worker classes, then its clusters with
// the revision each follows and whether it is up to date, then its
// conditions and events.
func (a *app) describeClusterClass(ctx context.Context, out io.Writer, c controllerv1.ResourcesClient, name string, events int64) error {
	what := "describe clusterclass/" + name
	cctx, cancel := a.call(ctx)
	r, err := c.Get(cctx, &controllerv1.GetRequest{Kind: "ClusterClass", Name: name})
	cancel()
	if err != nil {
		return a.rpcError(what, err)
	}
	clusters, err := a.listAll(ctx, c, "Cluster")
	if err != nil {
		return err
	}
	cctx, cancel = a.call(ctx)
	defer cancel()
	evs, err := c.ListEvents(cctx, &controllerv1.ListEventsRequest{ObjectKind: "ClusterClass", ObjectName: name, Limit: events})
	if err != nil {
		return a.rpcError(what+": events", err)
	}
	return writeClusterClass(out, r.GetClusterClass(), clusters, evs.GetEvents(), a.opts.Now())
}

func writeClusterClass(out io.Writer, cc *typesv1.ClusterClass, all []*controllerv1.Resource, events []*typesv1.Event, now time.Time) error {
	st := cc.GetStatus()
	w := tabwriter.NewWriter(out, 0, 8, 1, ' ', 0)
	fmt.Fprintf(w, "Name:\t%s\n", cc.GetMetadata().GetName())
	fmt.Fprintf(w, "Kind:\tClusterClass\n")
	if ts := cc.GetMetadata().GetCreationTimestamp(); ts != nil {
		fmt.Fprintf(w, "Created:\t%s (%s ago)\n", ts.AsTime().UTC().Format(time.RFC3339), age(ts, now))
	}
	var kept []string
	for _, rv := range st.GetRevisions() {
		kept = append(kept, fmt.Sprint(rv.GetRevision()))
	}
	if st.GetRevision() == 0 {
		fmt.Fprintf(w, "Revision:\t- (not recorded by the controller yet)\n")
	} else {
		fmt.Fprintf(w, "Revision:\t%d (kept for clusters: %s)\n", st.GetRevision(), strings.Join(kept, ", "))
		if st.GetRevision() > 1 {
			fmt.Fprintf(w, "Rollout:\t%s\n", topologyplan.RolloutName(cc.GetMetadata().GetName(), st.GetRevision()))
		}
	}
	var workers []string
	for _, wk := range cc.GetSpec().GetWorkers() {
		workers = append(workers, wk.GetName())
	}
	fmt.Fprintf(w, "Worker classes:\t%s\n", dash(strings.Join(workers, ", ")))
	if err := w.Flush(); err != nil {
		return err
	}

	fmt.Fprintln(out, "Variables:")
	if len(cc.GetSpec().GetVariables()) == 0 {
		fmt.Fprintln(out, "  <none>")
	} else {
		w = tabwriter.NewWriter(out, 0, 8, 2, ' ', 0)
		fmt.Fprintln(w, "  NAME\tTYPE\tDEFAULT\tALLOWED\tDESCRIPTION")
		for _, v := range cc.GetSpec().GetVariables() {
			def := v.GetDefault()
			if def == "" && v.GetRequired() {
				def = "(required)"
			}
			fmt.Fprintf(w, "  %s\t%s\t%s\t%s\t%s\n", v.GetName(), v.GetType(), dash(def), dash(allowed(v)), dash(clean(v.GetDescription())))
		}
		if err := w.Flush(); err != nil {
			return err
		}
	}

	var mine []*typesv1.Cluster
	for _, r := range all {
		if c := r.GetCluster(); c.GetSpec().GetTopology().GetClass() == cc.GetMetadata().GetName() {
			mine = append(mine, c)
		}
	}
	sort.Slice(mine, func(i, j int) bool { return mine[i].GetMetadata().GetName() < mine[j].GetMetadata().GetName() })
	upToDate := 0
	for _, c := range mine {
		if topologyplan.UpToDate(cc, c) {
			upToDate++
		}
	}
	fmt.Fprintf(out, "Clusters: %d (%d up to date)\n", len(mine), upToDate)
	if len(mine) > 0 {
		w = tabwriter.NewWriter(out, 0, 8, 2, ' ', 0)
		fmt.Fprintln(w, "  CLUSTER\tREVISION\tVERSION\tUP-TO-DATE\tWAVE\tTOPOLOGY")
		for _, c := range mine {
			t := c.GetStatus().GetTopology()
			rev := "-"
			if t.GetClassRevision() > 0 {
				rev = fmt.Sprint(t.GetClassRevision())
			}
			up := "yes"
			switch {
			case topologyplan.UpToDate(cc, c):
			case t.GetClassRevision() != st.GetRevision():
				up = fmt.Sprintf("no: follows %s of %d", rev, st.GetRevision())
			default:
				up = "no: reconciling"
			}
			topo := "-"
			if cd := conditions.Get(c.GetStatus().GetConditions(), topologyplan.ConditionTopologyReconciled); cd != nil {
				topo = cd.GetStatus() + " " + cd.GetReason()
				if cd.GetStatus() != "True" {
					topo += ": " + clean(cd.GetMessage())
				}
			}
			fmt.Fprintf(w, "  %s\t%s\t%s\t%s\t%s\t%s\n", c.GetMetadata().GetName(), rev, dash(c.GetSpec().GetTopology().GetVersion()), up,
				dash(c.GetMetadata().GetLabels()["upgrade-wave"]), topo)
		}
		if err := w.Flush(); err != nil {
			return err
		}
	}

	fmt.Fprintln(out, "Conditions:")
	if len(st.GetConditions()) == 0 {
		fmt.Fprintln(out, "  <none>")
	} else {
		w = tabwriter.NewWriter(out, 0, 8, 2, ' ', 0)
		fmt.Fprintln(w, "  TYPE\tSTATUS\tREASON\tMESSAGE\tAGE")
		for _, c := range st.GetConditions() {
			fmt.Fprintf(w, "  %s\t%s\t%s\t%s\t%s\n", c.GetType(), c.GetStatus(), dash(c.GetReason()), dash(clean(c.GetMessage())), age(c.GetLastTransitionTime(), now))
		}
		if err := w.Flush(); err != nil {
			return err
		}
	}
	return writeEvents(out, events, now)
}

// allowed says which values a variable takes: its enum, or its bounds.
func allowed(v *typesv1.ClusterClassVariable) string {
	if len(v.GetEnum()) > 0 {
		return strings.Join(v.GetEnum(), "|")
	}
	unit := ""
	switch v.GetType() {
	case "cidr":
		unit = "/"
	case "string":
		unit = "len "
	}
	switch {
	case v.Minimum != nil && v.Maximum != nil:
		return fmt.Sprintf("%s%d..%s%d", unit, v.GetMinimum(), unit, v.GetMaximum())
	case v.Minimum != nil:
		return fmt.Sprintf(">= %s%d", unit, v.GetMinimum())
	case v.Maximum != nil:
		return fmt.Sprintf("<= %s%d", unit, v.GetMaximum())
	}
	return ""
}
