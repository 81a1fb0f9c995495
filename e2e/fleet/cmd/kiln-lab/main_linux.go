// Command kiln-lab is `make lab`: it builds (or reuses) the agent boot
// media and the lab's golden image, starts a lab rack and a controller on
// its bridge, registers the rack's hosts, applies a cluster and shows
// progress until the cluster is Ready and its DNS answers, then prints how
// to use it. `kiln-lab down` removes it all. See docs/lab.md.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/e2e/fleet"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := command().ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "kiln-lab:", err)
		os.Exit(1)
	}
}

type flags struct {
	name, dir, bin, subnet, cluster, clusterName, imageSpec, tagDate string
	backend, memory                                                  string
	hosts, ipmi, cpus                                                int
	redfishAuth                                                      []string
	timeout, stallTimeout                                            time.Duration
}

// vmDefaults are what make lab uses for qemu and libvirt hosts unless a
// flag says otherwise: one TCG VM with a control plane's resources, the
// golden image with a kernel, a single-node cluster, and the patience
// TCG needs (a boot from disk with its first-boot image import shows no
// progress for minutes).
func (f *flags) vmDefaults(changed func(flag string) bool) {
	if f.backend != "qemu" && f.backend != "libvirt" {
		return
	}
	set := func(name string, apply func()) {
		if !changed(name) {
			apply()
		}
	}
	set("hosts", func() { f.hosts = 1 })
	set("ipmi", func() { f.ipmi = 0 })
	set("memory", func() { f.memory = "2G" })
	set("cpus", func() { f.cpus = 2 })
	set("image-spec", func() { f.imageSpec = "examples/images/vm-lab.yaml" })
	set("cluster", func() { f.cluster = "examples/lab-vm/cluster.yaml" })
	set("stall-timeout", func() { f.stallTimeout = 20 * time.Minute })
	set("timeout", func() { f.timeout = 90 * time.Minute })
}

func (f *flags) lab(imageDir string) (*fleet.Lab, error) {
	bin, err := filepath.Abs(f.bin)
	if err != nil {
		return nil, err
	}
	cfg := fleet.Config{Name: f.name, Dir: f.dir, Bin: bin, Subnet: f.subnet, Hosts: f.hosts, IPMI: f.ipmi, RedfishAuth: f.redfishAuth,
		Backend: f.backend, Memory: f.memory, CPUs: f.cpus,
		MediaDir: filepath.Join(f.dir, "media"), ImageDir: imageDir, Out: os.Stdout}
	if f.backend == "qemu" || f.backend == "libvirt" {
		// A TCG boot into the agent takes minutes on a loaded machine.
		cfg.ControllerArgs = append(cfg.ControllerArgs, "--expected-boot-time", "10m")
	}
	return fleet.New(cfg)
}

func command() *cobra.Command {
	f := &flags{}
	root := &cobra.Command{
		Use:           "kiln-lab",
		Short:         "A lab rack provisioned into a real Kubernetes cluster (make lab)",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().StringVar(&f.name, "name", "kiln", "lab name (1-8 lowercase letters or digits)")
	root.PersistentFlags().StringVar(&f.dir, "dir", "/var/lib/kiln/lab-run/kiln", "where the lab keeps its controller, rack state, media, image and kubeconfig")
	root.PersistentFlags().StringVar(&f.bin, "bin", "bin", "directory of kiln-controller, kilnctl, kiln-agent and kiln-imagebuilder (make build)")
	root.PersistentFlags().StringVar(&f.subnet, "subnet", "10.251.250.0/24", "lab network (IPv4 /24); the controller listens on its .1")

	up := &cobra.Command{
		Use:   "up",
		Short: "Build or reuse boot media and the lab image, start rack and controller, provision the cluster",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if os.Geteuid() != 0 {
				return errors.New("the lab needs root (network namespaces, nftables, systemd-nspawn): run make lab as root")
			}
			f.vmDefaults(cmd.Flags().Changed)
			return up(cmd.Context(), f)
		},
	}
	up.Flags().StringVar(&f.backend, "backend", "netns", "machine backend of the hosts: netns, qemu or libvirt (VMs; their defaults: --hosts 1 --ipmi 0 --memory 2G --cpus 2 --image-spec examples/images/vm-lab.yaml --cluster examples/lab-vm/cluster.yaml --stall-timeout 20m --timeout 90m)")
	up.Flags().StringVar(&f.memory, "memory", "", "memory of each VM host (qemu, libvirt)")
	up.Flags().IntVar(&f.cpus, "cpus", 0, "vCPUs of each VM host (qemu, libvirt)")
	up.Flags().IntVar(&f.hosts, "hosts", 3, "hosts behind Redfish emulators")
	up.Flags().IntVar(&f.ipmi, "ipmi", 1, "hosts behind ipmi_sim (booted by PXE)")
	up.Flags().StringSliceVar(&f.redfishAuth, "redfish-auth", nil, "authentication of each Redfish emulator in host order: both (default), basic (no SessionService, basic auth only) or session; e.g. KILN_LAB_ARGS='--redfish-auth both,both,basic' make lab")
	up.Flags().StringVar(&f.cluster, "cluster", "examples/lab-cluster.yaml", "cluster to apply")
	up.Flags().StringVar(&f.imageSpec, "image-spec", "examples/images/lab.yaml", "golden image spec of the lab's nodes (built once, cached by its inputs)")
	up.Flags().StringVar(&f.tagDate, "tag-date", "", "yyyymmdd in the lab image's tag instead of the day its OS packages were fetched (the cluster names its image by labels, so any date works)")
	up.Flags().StringVar(&f.clusterName, "cluster-name", "lab", "name of the Cluster in --cluster, to wait for")
	up.Flags().DurationVar(&f.timeout, "timeout", 45*time.Minute, "give up when the cluster is not Ready by then")
	up.Flags().DurationVar(&f.stallTimeout, "stall-timeout", 5*time.Minute, "stop early when nothing has changed for this long, printing the blocked objects' conditions and kilnctl describe cluster (0: wait for --timeout)")

	down := &cobra.Command{
		Use:   "down",
		Short: "Stop the controller and remove the rack (the image and media caches stay)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			lab, err := f.lab("")
			if err != nil {
				return err
			}
			if err := lab.Down(cmd.Context()); err != nil {
				return err
			}
			for _, d := range []string{lab.DataDir(), filepath.Join(f.dir, "kubeconfig")} {
				if err := os.RemoveAll(d); err != nil {
					return err
				}
			}
			fmt.Println("lab: down; the boot media and lab image stay in", f.dir, "for the next make lab")
			return nil
		},
	}
	root.AddCommand(up, down)
	root.AddCommand(newUpgrade(f))
	return root
}
