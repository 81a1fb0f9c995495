package cli

import (
	"errors"
	"fmt"
	"strings"

	udiff "github.com/aymanbagabas/go-udiff"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/manifest"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// ErrDiffers is the class of the error kilnctl diff returns when the
// files differ from the controller's objects; kilnctl exits 1 on it and
// prints no error line (the diff said it).
var ErrDiffers = errors.New("the files differ from the controller's objects")

// exitError gives an error its own exit status (ExitCode).
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// diffFailed marks an error of kilnctl diff, which exits 2 on errors (1
// means "differs", like diff(1) and kubectl diff).
func diffFailed(err error) error {
	if err == nil {
		return nil
	}
	return &exitError{code: 2, err: err}
}

func (a *app) diffCommand() *cobra.Command {
	var files, selectors []string
	var recursive, prune bool
	cmd := &cobra.Command{
		Use:   "diff -f FILE|DIR [-f ...] [-R] [--prune -l SELECTOR]",
		Short: "Show what apply would change",
		Long: `Show what kilnctl apply -f would change, as a unified diff of YAML per
object (like kubectl diff): the controller's object ("live/KIND/NAME")
against what apply would store ("file/KIND/NAME"). Only what apply sets
is compared: apiVersion, kind, metadata.name, labels and annotations, and
spec (status is the controller's). A created object is all "+", an object
--prune would delete all "-"; unchanged objects print nothing.

Whether an object changes is the controller's answer to a dry-run apply,
so validation and the rules of apply hold exactly as they would: a file
apply would refuse makes diff fail the same way. Nothing is stored. A
dry-run apply is an apply: diff needs the operator or admin role (and,
with --prune, the right to delete).

Exit status: 0 when applying would change nothing, 1 when it would, 2 on
an error (bad files, refused by the controller, unreachable).`,
		Example: `  kilnctl diff -f examples/fleet -R
  kilnctl diff -f clusters/ --prune -l env=edge`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if len(files) == 0 {
				return diffFailed(errdefs.InvalidArgument("diff: pass -f FILE or -f DIR (or -f - for standard input)"))
			}
			sel, err := parseSelector(selectors)
			if err != nil {
				return diffFailed(err)
			}
			if err := checkPrune(prune, sel); err != nil {
				return diffFailed(err)
			}
			docs, err := a.loadDocs(files, recursive)
			if err != nil {
				return diffFailed(err)
			}
			req := &controllerv1.ApplyRequest{DryRun: true}
			for _, d := range docs {
				req.Resources = append(req.Resources, d.Resource)
			}
			if prune {
				req.Prune = &controllerv1.ApplyPrune{Selector: sel}
			}
			c, err := a.client(cmd.Context())
			if err != nil {
				return diffFailed(err)
			}
			ctx, cancel := a.call(cmd.Context())
			defer cancel()
			resp, err := c.Apply(ctx, req)
			if err != nil {
				return diffFailed(a.rpcError("diff (dry-run apply)", err))
			}
			byName := map[string]*controllerv1.Resource{}
			for _, d := range docs {
				kind, name := validation.KindName(d.Resource)
				byName[kind+"/"+name] = d.Resource
			}
			counts := map[string]int{}
			out := cmd.OutOrStdout()
			for _, r := range resp.GetResults() {
				counts[r.GetAction()]++
				if r.GetAction() == "unchanged" {
					continue
				}
				id := strings.ToLower(r.GetKind()) + "/" + r.GetName()
				var before, after string
				if r.GetAction() != "created" {
					live, err := c.Get(ctx, &controllerv1.GetRequest{Kind: r.GetKind(), Name: r.GetName()})
					if err != nil {
						return diffFailed(a.rpcError("diff: get "+id, err))
					}
					if before, err = applied(live); err != nil {
						return diffFailed(err)
					}
				}
				if f := byName[r.GetKind()+"/"+r.GetName()]; f != nil && r.GetAction() != "pruned" {
					if after, err = applied(f); err != nil {
						return diffFailed(err)
					}
				}
				if before == after {
					fmt.Fprintf(out, "# %s %s: the change is not shown (a Host's BMC password is never shown)\n", id, r.GetAction())
					continue
				}
				fmt.Fprint(out, udiff.Unified("live/"+id, "file/"+id, before, after))
			}
			var summary []string
			for _, act := range []string{"created", "configured", "pruned", "unchanged"} {
				if counts[act] > 0 {
					summary = append(summary, fmt.Sprintf("%d %s", counts[act], map[string]string{
						"created": "to create", "configured": "to change", "pruned": "to prune", "unchanged": "unchanged"}[act]))
				}
			}
			fmt.Fprintf(cmd.ErrOrStderr(), "%s\n", strings.Join(summary, ", "))
			if counts["created"]+counts["configured"]+counts["pruned"] > 0 {
				return ErrDiffers
			}
			return nil
		},
	}
	cmd.Flags().StringArrayVarP(&files, "filename", "f", nil, "file, directory or - (standard input); repeatable")
	cmd.Flags().BoolVarP(&recursive, "recursive", "R", false, "read directories recursively")
	cmd.Flags().BoolVar(&prune, "prune", false, "also show what apply --prune would delete (needs -l)")
	cmd.Flags().StringArrayVarP(&selectors, "selector", "l", nil, "with --prune: key=value labels of the objects that may be pruned")
	_ = cmd.MarkFlagFilename("filename", "yaml", "yml")
	return cmd
}

