package cli

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/internal/atomicfile"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

func (a *app) kubeconfigCommand() *cobra.Command {
	var file string
	cmd := &cobra.Command{
		Use:   "kubeconfig CLUSTER [-o FILE]",
		Short: "Print or save the admin kubeconfig of a cluster",
		Long: `Print the admin kubeconfig of a cluster, the one kubeadm init wrote on its
first control plane. It grants cluster-admin: only an admin certificate may
fetch it, and the controller records who did as an event on the cluster
(kilnctl describe cluster CLUSTER).

With -o FILE it is written to FILE with mode 0600, atomically (a reader
sees the old file or the new one, never half of it); without -o it goes to
standard output.`,
		Example: `  kilnctl kubeconfig lab -o lab.kubeconfig
  KUBECONFIG=lab.kubeconfig kubectl get nodes`,
		Args: cobra.ExactArgs(1),
		ValidArgsFunction: func(cmd *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
			return a.completeKindName(cmd, append([]string{"cluster"}, args...), toComplete)
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			cluster := args[0]
			what := "kubeconfig " + cluster
			c, err := a.client(cmd.Context())
			if err != nil {
				return err
			}
			ctx, cancel := a.call(cmd.Context())
			defer cancel()
			resp, err := c.GetKubeconfig(ctx, &controllerv1.GetKubeconfigRequest{Cluster: cluster})
			if err != nil {
				if e := errgrpc.FromGRPC(err); errdefs.IsPermissionDenied(e) {
					return fmt.Errorf("%s: %w\nhint: %s", what, e, a.adminHint())
				}
				return a.rpcError(what, err)
			}
			if file == "" || file == "-" {
				_, err := cmd.OutOrStdout().Write(resp.GetKubeconfig())
				return err
			}
			if err := atomicfile.Write(file, resp.GetKubeconfig(), 0o600); err != nil {
				return fmt.Errorf("%s: %w", what, err)
			}
			fmt.Fprintf(cmd.ErrOrStderr(), "wrote the admin kubeconfig of cluster %s to %s (mode 0600)\n", cluster, file)
			return nil
		},
	}
	cmd.Flags().StringVarP(&file, "output", "o", "", "write the kubeconfig to this file (mode 0600) instead of standard output")
	return cmd
}

// adminHint says that the kubeconfig needs an admin certificate, and
// which certificate the kilnconfig holds.
func (a *app) adminHint() string {
	return a.certHint("a cluster's kubeconfig needs an admin certificate; ask an admin, or use DATA_DIR/kilnconfig-admin.yaml on the controller")
}
