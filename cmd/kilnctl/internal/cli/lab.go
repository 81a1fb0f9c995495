package cli

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/e2e/lab/ipmisim"
	"github.com/kilnhq/kiln/e2e/lab/netns"
	"github.com/kilnhq/kiln/e2e/lab/rack"
	"github.com/kilnhq/kiln/e2e/lab/redfish"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// LabCommand is `kilnctl lab`: a lab rack on this machine (e2e/lab/rack).
// Install it with Options.Lab.
func LabCommand() *cobra.Command {
	lab := &cobra.Command{
		Use:   "lab",
		Short: "Run a lab rack on this machine: network-namespace hosts behind emulated BMCs",
		Long: `Run a lab rack on this machine: network-namespace hosts (or QEMU VMs,
--backend qemu, or libvirt domains, --backend libvirt) behind emulated
BMCs (a Redfish emulator per host, or ipmi_sim), on a bridge of their own,
with an nftables guard that keeps lab traffic off the uplink. VM hosts get
their addresses from a dnsmasq bound to that bridge.

"lab up" starts a supervisor ("lab serve") in the background that runs the
BMC emulators and the hosts; "lab down" stops it and removes everything
the lab created, as recorded in STATE_DIR/state.json. "lab hosts" prints
the hosts as Host resources named LAB-hI, for "kilnctl apply -f -".
"lab bmc" serves the same BMC emulators in front of libvirt domains that
exist already. See docs/lab.md.`,
	}
	var name, stateDir string
	dirOf := func() string {
		if stateDir != "" {
			return stateDir
		}
		return rack.DefaultStateDir(name)
	}
	lab.PersistentFlags().StringVar(&name, "name", "kiln", "lab name (1-8 lowercase letters or digits)")
	lab.PersistentFlags().StringVar(&stateDir, "state-dir", "", "state directory of the lab (default /var/lib/kiln/lab/NAME)")

	o := rack.Options{}
	var diskSize, memory string
	up := &cobra.Command{
		Use:   "up",
		Short: "Create the lab and start its supervisor; print each host's BMC",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			exe, err := os.Executable()
			if err != nil {
				return fmt.Errorf("lab up: %w", err)
			}
			o.Name, o.StateDir = name, dirOf()
			if o.DiskSize, err = parseSize(diskSize); err != nil {
				return err
			}
			if memory != "" {
				b, err := parseSize(memory)
				if err != nil {
					return err
				}
				o.MemoryMB = int(b >> 20)
			}
			o.ServeCommand = []string{exe, "lab", "serve", "--name", name, "--state-dir", o.StateDir}
			o.ChassisCommand = []string{exe, "lab", "chassis"}
			rep, err := rack.Up(cmd.Context(), o)
			if err != nil {
				return err
			}
			return printLab(cmd.OutOrStdout(), rep)
		},
	}
	up.Flags().IntVar(&o.Hosts, "hosts", 3, "hosts behind Redfish emulators")
	up.Flags().IntVar(&o.IPMI, "ipmi", 0, "further hosts behind ipmi_sim BMCs")
	up.Flags().StringSliceVar(&o.RedfishAuth, "redfish-auth", nil, "authentication of each Redfish emulator in host order: both (default), basic (no SessionService, basic auth only, like several BMCs in the field) or session; e.g. --redfish-auth both,basic")
	up.Flags().StringVar(&o.Backend, "backend", "netns", "machine backend: netns|qemu|libvirt (qemu: QEMU VMs, libvirt: libvirt domains at the system libvirtd or a private one; both on the lab bridge with addresses from the lab's dnsmasq, at most 2 hosts without KVM; see docs/lab.md)")
	up.Flags().StringVar(&memory, "memory", "", "memory of each qemu or libvirt host (K, M, G suffixes; default 1G; a control plane wants 2G)")
	up.Flags().IntVar(&o.CPUs, "cpus", 0, "vCPUs of each qemu or libvirt host (default 1; a control plane wants 2)")
	up.Flags().StringVar(&o.Subnet, "subnet", "", "lab IPv4 /24 (default: a free 10.251.X.0/24)")
	up.Flags().StringVar(&o.AgentBinary, "agent", "", "boot media program: PXE and virtual-media boots run `AGENT run` (kiln-agent)")
	up.Flags().StringVar(&o.ControllerURL, "controller", "", "controller address for the boot agent (kiln.controller=); listen on the lab's gateway address")
	up.Flags().StringVar(&o.CAHash, "ca-hash", "", "controller CA pin for the boot agent (kiln.ca_hash=)")
	up.Flags().StringVar(&o.BootURL, "boot-url", "", "iPXE script URL template for PXE boots, e.g. http://{gateway}:8080/boot/ipxe/{host} ({host}: the Host resource name LAB-hI; {gateway}: the bridge address; qemu and libvirt hosts get it from the lab's dnsmasq); default: a static command line")
	up.Flags().BoolVar(&o.APIServerLB, "apiserver-lb", false, "run a TCP load balancer for Kubernetes API servers on GATEWAY:6443 over every host (a controlPlaneEndpoint that survives control-plane replacement)")
	up.Flags().StringVar(&diskSize, "disk-size", "8G", "size of each host's sparse disk (K, M, G suffixes)")

	status := &cobra.Command{
		Use:   "status",
		Short: "Print the lab's hosts, their BMC addresses and credentials",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			rep, err := rack.Status(dirOf())
			if err != nil {
				return err
			}
			return printLab(cmd.OutOrStdout(), rep)
		},
	}

	down := &cobra.Command{
		Use:   "down",
		Short: "Stop the lab and remove everything it created",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: slog.LevelWarn}))
			if err := rack.Down(cmd.Context(), dirOf(), log); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "lab in %s removed\n", dirOf())
			return nil
		},
	}

	serve := &cobra.Command{
		Use:    "serve",
		Short:  "Run the lab's supervisor (started by lab up)",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), nil))
			return rack.Serve(cmd.Context(), dirOf(), log)
		},
	}

	chassis := &cobra.Command{
		Use:                "chassis SOCKET get|set PARM [VAL]...",
		Short:              "ipmi_sim's chassis control program (run by the lab's IPMI BMCs)",
		Hidden:             true,
		DisableFlagParsing: true,
		RunE: func(cmd *cobra.Command, args []string) error {
			if code := ipmisim.RunChassis(args, cmd.OutOrStdout()); code != 0 {
				return errdefs.Unavailable("chassis request failed")
			}
			return nil
		},
	}
	lab.AddCommand(up, status, labHostsCommand(dirOf), down, serve, chassis, labBMCCommand())
	return lab
}

