package cli

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/kilnhq/kiln/internal/manifest"
	opprogress "github.com/kilnhq/kiln/internal/progress"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func (a *app) describeCommand() *cobra.Command {
	var events int64
	cmd := &cobra.Command{
		Use:   "describe KIND NAME",
		Short: "Show a resource in detail: spec, status, conditions and recent events",
		Long: `Show a resource in detail: its spec, its status, a table of its
conditions (type, status, reason, message, age) and its recent events.
A host stuck in a phase says why here: every phase has a condition and its
last error. A host laying an image (or wiping) shows its progress: bytes
done of the total, rate and time left, as its agent last reported them. A cluster is shown as a tree: its control planes and machine
deployments, their machines, the hosts under them (BMC, power, last agent
operation) and its health checks, each with every condition and reason.
A cluster class shows its revision, the revisions it keeps, its variables
and worker classes, and its clusters: the revision each follows and
whether it is up to date.`,
		Example:           "  kilnctl describe host rack1-01\n  kilnctl describe cluster prod-eu1\n  kilnctl describe clusterclass edge-store",
		Args:              cobra.ExactArgs(2),
		ValidArgsFunction: a.completeKindName,
		RunE: func(cmd *cobra.Command, args []string) error {
			k, err := lookupKind(args[0])
			if err != nil {
				return err
			}
			c, err := a.client(cmd.Context())
			if err != nil {
				return err
			}
			if k.Name == "Cluster" {
				return a.describeCluster(cmd.Context(), cmd.OutOrStdout(), c, args[1], events)
			}
			if k.Name == "ClusterClass" {
				return a.describeClusterClass(cmd.Context(), cmd.OutOrStdout(), c, args[1], events)
			}
			what := fmt.Sprintf("describe %s/%s", k.lower(), args[1])
			ctx, cancel := a.call(cmd.Context())
			defer cancel()
			r, err := c.Get(ctx, &controllerv1.GetRequest{Kind: k.Name, Name: args[1]})
			if err != nil {
				return a.rpcError(what, err)
			}
			evs, err := c.ListEvents(ctx, &controllerv1.ListEventsRequest{ObjectKind: k.Name, ObjectName: args[1], Limit: events})
			if err != nil {
				return a.rpcError(what+": events", err)
			}
			return describeObject(cmd.OutOrStdout(), k, r, evs.GetEvents(), a.opts.Now())
		},
	}
	cmd.Flags().Int64Var(&events, "events", 20, "how many recent events to show")
	return cmd
}

// describeObject writes the description of r.
func describeObject(out io.Writer, k kind, r *controllerv1.Resource, events []*typesv1.Event, now time.Time) error {
	obj, err := manifest.Object(r)
	if err != nil {
		return err
	}
	md := metaOf(r)
	w := tabwriter.NewWriter(out, 0, 8, 1, ' ', 0)
	fmt.Fprintf(w, "Name:\t%s\n", md.GetName())
	fmt.Fprintf(w, "Kind:\t%s\n", k.Name)
	fmt.Fprintf(w, "Labels:\t%s\n", labels(md.GetLabels()))
	if len(md.GetAnnotations()) > 0 {
		fmt.Fprintf(w, "Annotations:\t%s\n", labels(md.GetAnnotations()))
	}
	if ts := md.GetCreationTimestamp(); ts != nil {
		fmt.Fprintf(w, "Created:\t%s (%s ago)\n", ts.AsTime().UTC().Format(time.RFC3339), age(ts, now))
	}
	if ts := md.GetDeletionTimestamp(); ts != nil {
		fmt.Fprintf(w, "Deleting:\tsince %s\n", ts.AsTime().UTC().Format(time.RFC3339))
	}
	if md.GetGeneration() != 0 {
		fmt.Fprintf(w, "Generation:\t%d\n", md.GetGeneration())
	}
	if err := w.Flush(); err != nil {
		return err
	}

	pm := obj.ProtoReflect()
	fields := pm.Descriptor().Fields()
	if err := section(out, "Spec", pm, fields.ByName("spec"), nil); err != nil {
		return err
	}
	omit := []protoreflect.Name{"conditions"}
	if r.GetRollout() != nil {
		omit = append(omit, "waves", "clusters") // the Waves and Clusters tables below
	}
	if err := section(out, "Status", pm, fields.ByName("status"), omit); err != nil {
		return err
	}
	if op := r.GetHost().GetStatus().GetLastOperation(); opprogress.Known(op.GetProgress()) {
		// The lay's progress bar in words, read from the stored report.
		fmt.Fprintln(out, "Progress:")
		fmt.Fprintf(out, "  %s %s (%s): %s\n", op.GetKind(), op.GetId(), dash(op.GetState()), opprogress.Line(op.GetProgress(), now))
	}

	if ro := r.GetRollout(); ro != nil {
		if err := describeWaves(out, ro, now); err != nil {
			return err
		}
	}

	fmt.Fprintln(out, "Conditions:")
	conds := conditionsOf(r)
	if len(conds) == 0 {
		fmt.Fprintln(out, "  <none>")
	} else {
		w = tabwriter.NewWriter(out, 0, 8, 2, ' ', 0)
		fmt.Fprintln(w, "  TYPE\tSTATUS\tREASON\tMESSAGE\tAGE")
		for _, c := range conds {
			fmt.Fprintf(w, "  %s\t%s\t%s\t%s\t%s\n", c.GetType(), c.GetStatus(), dash(c.GetReason()), dash(clean(c.GetMessage())), age(c.GetLastTransitionTime(), now))
		}
		if err := w.Flush(); err != nil {
			return err
		}
	}

	return writeEvents(out, events, now)
}

