package cli

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/e2e/lab/domainbmc"
	"github.com/kilnhq/kiln/e2e/lab/libvirt"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// BMCPasswordEnv carries the password of `kilnctl lab bmc` when no
// --password-file is given.
const BMCPasswordEnv = "KILN_BMC_PASSWORD"

// labBMCCommand is `kilnctl lab bmc`: BMC emulators in front of existing
// libvirt domains (e2e/lab/domainbmc).
func labBMCCommand() *cobra.Command {
	o := domainbmc.Options{}
	var passwordFile string
	cmd := &cobra.Command{
		Use:   "bmc [flags] DOMAIN...",
		Short: "Serve a Redfish BMC (and optionally IPMI) in front of existing libvirt domains",
		Long: `Serve one Redfish emulator per libvirt domain (given by name or UUID),
and with --ipmi one ipmi_sim too, until interrupted. Power (On, ForceOff,
GracefulShutdown, ForceRestart, ...), the one-time boot override (Pxe, Cd,
Hdd) and virtual media (InsertMedia of an http(s) URL, downloaded into
--dir, or a local path; EjectMedia) change the domain: its boot order, its
first CD drive's source, its power. The domains must be defined
(persistent); they stay defined, and as they are, when this stops.

The first domain's emulator listens on --listen, each further one on the
next port (port 0: free ports). The password of every BMC comes from
--password-file or $` + BMCPasswordEnv + `, never from the command line, and is
never printed or logged. See docs/lab.md, "BMCs for existing libvirt
domains".`,
		Example: `  virsh define rack1-h1.xml
  printf '%s' "$BMC_PASSWORD" > /run/kiln-bmc.pw
  kilnctl lab bmc --listen 127.0.0.1:8443 --password-file /run/kiln-bmc.pw rack1-h1 rack1-h2`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			pw, err := readBMCPassword(passwordFile)
			if err != nil {
				return err
			}
			o.Password, o.Domains = pw, args
			if o.IPMI {
				exe, err := os.Executable()
				if err != nil {
					return fmt.Errorf("lab bmc: %w", err)
				}
				o.ChassisCommand = []string{exe, "lab", "chassis"}
			}
			o.Logger = slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), nil))
			srv, err := domainbmc.Start(cmd.Context(), o)
			if err != nil {
				return err
			}
			defer srv.Close()
			printDomainBMCs(cmd.OutOrStdout(), srv.BMCs(), o.Username)
			<-cmd.Context().Done()
			return nil
		},
	}
	cmd.Flags().StringVar(&o.Listen, "listen", "127.0.0.1:0", "HOST:PORT of the first domain's Redfish emulator; further domains take the next ports (port 0: free ports)")
	cmd.Flags().StringVar(&o.Username, "user", "admin", "BMC user name")
	cmd.Flags().StringVar(&passwordFile, "password-file", "", "file holding the BMC password (default: $"+BMCPasswordEnv+")")
	cmd.Flags().BoolVar(&o.NoTLS, "no-tls", false, "serve Redfish over plain HTTP instead of HTTPS with a self-signed certificate")
	cmd.Flags().BoolVar(&o.IPMI, "ipmi", false, "also serve an ipmi_sim per domain on 127.0.0.1 (openipmi; passwords of at most 20 characters)")
	cmd.Flags().IntVar(&o.IPMIPort, "ipmi-port", 0, "UDP port of the first domain's ipmi_sim; further domains take the next ports (0: free ports)")
	cmd.Flags().StringVar(&o.Socket, "libvirt-socket", libvirt.DefaultSocket, "libvirtd's unix socket (qemu:///system)")
	cmd.Flags().StringVar(&o.Dir, "dir", "/var/lib/kiln/bmc", "directory for downloaded virtual media and ipmi_sim state (QEMU must be able to read it)")
	return cmd
}

// readBMCPassword reads the password from path, or from BMCPasswordEnv
// when path is "". A trailing newline is dropped.
func readBMCPassword(path string) (string, error) {
	var pw string
	if path != "" {
		b, err := os.ReadFile(path)
		if err != nil {
			return "", fmt.Errorf("lab bmc: password file: %w", err)
		}
		pw = strings.TrimRight(string(b), "\r\n")
	} else {
		pw = os.Getenv(BMCPasswordEnv)
	}
	if pw == "" {
		return "", errdefs.InvalidArgument("lab bmc: no BMC password: give --password-file FILE or set $%s", BMCPasswordEnv)
	}
	return pw, nil
}

func printDomainBMCs(w io.Writer, bmcs []domainbmc.BMC, user string) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "DOMAIN\tUUID\tMAC\tREDFISH\tIPMI\tUSER")
	for _, b := range bmcs {
		ipmi := b.IPMI
		if ipmi == "" {
			ipmi = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", b.Domain, b.UUID, strings.Join(b.MACs, ","), b.Redfish, ipmi, user)
	}
	_ = tw.Flush()
}
