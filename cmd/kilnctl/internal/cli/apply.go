package cli

import (
	"errors"
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/manifest"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

func (a *app) applyCommand() *cobra.Command {
	var files []string
	var dryRun bool
	cmd := &cobra.Command{
		Use:   "apply -f FILE|DIR [-f ...]",
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
References to objects in the same apply count as existing.`,
		Example: `  kilnctl apply -f examples/
  kilnctl apply -f cluster.yaml --dry-run`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if len(files) == 0 {
				return errdefs.InvalidArgument("apply: pass -f FILE or -f DIR (or -f - for standard input)")
			}
			docs, err := validation.LoadManifests(a.opts.Stdin, files...)
			var merr *manifest.Error
			if errors.As(err, &merr) {
				return fmt.Errorf("nothing applied; fix these and apply again:\n%w", err)
			}
			if err != nil {
				return err
			}
			if len(docs) == 0 {
				return errdefs.InvalidArgument("apply: %s hold no resources", strings.Join(files, ", "))
			}
			req := &controllerv1.ApplyRequest{DryRun: dryRun}
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
	_ = cmd.MarkFlagFilename("filename", "yaml", "yml")
	return cmd
}
