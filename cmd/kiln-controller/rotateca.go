package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/controller/trust"
)

func rotateCACmd() *cobra.Command {
	var (
		c            common
		phase        string
		allowOffline bool
	)
	cmd := &cobra.Command{
		Use:   "rotate-ca --phase prepare|switch|retire|status",
		Short: "Replace the controller CA with a new one, without reimaging a host or losing an agent",
		Long: `Rotate the controller's certificate authority in three phases, each one
etcd transaction that running controllers follow within moments (run it
on any machine that reaches the controller's etcd and has its secret key):

  1. kiln-controller rotate-ca --phase prepare
     makes a new CA. Every controller and agent trusts it next to the old
     one (agents take it from their next heartbeat); nothing is signed by
     it yet.
  2. kiln-controller rotate-ca --phase switch
     the new CA signs agent and operator certificates from now on. Agents
     are asked to renew at their next heartbeat; operators get a new
     kilnconfig (kiln-controller operator-cert; the admin kilnconfig in the
     data directory is renewed by the controller). The controller still
     serves with a certificate of the old CA, so old kilnconfigs keep
     working.
  3. kiln-controller rotate-ca --phase retire
     removes the old CA once every agent's certificate is from the new one
     (refused, listing the hosts, while a live agent is not; offline
     agents need --allow-offline and must enroll again). The controller
     then serves with a certificate of the new CA, and certificates and
     kilnconfigs of the old CA are refused.

--phase status shows where the rotation is and which hosts still hold a
certificate of the old CA. Each phase run again after it is done changes
nothing; each applied phase is an audit entry (verb rotate-ca).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := c.logger(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			p, err := trust.ParsePhase(phase)
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			res, err := trust.Rotate(ctx, c.state(), trust.RotateRequest{Phase: p, AllowOffline: allowOffline}, log)
			if err != nil {
				return err
			}
			printCARotation(cmd.OutOrStdout(), res)
			return nil
		},
	}
	c.bind(cmd)
	cmd.Flags().StringVar(&phase, "phase", "", "prepare, switch, retire or status (required)")
	cmd.Flags().BoolVar(&allowOffline, "allow-offline", false, "retire even though hosts whose agent sends no heartbeats still hold a certificate of the old CA (they must enroll again)")
	_ = cmd.MarkFlagRequired("phase")
	return cmd
}

func printCARotation(out io.Writer, res trust.RotateResult) {
	if res.Resumed {
		fmt.Fprintf(out, "phase %s was already done; nothing changed\n", res.Phase)
	}
	switch res.State {
	case "prepared":
		fmt.Fprintf(out, "prepared: new CA %s (%s) trusted next to CA %s; the old CA still signs\nnext: kiln-controller rotate-ca --phase switch\n", res.New, res.NewHash, res.Old)
	case "switched":
		fmt.Fprintf(out, "switched: CA %s (%s) signs; CA %s is still trusted and serves until retired\n", res.New, res.NewHash, res.Old)
	default:
		if res.Phase == trust.Retire && !res.Resumed {
			fmt.Fprintf(out, "retired CA %s; CA %s (%s) signs and serves\n", res.Old, res.New, res.NewHash)
		} else {
			fmt.Fprintf(out, "no rotation under way: CA %s (%s)\n", res.New, res.NewHash)
		}
	}
	live, offline := res.Pending()
	fmt.Fprintf(out, "agents: %d enrolled, %d on the signing CA, %d live still on an older certificate, %d offline still on one\n",
		len(res.Hosts), len(res.Hosts)-len(live)-len(offline), len(live), len(offline))
	for _, h := range res.Hosts {
		if h.OnSigner {
			continue
		}
		state := "offline"
		if h.Live {
			state = "live"
		}
		issuer := h.Issuer
		if issuer == "" {
			issuer = "unrecorded"
		}
		fmt.Fprintf(out, "  %s (%s, certificate from CA %s)\n", h.Host, state, issuer)
	}
	if res.State == "switched" && len(live)+len(offline) == 0 {
		fmt.Fprintln(out, "next: kiln-controller rotate-ca --phase retire")
	}
}