// writeEvents writes the Events table of describe, as kubectl does: when
// each event last happened (LAST SEEN), its type and reason, how many
// times it happened (COUNT: the controller aggregates an event like a
// recent one into it) and since when (FIRST SEEN, when more than once),
// and its message, which says how many events of the object the
// controller's rate limit dropped before it.
func writeEvents(out io.Writer, events []*typesv1.Event, now time.Time) error {
	fmt.Fprintln(out, "Events:")
	if len(events) == 0 {
		fmt.Fprintln(out, "  <none>")
		return nil
	}
	w := tabwriter.NewWriter(out, 0, 8, 2, ' ', 0)
	fmt.Fprintln(w, "  LAST SEEN\tTYPE\tREASON\tCOUNT\tFIRST SEEN\tMESSAGE")
	for _, e := range events {
		count, first := max(e.GetCount(), 1), "-"
		if count > 1 {
			first = age(e.GetTime(), now)
		}
		last := e.GetLastTime()
		if last == nil {
			last = e.GetTime() // stored before aggregation
		}
		msg := clean(e.GetMessage())
		if d := e.GetDropped(); d > 0 {
			msg += fmt.Sprintf(" (%d earlier events of this object dropped by the rate limit)", d)
		}
		fmt.Fprintf(w, "  %s\t%s\t%s\t%d\t%s\t%s\n", age(last, now), dash(e.GetType()), dash(e.GetReason()), count, first, msg)
	}
	return w.Flush()
}

// section writes "Title:" and the YAML of field fd of pm, indented, with
// the fields in omit left out.
func section(out io.Writer, title string, pm protoreflect.Message, fd protoreflect.FieldDescriptor, omit []protoreflect.Name) error {
	fmt.Fprintf(out, "%s:\n", title)
	if fd == nil || !pm.Has(fd) {
		fmt.Fprintln(out, "  <none>")
		return nil
	}
	m := proto.Clone(pm.Get(fd).Message().Interface())
	for _, n := range omit {
		if f := m.ProtoReflect().Descriptor().Fields().ByName(n); f != nil {
			m.ProtoReflect().Clear(f)
		}
	}
	b, err := manifest.MarshalMessage(m)
	if err != nil {
		return err
	}
	text := strings.TrimRight(string(b), "\n")
	if text == "{}" {
		fmt.Fprintln(out, "  <none>")
		return nil
	}
	for _, line := range strings.Split(text, "\n") {
		fmt.Fprintln(out, "  "+line)
	}
	return nil
}

func labels(m map[string]string) string {
	if len(m) == 0 {
		return "<none>"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + m[k]
	}
	return strings.Join(parts, ",")
}
