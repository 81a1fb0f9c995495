package cli

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/internal/errdefs"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

func (a *app) applyCommand() *cobra.Command {
	var files, selectors []string
	var dryRun, recursive, prune bool
	cmd := &cobra.Command{
		Use:   "apply -f FILE|DIR [-f ...] [-R] [--prune -l SELECTOR] [--dry-run]",
		Short: "Create or update resources from YAML files",
		Long: `Create or update resources from YAML files.

A directory applies all of its *.yaml and *.yml files in sorted order; "-"
reads standard input. Every document is parsed and validated before
anything is sent: when any document is bad, nothing is applied and every
problem is listed as FILE:LINE: FIELD: MESSAGE.

Prints one line per resource: "host/rack1-01 created", "configured" or
"unchanged". Then, on standard error, a "Warning: ..." line for each
reference to something that does not exist (an image, a cluster or a
host, or a host selector matching no host): the controller stores such
objects, but nothing happens to them until what they name exists.
References to objects in the same apply count as existing.

With --prune -l SELECTOR, apply also deletes the objects of the prunable
kinds (Image, Cluster, ControlPlane, MachineDeployment, HealthCheck,
ClusterClass, Rollout) that carry every label of SELECTOR and that the
files do not name ("cluster/edge-7 pruned"); objects a GitSource applied
are left to it. Applying and pruning are then one transaction: all of it
happens or none. --prune needs the right to delete, which the controller
checks before anything is applied, and refuses to run without -l (an
empty selector would delete everything the files do not name). With
--dry-run it lists what it would create, change and prune.`,
		Example: `  kilnctl apply -f examples/
  kilnctl apply -f cluster.yaml --dry-run
  kilnctl apply -R -f clusters/edge --prune -l env=edge --dry-run`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if len(files) == 0 {
				return errdefs.InvalidArgument("apply: pass -f FILE or -f DIR (or -f - for standard input)")
			}
			sel, err := parseSelector(selectors)
			if err != nil {
				return err
			}
			if err := checkPrune(prune, sel); err != nil {
				return err
			}
			docs, err := a.loadDocs(files, recursive)
			if err != nil {
				return err
			}
			req := &controllerv1.ApplyRequest{DryRun: dryRun}
			if prune {
				req.Prune = &controllerv1.ApplyPrune{Selector: sel}
			}
			for _, d := range docs {
				req.Resources = append(req.Resources, d.Resource)
			}
			c, err := a.client(cmd.Context())
			if err != nil {
				return err
			}
			ctx, cancel := a.call(cmd.Context())
			defer cancel()
			resp, err := c.Apply(ctx, req)
			if err != nil {
				return a.rpcError("apply", err)
			}
			suffix := ""
			if dryRun {
				suffix = " (dry run)"
			}
			for _, r := range resp.GetResults() {
				fmt.Fprintf(cmd.OutOrStdout(), "%s/%s %s%s\n", strings.ToLower(r.GetKind()), r.GetName(), r.GetAction(), suffix)
			}
			for _, r := range resp.GetResults() {
				for _, w := range r.GetWarnings() {
					fmt.Fprintf(cmd.ErrOrStderr(), "Warning: %s/%s: %s\n", strings.ToLower(r.GetKind()), r.GetName(), w)
				}
			}
			a.warnDangling(cmd.Context(), c, req.Resources, func(w string) {
				fmt.Fprintf(cmd.ErrOrStderr(), "Warning: %s\n", w)
			})
			return nil
		},
	}
	cmd.Flags().StringArrayVarP(&files, "filename", "f", nil, "file, directory or - (standard input) to apply; repeatable")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "validate on the controller and report what would change, storing nothing")
	cmd.Flags().BoolVarP(&recursive, "recursive", "R", false, "read directories recursively")
	cmd.Flags().BoolVar(&prune, "prune", false, "delete the objects matching -l that the files do not name, in the same transaction")
	cmd.Flags().StringArrayVarP(&selectors, "selector", "l", nil, "with --prune: key=value labels of the objects that may be pruned")
	_ = cmd.MarkFlagFilename("filename", "yaml", "yml")
	return cmd
}