// checkPrune refuses --prune without a selector and a selector without
// --prune.
func checkPrune(prune bool, sel map[string]string) error {
	switch {
	case prune && len(sel) == 0:
		return errdefs.InvalidArgument("--prune needs -l SELECTOR: without one, every Image, Cluster, ControlPlane, MachineDeployment, HealthCheck, ClusterClass and Rollout the files do not name would be deleted, including those others applied")
	case !prune && len(sel) > 0:
		return errdefs.InvalidArgument("-l selects what --prune deletes: pass --prune too")
	}
	return nil
}

// loadDocs reads and checks the files of apply and diff.
func (a *app) loadDocs(files []string, recursive bool) ([]*manifest.Document, error) {
	load := validation.LoadManifests
	if recursive {
		load = validation.LoadManifestsRecursive
	}
	docs, err := load(a.opts.Stdin, files...)
	var merr *manifest.Error
	if errors.As(err, &merr) {
		return nil, fmt.Errorf("nothing applied; fix these and apply again:\n%w", err)
	}
	if err != nil {
		return nil, err
	}
	if len(docs) == 0 {
		return nil, errdefs.InvalidArgument("%s hold no resources", strings.Join(files, ", "))
	}
	return docs, nil
}

// applied renders the part of an object that apply sets, as YAML:
// apiVersion, kind, metadata.name, labels and annotations, and spec; a
// Host's BMC password (write-only) is left out.
func applied(r *controllerv1.Resource) (string, error) {
	m, err := manifest.Object(r)
	if err != nil {
		return "", err
	}
	pm := m.ProtoReflect()
	fields := pm.Descriptor().Fields()
	if f := fields.ByName("status"); f != nil {
		pm.Clear(f)
	}
	if f := fields.ByName("metadata"); f != nil && pm.Has(f) {
		md := pm.Get(f).Message().Interface().(*typesv1.ObjectMeta)
		keep := &typesv1.ObjectMeta{Name: md.GetName(), Labels: md.GetLabels(), Annotations: md.GetAnnotations()}
		pm.Set(f, protoreflect.ValueOfMessage(keep.ProtoReflect()))
	}
	if h, ok := m.(*typesv1.Host); ok && h.GetSpec().GetBmc() != nil {
		h.Spec.Bmc = proto.Clone(h.Spec.Bmc).(*typesv1.BMCSpec)
		h.Spec.Bmc.Password, h.Spec.Bmc.PasswordSet = "", false
	}
	b, err := manifest.MarshalMessage(m)
	return string(b), err
}
