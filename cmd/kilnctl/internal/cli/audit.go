package cli

import (
	"bytes"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	"github.com/kilnhq/kiln/internal/manifest"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

func (a *app) auditCommand() *cobra.Command {
	var user, kindArg, since, output string
	var limit int64
	cmd := &cobra.Command{
		Use:   "audit [--user NAME] [--kind KIND] [--since 24h|TIME] [-o yaml]",
		Short: "Show the audit log: who changed what, when, and whether it worked",
		Long: `Show the controller's audit log, oldest first: every apply, delete, token
creation, kubeconfig fetch, enrollment and certificate renewal, and every
call refused for want of a role, with the caller's certificate name and
role, the object, its generation before and after, and the names of the
fields the call changed. Secret values are never recorded: a new BMC
password shows as spec.bmc.password in CHANGED.

Reading the audit log needs an admin certificate, or a role or identity
the controller grants it to (kiln-controller run --audit-readers).

--since takes a duration back from now (24h, 30m) or an RFC 3339 time.`,
		Example: `  kilnctl audit --since 24h
  kilnctl audit --user alice --kind host
  kilnctl audit -o yaml`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			switch output {
			case "", "yaml":
			default:
				return errdefs.InvalidArgument("audit: -o %q: use yaml, or no -o for a table", output)
			}
			req := &controllerv1.ListAuditRequest{User: user, Limit: limit}
			if kindArg != "" {
				// Resource kinds by any spelling; the kinds only the
				// audit log names (Token, Certificate, AuditLog) as
				// given, in any case.
				req.Kind = kindArg
				if k, err := lookupKind(kindArg); err == nil {
					req.Kind = k.Name
				}
			}
			if since != "" {
				t, err := parseSince(since, a.opts.Now())
				if err != nil {
					return err
				}
				req.Since = timestamppb.New(t)
			}
			c, err := a.client(cmd.Context())
			if err != nil {
				return err
			}
			ctx, cancel := a.call(cmd.Context())
			defer cancel()
			resp, err := c.ListAudit(ctx, req)
			if err != nil {
				if e := errgrpc.FromGRPC(err); errdefs.IsPermissionDenied(e) {
					return fmt.Errorf("audit: %w\nhint: %s", e, a.certHint("the audit log needs an admin certificate or an audit-log grant (kiln-controller run --audit-readers ROLE or ROLE:NAME)"))
				}
				return a.rpcError("audit", err)
			}
			if output == "yaml" {
				return writeAuditYAML(cmd.OutOrStdout(), resp.GetEntries())
			}
			if len(resp.GetEntries()) == 0 {
				fmt.Fprintln(cmd.ErrOrStderr(), "No audit entries found.")
				return nil
			}
			return writeAuditTable(cmd.OutOrStdout(), resp.GetEntries())
		},
	}
	cmd.Flags().StringVar(&user, "user", "", "only entries of this caller (certificate name)")
	cmd.Flags().StringVar(&kindArg, "kind", "", "only entries about objects of this kind (host, cluster, ..., token, certificate)")
	cmd.Flags().StringVar(&since, "since", "", "only entries since this long ago (24h) or this RFC 3339 time")
	cmd.Flags().Int64Var(&limit, "limit", 0, "show at most the newest N entries (default 1000)")
	cmd.Flags().StringVarP(&output, "output", "o", "", "output format: yaml")
	return cmd
}

// parseSince reads --since: a duration back from now, or an RFC 3339 time.
func parseSince(s string, now time.Time) (time.Time, error) {
	if d, err := time.ParseDuration(s); err == nil {
		if d < 0 {
			return time.Time{}, errdefs.InvalidArgument("audit: --since %q: use a positive duration such as 24h", s)
		}
		return now.Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return time.Time{}, errdefs.InvalidArgument("audit: --since %q is neither a duration (24h, 30m) nor an RFC 3339 time (2026-12-01T00:00:00Z)", s)
	}
	return t, nil
}

// writeAuditTable writes entries as a table:
// TIME USER ROLE VERB OBJECT GENERATION RESULT CHANGED.
func writeAuditTable(out io.Writer, entries []*controllerv1.AuditEntry) error {
	w := tabwriter.NewWriter(out, 0, 0, 3, ' ', 0)
	fmt.Fprintln(w, "TIME\tUSER\tROLE\tVERB\tOBJECT\tGENERATION\tRESULT\tCHANGED")
	for _, e := range entries {
		user, role := dash(clean(e.GetUser())), dash(clean(e.GetRole()))
		obj := clean(strings.ToLower(e.GetKind()))
		if e.GetName() != "" {
			obj += "/" + clean(e.GetName())
		}
		gen := "-"
		if b, a := e.GetGenerationBefore(), e.GetGenerationAfter(); b != 0 || a != 0 {
			gen = genString(b) + "->" + genString(a)
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n",
			e.GetTime().AsTime().UTC().Format(time.RFC3339), user, role, clean(e.GetVerb()), dash(obj), gen,
			clean(e.GetResult()), dash(clean(strings.Join(e.GetChanged(), ","))))
	}
	return w.Flush()
}

// genString is a generation; 0 is an object that did not exist (before
// a creation, after a deletion).
func genString(g int64) string { return strconv.FormatInt(g, 10) }

// writeAuditYAML writes entries as a YAML stream.
func writeAuditYAML(out io.Writer, entries []*controllerv1.AuditEntry) error {
	var parts [][]byte
	for _, e := range entries {
		b, err := manifest.MarshalMessage(e)
		if err != nil {
			return err
		}
		parts = append(parts, b)
	}
	_, err := out.Write(bytes.Join(parts, []byte("---\n")))
	return err
}
