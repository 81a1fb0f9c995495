package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/manifest"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// parseSelector parses "k=v,k2=v2" (several -l flags add up).
func parseSelector(flags []string) (map[string]string, error) {
	sel := map[string]string{}
	for _, f := range flags {
		for _, part := range strings.Split(f, ",") {
			if part == "" {
				continue
			}
			k, v, ok := strings.Cut(part, "=")
			k = strings.TrimSpace(k)
			if !ok || k == "" || strings.ContainsAny(k, "!<>") {
				return nil, errdefs.InvalidArgument("label selector %q: use key=value[,key=value...]", f)
			}
			sel[k] = strings.TrimSpace(strings.TrimPrefix(v, "="))
		}
	}
	return sel, nil
}

func checkOutput(o string) error {
	switch o {
	case "", "wide", "yaml", "json", "name":
		return nil
	}
	return errdefs.InvalidArgument("output format %q: use wide, yaml, json or name", o)
}

func (a *app) getCommand() *cobra.Command {
	var output string
	var selector []string
	var watch bool
	var limit int64
	cmd := &cobra.Command{
		Use:   "get KIND [NAME]",
		Short: "List resources, or show one",
		Long: `List resources of a kind, or show one.

KIND is host, image, cluster, controlplane (cp), machinedeployment (md),
machine or healthcheck (hc), singular or plural. -o yaml prints what
kilnctl apply takes (plus status); BMC passwords are never shown.

"kilnctl get controllers" lists the controller replicas instead: which
leads and, with kiln-controller run --shards, the shards each holds and
how many hosts map to them (-o json for all fields).

"kilnctl get events" lists the newest events of the whole fleet (--limit,
default 50), oldest first; "kilnctl get events host/NAME" (or "host" for
every host) those of one object or kind. Each shows when it last
happened, how many times (COUNT) and the object it is about.`,
		Example: `  kilnctl get hosts -o wide
  kilnctl get hosts -w
  kilnctl get hosts -l rack=rack1
  kilnctl get cluster lab -o yaml
  kilnctl get controllers
  kilnctl get events
  kilnctl get events host/rack1-h3 --limit 20`,
		Args:              cobra.RangeArgs(1, 2),
		ValidArgsFunction: a.completeKindName,
		RunE: func(cmd *cobra.Command, args []string) error {
			if isControllersKind(args[0]) && len(args) == 1 && !watch {
				return a.getControllers(cmd.Context(), cmd.OutOrStdout(), output)
			}
			if isEventsKind(args[0]) && !watch {
				return a.getEvents(cmd.Context(), cmd.OutOrStdout(), args[1:], output, limit)
			}
			k, err := lookupKind(args[0])
			if err != nil {
				return err
			}
			if err := checkOutput(output); err != nil {
				return err
			}
			sel, err := parseSelector(selector)
			if err != nil {
				return err
			}
			if watch && output != "" && output != "wide" && output != "yaml" {
				return errdefs.InvalidArgument("output format %q: get -w prints wide or yaml", output)
			}
			c, err := a.client(cmd.Context())
			if err != nil {
				return err
			}
			var stream grpc.ServerStreamingClient[controllerv1.WatchEvent]
			if watch {
				// Watch first, list second: a change between the two
				// is printed twice rather than lost.
				name := ""
				if len(args) == 2 {
					name = args[1]
				}
				if stream, err = c.Watch(cmd.Context(), &controllerv1.WatchRequest{Kind: k.Name, Name: name}); err == nil {
					_, err = stream.Header()
				}
				if err != nil {
					return a.rpcError("watch "+k.Aliases[1], err)
				}
			}
			var items []*controllerv1.Resource
			if len(args) == 2 {
				ctx, cancel := a.call(cmd.Context())
				defer cancel()
				r, err := c.Get(ctx, &controllerv1.GetRequest{Kind: k.Name, Name: args[1]})
				if err != nil {
					return a.rpcError(fmt.Sprintf("get %s/%s", k.lower(), args[1]), err)
				}
				items = []*controllerv1.Resource{r}
			} else {
				cont := ""
				for {
					ctx, cancel := a.call(cmd.Context())
					resp, err := c.List(ctx, &controllerv1.ListRequest{Kind: k.Name, LabelSelector: sel, Limit: 500, Continue: cont})
					cancel()
					if err != nil {
						return a.rpcError("list "+strings.ToLower(k.Aliases[1]), err)
					}
					items = append(items, resp.GetItems()...)
					if cont = resp.GetContinue(); cont == "" {
						break
					}
				}
			}
			if !watch {
				return a.print(cmd.OutOrStdout(), cmd.ErrOrStderr(), k, items, output, len(args) == 2)
			}
			out := cmd.OutOrStdout()
			t := newTable(out, k, output == "wide", a.opts.Now)
			if output == "yaml" {
				if err := a.print(out, cmd.ErrOrStderr(), k, items, output, false); err != nil {
					return err
				}
			} else {
				for _, r := range items {
					t.row(nil, r)
				}
				if err := t.flush(); err != nil {
					return err
				}
			}
			return a.printWatch(cmd.Context(), out, t, k, stream, output == "yaml", false, sel)
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "", "output format: wide, yaml, json or name")
	cmd.Flags().BoolVarP(&watch, "watch", "w", false, "after listing, print each change as it happens until interrupted (a host's PROGRESS column follows its lay)")
	cmd.Flags().StringArrayVarP(&selector, "selector", "l", nil, "label selector key=value[,key=value]; repeatable")
	cmd.Flags().Int64Var(&limit, "limit", defaultEventLimit, "get events: how many of the newest events to show")
	return cmd
}

// printWatch prints the events of stream whose objects match sel until
// the stream or ctx ends: a table row per event on t (with the event type
// first when eventCol, as kilnctl watch; without it, as kubectl get -w),
// or with yaml a YAML document per event under a "# TYPE" line.
func (a *app) printWatch(ctx context.Context, out io.Writer, t *table, k kind, stream grpc.ServerStreamingClient[controllerv1.WatchEvent], yaml, eventCol bool, sel map[string]string) error {
	for {
		ev, err := stream.Recv()
		if errors.Is(err, io.EOF) || ctx.Err() != nil {
			return nil
		}
		if err != nil {
			return a.rpcError("watch "+k.Aliases[1], err)
		}
		if !selected(sel, metaOf(ev.GetResource()).GetLabels()) {
			continue
		}
		if yaml {
			b, err := manifest.Marshal(ev.GetResource())
			if err != nil {
				return err
			}
			fmt.Fprintf(out, "# %s\n%s---\n", ev.GetType(), b)
			continue
		}
		var prefix []string
		if eventCol {
			prefix = []string{ev.GetType()}
		}
		t.row(prefix, ev.GetResource())
		if err := t.flush(); err != nil {
			return err
		}
	}
}

// selected reports whether labels match every key=value of sel.
func selected(sel, labels map[string]string) bool {
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// print writes items in the output format.
func (a *app) print(out, errOut io.Writer, k kind, items []*controllerv1.Resource, output string, single bool) error {
	switch output {
	case "yaml":
		b, err := manifest.MarshalAll(items)
		if err != nil {
			return err
		}
		_, err = out.Write(b)
		return err
	case "json":
		if single && len(items) == 1 {
			b, err := manifest.MarshalJSON(items[0])
			if err != nil {
				return err
			}
			_, err = out.Write(b)
			return err
		}
		// A list: {"items": [...]} in the style of kubectl.
		fmt.Fprint(out, "{\n  \"items\": [")
		for i, r := range items {
			b, err := manifest.MarshalJSON(r)
			if err != nil {
				return err
			}
			if i > 0 {
				fmt.Fprint(out, ",")
			}
			fmt.Fprint(out, "\n    "+strings.ReplaceAll(strings.TrimRight(string(b), "\n"), "\n", "\n    "))
		}
		if len(items) > 0 {
			fmt.Fprint(out, "\n  ")
		}
		fmt.Fprint(out, "]\n}\n")
		return nil
	case "name":
		for _, r := range items {
			fmt.Fprintf(out, "%s/%s\n", k.lower(), metaOf(r).GetName())
		}
		return nil
	}
	if len(items) == 0 {
		fmt.Fprintf(errOut, "No %s found.\n", k.Aliases[1])
		return nil
	}
	t := newTable(out, k, output == "wide", a.opts.Now)
	for _, r := range items {
		t.row(nil, r)
	}
	return t.flush()
}

func (a *app) deleteCommand() *cobra.Command {
	return &cobra.Command{
		Use:               "delete KIND NAME [NAME...]",
		Short:             "Delete resources",
		Long:              "Delete resources. A Host that carries a Machine is deprovisioned and wiped by the controller before it goes.",
		Example:           "  kilnctl delete host rack1-01",
		Args:              cobra.MinimumNArgs(2),
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
			var errs []error
			for _, name := range args[1:] {
				ctx, cancel := a.call(cmd.Context())
				_, err := c.Delete(ctx, &controllerv1.DeleteRequest{Kind: k.Name, Name: name})
				cancel()
				if err != nil {
					errs = append(errs, a.rpcError(fmt.Sprintf("delete %s/%s", k.lower(), name), err))
					continue
				}
				fmt.Fprintf(cmd.OutOrStdout(), "%s/%s deleted\n", k.lower(), name)
			}
			return errors.Join(errs...)
		},
	}
}

func (a *app) watchCommand() *cobra.Command {
	var output string
	cmd := &cobra.Command{
		Use:   "watch KIND [NAME]",
		Short: "Print resources as they change, until interrupted",
		Long: `Print resources of a kind (or one of them) as they change, until
interrupted. Each line starts with ADDED, MODIFIED or DELETED.`,
		Example:           "  kilnctl watch hosts",
		Args:              cobra.RangeArgs(1, 2),
		ValidArgsFunction: a.completeKindName,
		RunE: func(cmd *cobra.Command, args []string) error {
			k, err := lookupKind(args[0])
			if err != nil {
				return err
			}
			if output != "" && output != "wide" && output != "yaml" {
				return errdefs.InvalidArgument("output format %q: watch prints wide or yaml", output)
			}
			name := ""
			if len(args) == 2 {
				name = args[1]
			}
			c, err := a.client(cmd.Context())
			if err != nil {
				return err
			}
			stream, err := c.Watch(cmd.Context(), &controllerv1.WatchRequest{Kind: k.Name, Name: name})
			if err != nil {
				return a.rpcError("watch "+k.Aliases[1], err)
			}
			out := cmd.OutOrStdout()
			return a.printWatch(cmd.Context(), out, newTable(out, k, output == "wide", a.opts.Now), k, stream, output == "yaml", true, nil)
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "", "output format: wide or yaml")
	return cmd
}
