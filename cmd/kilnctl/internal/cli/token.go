package cli

import (
	"fmt"
	"runtime"
	"time"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/version"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

func (a *app) tokenCommand() *cobra.Command {
	group := &cobra.Command{
		Use:   "token",
		Short: "Manage enrollment tokens",
	}
	var ttl time.Duration
	var host, description string
	var quiet bool
	create := &cobra.Command{
		Use:   "create [--ttl 1h] [--host NAME]",
		Short: "Create a one-time enrollment token and print the kiln-agent enroll command",
		Long: `Create a one-time enrollment token. A host presents it once, with the
controller's CA hash, to get its agent certificate:

  kiln-agent enroll --controller HOST:PORT --token TOKEN --ca-hash sha256:...

The token is shown once; the controller stores only its hash. --host binds
it to one host name, so it cannot enroll any other.`,
		Example: "  kilnctl token create --ttl 1h --host edge-01",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if ttl <= 0 {
				return errdefs.InvalidArgument("token create: --ttl %v: use a positive duration such as 30m or 2h", ttl)
			}
			c, err := a.client(cmd.Context())
			if err != nil {
				return err
			}
			ctx, cancel := a.call(cmd.Context())
			defer cancel()
			resp, err := c.CreateToken(ctx, &controllerv1.CreateTokenRequest{Ttl: ttl.String(), Host: host, Description: description})
			if err != nil {
				return a.rpcError("token create", err)
			}
			out := cmd.OutOrStdout()
			if quiet {
				fmt.Fprintln(out, resp.GetToken())
				return nil
			}
			bound := "any host"
			if host != "" {
				bound = "host " + host
			}
			fmt.Fprintf(out, "Token: %s\n", resp.GetToken())
			fmt.Fprintf(out, "Expires: %s (one use, %s; shown only now)\n", resp.GetExpires().AsTime().UTC().Format(time.RFC3339), bound)
			fmt.Fprintf(out, "CA hash: %s\n", resp.GetCaHash())
			fmt.Fprintln(out, "\nOn the host, run:")
			enroll := fmt.Sprintf("  kiln-agent enroll --controller %s --token %s --ca-hash %s", a.cfg.Server, resp.GetToken(), resp.GetCaHash())
			if host != "" {
				enroll += " --host " + host
			}
			fmt.Fprintln(out, enroll)
			return nil
		},
	}
	create.Flags().DurationVar(&ttl, "ttl", time.Hour, "how long the token stays valid")
	create.Flags().StringVar(&host, "host", "", "bind the token to this host name")
	create.Flags().StringVar(&description, "description", "", "a note stored with the token")
	create.Flags().BoolVarP(&quiet, "quiet", "q", false, "print only the token")
	group.AddCommand(create)
	return group
}

func versionCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the kilnctl version",
		Args:  cobra.NoArgs,
		Run: func(cmd *cobra.Command, _ []string) {
			fmt.Fprintf(cmd.OutOrStdout(), "kilnctl %s %s/%s %s\n", version.Version, runtime.GOOS, runtime.GOARCH, runtime.Version())
		},
	}
}

func completionCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "completion bash|zsh|fish",
		Short: "Print a shell completion script",
		Long: `Print a shell completion script.

  source <(kilnctl completion bash)
  kilnctl completion zsh > "${fpath[1]}/_kilnctl"
  kilnctl completion fish > ~/.config/fish/completions/kilnctl.fish`,
		Args:      cobra.ExactArgs(1),
		ValidArgs: []string{"bash", "zsh", "fish"},
		RunE: func(cmd *cobra.Command, args []string) error {
			root, out := cmd.Root(), cmd.OutOrStdout()
			switch args[0] {
			case "bash":
				return root.GenBashCompletionV2(out, true)
			case "zsh":
				return root.GenZshCompletion(out)
			case "fish":
				return root.GenFishCompletion(out, true)
			}
			return errdefs.InvalidArgument("completion: shell %q: use bash, zsh or fish", args[0])
		},
	}
}

// labStub stands in for `kilnctl lab` when this kilnctl is built without
// the lab.
func labStub() *cobra.Command {
	run := func(cmd *cobra.Command, _ []string) error {
		return errdefs.NotSupported("kilnctl lab: not built yet, see the lab issue (e2e/lab); meanwhile run make lab")
	}
	lab := &cobra.Command{
		Use:   "lab",
		Short: "Run a lab rack on this machine (not built into this kilnctl yet)",
		RunE:  run,
	}
	for _, sub := range []string{"up", "down", "status"} {
		lab.AddCommand(&cobra.Command{Use: sub, Short: "not built yet", Args: cobra.NoArgs, RunE: run})
	}
	return lab
}
