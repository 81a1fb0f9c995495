package main

import (
	"fmt"
	"io"
	"log/slog"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/agent/preflight"
	"github.com/kilnhq/kiln/host/command"
	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// newPreflight runs the Preflight checks locally, as the controller would
// through the API, and prints the report.
func newPreflight(g *globals) *cobra.Command {
	c := &agentv1.ClusterConfig{}
	cmd := &cobra.Command{
		Use:   "preflight --kubernetes-version v1.34.4 [--pod-cidr CIDR] [--service-cidr CIDR] [--role control-plane|worker]",
		Short: "Check this host against a cluster without changing it",
		Long: "Check this host against a cluster without changing it: kubeadm's checks plus\n" +
			"br_netfilter, pod/service CIDR overlap with host addresses and routes, cgroup\n" +
			"driver agreement, runtime socket, ports, swap and pinned versions.\n" +
			"Exits non-zero when a check of severity ERROR fails.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := signalContext(cmd)
			defer cancel()
			log := slog.New(slog.DiscardHandler) // the report says it all
			if g.logLevel == "debug" {
				log = g.logger()
			}
			rep, err := preflight.New(g.root, command.Exec{}, log).Run(ctx, c)
			if err != nil {
				return err
			}
			printReport(cmd.OutOrStdout(), rep)
			if !rep.GetPassed() {
				return errdefs.FailedPrecondition("preflight failed")
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&c.KubernetesVersion, "kubernetes-version", "", "pinned Kubernetes version, e.g. v1.34.4")
	cmd.Flags().StringVar(&c.PodCidr, "pod-cidr", "10.244.0.0/16", "pod network CIDR")
	cmd.Flags().StringVar(&c.ServiceCidr, "service-cidr", "10.96.0.0/12", "service network CIDR")
	cmd.Flags().StringVar(&c.CgroupDriver, "cgroup-driver", "systemd", "kubelet cgroup driver: systemd or cgroupfs")
	cmd.Flags().StringVar(&c.Role, "role", "worker", "control-plane or worker")
	return cmd
}

// printReport writes one line per check: status, severity, name, message
// and, for failures, the fix.
func printReport(w io.Writer, rep *agentv1.PreflightReport) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "STATUS\tSEVERITY\tCHECK\tMESSAGE")
	for _, c := range rep.GetChecks() {
		st := "ok"
		if !c.GetPassed() {
			st = "FAIL"
		}
		sev := strings.ToLower(strings.TrimPrefix(c.GetSeverity().String(), "SEVERITY_"))
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", st, sev, c.GetName(), c.GetMessage())
		if !c.GetPassed() && c.GetFix() != "" {
			fmt.Fprintf(tw, "\t\t\tfix: %s\n", c.GetFix())
		}
	}
	tw.Flush()
	if rep.GetPassed() {
		fmt.Fprintln(w, "preflight passed")
	} else {
		fmt.Fprintln(w, "preflight FAILED")
	}
}