func printLab(w io.Writer, rep *rack.Report) error {
	state := rep.Phase
	if !rep.Running && rep.Phase == rack.PhaseReady {
		state = "supervisor not running (run kilnctl lab down)"
	}
	fmt.Fprintf(w, "lab %s: %s\n", rep.Name, state)
	if rep.Error != "" {
		fmt.Fprintf(w, "error: %s\n", rep.Error)
	}
	fmt.Fprintf(w, "bridge %s, subnet %s, gateway %s; uplink %s guarded by nft table %s\n", rep.Bridge, rep.Subnet, rep.Gateway, rep.Uplink, rep.NFTTable)
	if rep.DHCP != "" {
		pid, _, _ := strings.Cut(rep.DHCP, ":")
		state := "running"
		if !netns.ProcessAlive(rep.DHCP) {
			state = "not running"
		}
		fmt.Fprintf(w, "dhcp: dnsmasq (pid %s, %s) on %s; nothing is forwarded between %s and other interfaces\n", pid, state, rep.Bridge, rep.Bridge)
	}
	if rep.LibvirtSocket != "" {
		which := "system libvirtd"
		if rep.LibvirtPrivate {
			which = "private libvirtd (no system one answered)"
		}
		fmt.Fprintf(w, "libvirt: %s at %s\n", which, rep.LibvirtSocket)
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "HOST\tRESOURCE\tADDRESS\tMAC\tBMC\tADDRESS\tUSER\tPASSWORD")
	for _, h := range rep.Hosts {
		c := rep.Credentials[h.Name]
		res := h.Resource
		if res == "" {
			res = rack.ResourceName(rep.Name, h.Name)
		}
		bmcCol := h.BMC.Protocol
		if h.BMC.Auth != "" && h.BMC.Auth != redfish.AuthBoth {
			bmcCol += " (" + h.BMC.Auth + " auth only)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", h.Name, res, h.Address, h.MAC, bmcCol, h.BMC.Address, c.Username, c.Password)
	}
	return tw.Flush()
}

// parseSize reads 512, 64K, 100M, 8G (powers of 1024).
func parseSize(s string) (int64, error) {
	s = strings.TrimSpace(strings.ToUpper(strings.TrimSuffix(strings.ToUpper(s), "IB")))
	mult := int64(1)
	if s != "" {
		switch s[len(s)-1] {
		case 'K':
			mult = 1 << 10
		case 'M':
			mult = 1 << 20
		case 'G':
			mult = 1 << 30
		case 'T':
			mult = 1 << 40
		}
		if mult > 1 {
			s = s[:len(s)-1]
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n <= 0 {
		return 0, errdefs.InvalidArgument("size %q: want a number with an optional K, M, G or T suffix", s)
	}
	return n * mult, nil
}
