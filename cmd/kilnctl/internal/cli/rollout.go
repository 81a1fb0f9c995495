package cli

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// rolloutCommand is `kilnctl rollout pause|resume|abort NAME`: each sets
// a field of the Rollout's spec through apply (compare-and-swap on the
// resource version, again on a conflict), so the change is audited like
// any other.
func (a *app) rolloutCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "rollout",
		Short: "Pause, resume or abort a Rollout",
		Long: `Pause, resume or abort a Rollout (docs/clusters.md, "Upgrade waves").

pause stops starting clusters; the clusters already moving finish.
resume goes on after a pause, and lifts a halt (a cluster not done within
halt.readyTimeout, a remediation, a named condition) once its cause is
fixed: the clusters still moving get a fresh readyTimeout, and the halt
rules look only at what happens from then on.
abort stops the rollout for good; the clusters already moving finish.`,
	}
	verb := func(use, short string, change func(*typesv1.RolloutSpec) bool) *cobra.Command {
		return &cobra.Command{
			Use:               use + " NAME",
			Short:             short,
			Example:           "  kilnctl rollout " + use + " k8s-1-35",
			Args:              cobra.ExactArgs(1),
			ValidArgsFunction: a.completeNameOf("Rollout"),
			RunE: func(cmd *cobra.Command, args []string) error {
				return a.changeRollout(cmd, use, args[0], change)
			},
		}
	}
	cmd.AddCommand(
		verb("pause", "Stop starting clusters (moving ones finish)", func(s *typesv1.RolloutSpec) bool {
			if s.Paused {
				return false
			}
			s.Paused = true
			return true
		}),
		verb("resume", "Go on after a pause or a halt", func(s *typesv1.RolloutSpec) bool {
			s.Paused = false
			s.Resume++
			return true
		}),
		verb("abort", "Stop the rollout for good (moving clusters finish)", func(s *typesv1.RolloutSpec) bool {
			if s.Aborted {
				return false
			}
			s.Aborted = true
			return true
		}),
	)
	return cmd
}

// completeNameOf completes the names of one kind.
func (a *app) completeNameOf(kindName string) func(*cobra.Command, []string, string) ([]string, cobra.ShellCompDirective) {
	return func(cmd *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
		if len(args) > 0 {
			return nil, cobra.ShellCompDirectiveNoFileComp
		}
		return a.completeKindName(cmd, []string{kindName}, toComplete)
	}
}

func (a *app) changeRollout(cmd *cobra.Command, verb, name string, change func(*typesv1.RolloutSpec) bool) error {
	what := fmt.Sprintf("rollout %s %s", verb, name)
	c, err := a.client(cmd.Context())
	if err != nil {
		return err
	}
	for attempt := 0; ; attempt++ {
		ctx, cancel := a.call(cmd.Context())
		r, err := c.Get(ctx, &controllerv1.GetRequest{Kind: "Rollout", Name: name})
		if err != nil {
			cancel()
			return a.rpcError(what, err)
		}
		ro := r.GetRollout()
		if ro.Spec == nil {
			ro.Spec = &typesv1.RolloutSpec{}
		}
		if !change(ro.Spec) {
			cancel()
			fmt.Fprintf(cmd.OutOrStdout(), "rollout/%s unchanged (already %s)\n", name, pastTense(verb))
			return nil
		}
		_, err = c.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{r}})
		cancel()
		if err != nil && errdefs.IsConflict(errgrpc.FromGRPC(err)) && attempt < 5 {
			continue // the controller wrote the status in between
		}
		if err != nil {
			return a.rpcError(what, err)
		}
		fmt.Fprintf(cmd.OutOrStdout(), "rollout/%s %s\n", name, pastTense(verb))
		return nil
	}
}

func pastTense(verb string) string {
	switch verb {
	case "pause":
		return "paused"
	case "resume":
		return "resumed"
	}
	return verb + "ed"
}

