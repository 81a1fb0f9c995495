package main

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/e2e/fleet"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
)

// newUpgrade is `kiln-lab upgrade` (make lab-upgrade): the lab cluster
// provisioned at the previous Kubernetes minor, then upgraded to the pinned
// one by reimaging, with the time of every phase.
func newUpgrade(f *flags) *cobra.Command {
	var (
		fromSpec, toSpec string
		hosts, ipmi      int
	)
	cmd := &cobra.Command{
		Use:   "upgrade",
		Short: "Provision the lab cluster at the previous minor (" + kubetools.Previous().Kubernetes + "), upgrade it to " + kubetools.Pinned().Kubernetes + " by reimaging, time each phase",
		Long: `Builds (or reuses) the boot media and two lab images, one per release
(--from-spec, --to-spec), starts the rack and the controller, provisions
--cluster with every version and image at ` + kubetools.Previous().Kubernetes + ` and waits until
it is Ready; then applies its ControlPlane at ` + kubetools.Pinned().Kubernetes + ` with the pinned image
and waits until the control plane runs it (a new member joins on the spare
host, the old one leaves); then its MachineDeployments, waiting until every
worker was reimaged; then checks with kubectl that every node is Ready with
kubelet ` + kubetools.Pinned().Kubernetes + ` and CoreDNS and kube-proxy are available. Prints
the time of each phase. The lab stays up: make lab-down removes it.

Needs both kube-tools caches: make kube-tools and
make kube-tools KUBE_RELEASE=` + kubetools.Previous().Kubernetes + ` (30-40 min cold each, once).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if os.Geteuid() != 0 {
				return errors.New("the lab needs root (network namespaces, nftables, systemd-nspawn): run make lab-upgrade as root")
			}
			bin, err := filepath.Abs(f.bin)
			if err != nil {
				return err
			}
			u := &fleet.MinorUpgrade{
				Lab: fleet.Config{Name: f.name, Dir: f.dir, Bin: bin, Subnet: f.subnet, Hosts: hosts, IPMI: ipmi,
					MediaDir: filepath.Join(f.dir, "media"), Out: os.Stdout},
				ClusterFile:  f.cluster,
				FromSpec:     fromSpec,
				ToSpec:       toSpec,
				PhaseTimeout: f.timeout,
				Out:          os.Stdout,
			}
			t0 := time.Now()
			lab, res, err := u.Run(cmd.Context())
			if res != nil {
				fmt.Println("\nupgrade phases:")
				for _, p := range res.Phases {
					fmt.Printf("  %-28s %s\n", p.Name, p.Took.Round(time.Second))
				}
				fmt.Printf("  %-28s %s\n", "total", time.Since(t0).Round(time.Second))
				for _, n := range sortedNames(res.Kubelets) {
					fmt.Printf("  node %-20s kubelet %s\n", n, res.Kubelets[n])
				}
			}
			if err != nil {
				if lab != nil {
					return fmt.Errorf("%w\n(the lab stays for inspection: KILNCONFIG=%s kilnctl get machines; make lab-down removes it)", err, lab.Kilnconfig())
				}
				return err
			}
			fmt.Printf("\ncluster upgraded from %s to %s by reimaging in %s.\n  KUBECONFIG=%s kubectl get nodes -o wide\n  make lab-down removes the lab\n",
				kubetools.Previous().Kubernetes, kubetools.Pinned().Kubernetes, time.Since(t0).Round(time.Second), res.Kubeconfig)
			return nil
		},
	}
	cmd.Flags().IntVar(&hosts, "hosts", 3, "hosts behind Redfish emulators")
	cmd.Flags().IntVar(&ipmi, "ipmi", 1, "hosts behind ipmi_sim (booted by PXE); one host must stay spare for the control plane's rollout")
	cmd.Flags().StringVar(&f.cluster, "cluster", "examples/lab-cluster.yaml", "cluster to provision and upgrade (its versions and images are replaced)")
	cmd.Flags().StringVar(&fromSpec, "from-spec", "examples/images/lab-previous.yaml", "lab image spec at the previous minor")
	cmd.Flags().StringVar(&toSpec, "to-spec", "examples/images/lab.yaml", "lab image spec at the pinned minor")
	cmd.Flags().DurationVar(&f.timeout, "timeout", 30*time.Minute, "give up on a phase (provision, control plane, workers) after this long")
	return cmd
}

func sortedNames(m map[string]string) []string {
	return slices.Sorted(maps.Keys(m))
}