// waveSummary is the WAVES column of kilnctl get rollouts: each wave's
// value and state, with the time left of a bake and how many clusters of
// a wave in progress are done ("1:Done 2:Baking(4m10s left) 3:Waiting").
func waveSummary(r *typesv1.Rollout, now time.Time) string {
	var parts []string
	for _, w := range r.GetStatus().GetWaves() {
		s := w.GetValue() + ":" + w.GetState()
		switch w.GetState() {
		case "Baking":
			s += "(" + bakeLeft(r, w, now) + " left)"
		case "InProgress", "Halted":
			s += fmt.Sprintf("(%d/%d)", len(w.GetDone()), len(w.GetClusters()))
		}
		parts = append(parts, s)
	}
	if len(parts) == 0 {
		return "-"
	}
	return strings.Join(parts, " ")
}

// bakeLeft is how long wave w of r still bakes at now.
func bakeLeft(r *typesv1.Rollout, w *typesv1.RolloutWave, now time.Time) string {
	bake, err := time.ParseDuration(r.GetSpec().GetBake())
	if err != nil || w.GetDoneTime() == nil {
		return "?"
	}
	left := w.GetDoneTime().AsTime().Add(bake).Sub(now)
	if left < 0 {
		left = 0
	}
	return left.Round(time.Second).String()
}

// describeWaves writes the waves of a Rollout as a table, for kilnctl
// describe rollout.
func describeWaves(out io.Writer, r *typesv1.Rollout, now time.Time) error {
	fmt.Fprintln(out, "Waves:")
	ws := r.GetStatus().GetWaves()
	if len(ws) == 0 {
		fmt.Fprintln(out, "  <none>")
		return nil
	}
	w := tabwriter.NewWriter(out, 0, 8, 2, ' ', 0)
	fmt.Fprintln(w, "  WAVE\tSTATE\tDONE\tMOVING\tWAITING\tMESSAGE")
	for _, wv := range ws {
		started := map[string]bool{}
		for _, c := range append(wv.GetDone(), wv.GetInProgress()...) {
			started[c] = true
		}
		var waiting []string
		for _, c := range wv.GetClusters() {
			if !started[c] {
				waiting = append(waiting, c)
			}
		}
		msg := wv.GetMessage()
		if wv.GetState() == "Baking" {
			msg = "baking: " + bakeLeft(r, wv, now) + " left of " + r.GetSpec().GetBake()
		}
		fmt.Fprintf(w, "  %s\t%s\t%s\t%s\t%s\t%s\n", wv.GetValue(), wv.GetState(), list(wv.GetDone()), list(wv.GetInProgress()), list(waiting), dash(clean(msg)))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(out, "Clusters:")
	cs := r.GetStatus().GetClusters()
	if len(cs) == 0 {
		fmt.Fprintln(out, "  <none started>")
		return nil
	}
	w = tabwriter.NewWriter(out, 0, 8, 2, ' ', 0)
	fmt.Fprintln(w, "  CLUSTER\tWAVE\tSTATE\tFROM\tSTARTED\tDONE\tMESSAGE")
	for _, c := range cs {
		done := "-"
		if c.GetDoneTime() != nil {
			done = age(c.GetDoneTime(), now) + " ago"
		}
		msg := c.GetMessage()
		if c.GetState() == "Done" {
			msg = ""
		}
		fmt.Fprintf(w, "  %s\t%s\t%s\t%s\t%s ago\t%s\t%s\n", c.GetName(), c.GetWave(), c.GetState(), dash(c.GetFrom()), age(c.GetStartTime(), now), done, dash(clean(msg)))
	}
	return w.Flush()
}

func list(s []string) string {
	if len(s) == 0 {
		return "-"
	}
	return strings.Join(s, ",")
}

// rolloutChange is the CHANGE column: what the Rollout carries.
func rolloutChange(c *typesv1.RolloutChange) string {
	switch {
	case c.GetKubernetesVersion() != "":
		return c.GetKubernetesVersion()
	case c.GetImage() != "":
		return "image " + c.GetImage()
	case len(c.GetImageSelector()) > 0:
		return "image " + labels(c.GetImageSelector())
	case c.GetClusterClass() != "":
		return fmt.Sprintf("%s r%d", c.GetClusterClass(), c.GetClassRevision())
	}
	return "-"
}
