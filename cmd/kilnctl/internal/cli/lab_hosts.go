package cli

import (
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/e2e/lab/rack"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/manifest"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Labels of the Host resources `kilnctl lab hosts` prints.
const (
	LabLabel     = "lab"          // "true"
	LabNameLabel = "kiln.dev/lab" // the lab's name
)

// QEMUGuestDisk is the device a QEMU lab host's disk file is inside its
// VM (e2e/lab/qemu: one virtio-blk disk).
const QEMUGuestDisk = "/dev/vda"

// labHostsCommand is `kilnctl lab hosts`: the lab's hosts as Host
// resources, for `kilnctl lab hosts | kilnctl apply -f -`.
func labHostsCommand(dirOf func() string) *cobra.Command {
	var output string
	cmd := &cobra.Command{
		Use:   "hosts",
		Short: "Print the lab's hosts as Host resources (for kilnctl apply -f -)",
		Long: `Print every host of the lab as a kiln.dev/v1 Host resource: name LAB-hI
(the name the boot server's /boot/ipxe/{host} and /boot/iso/{host}.iso
use), labels lab: "true" and kiln.dev/lab: LAB, the BMC (the Redfish
emulator's URL with insecureSkipVerify, or the ipmi_sim host:port) with
its user and password from the lab's credentials, bootMac, the disk file
as rootDiskHint (/dev/vda, the VM's disk, with --backend qemu or libvirt), and
online: true.

The output carries the BMC passwords: pipe it into kilnctl apply rather
than keeping it.`,
		Example: `  kilnctl lab hosts | kilnctl apply -f -
  kilnctl lab hosts -o name`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			switch output {
			case "yaml", "json", "name":
			default:
				return errdefs.InvalidArgument("output format %q: use yaml, json or name", output)
			}
			rep, err := rack.Status(dirOf())
			if err != nil {
				return err
			}
			return printLabHosts(cmd.OutOrStdout(), LabHostResources(rep), output)
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "yaml", "output format: yaml, json or name")
	return cmd
}

// LabHostResources returns a Host resource for every host of the lab rep
// describes, in the lab's order.
func LabHostResources(rep *rack.Report) []*controllerv1.Resource {
	var rs []*controllerv1.Resource
	for _, h := range rep.Hosts {
		name := h.Resource
		if name == "" { // a state file written before hosts had resource names
			name = rack.ResourceName(rep.Name, h.Name)
		}
		c := rep.Credentials[h.Name]
		spec := &typesv1.HostSpec{
			Bmc: &typesv1.BMCSpec{
				Protocol: h.BMC.Protocol, Address: h.BMC.Address,
				Username: c.Username, Password: c.Password,
				InsecureSkipVerify: h.BMC.Insecure,
			},
			BootMac:      h.MAC,
			RootDiskHint: h.Disk,
			Online:       true,
		}
		if rep.Backend == rack.BackendQEMU || rep.Backend == rack.BackendLibvirt {
			spec.BootMode = "legacy" // SeaBIOS
			// The agent runs inside the VM, where the disk file is its
			// one virtio disk: the file's path means nothing there.
			spec.RootDiskHint = QEMUGuestDisk
		}
		rs = append(rs, &controllerv1.Resource{Kind: &controllerv1.Resource_Host{Host: &typesv1.Host{
			ApiVersion: manifest.APIVersion, Kind: "Host",
			Metadata: &typesv1.ObjectMeta{Name: name, Labels: map[string]string{LabLabel: "true", LabNameLabel: rep.Name}},
			Spec:     spec,
		}}})
	}
	return rs
}

func printLabHosts(w io.Writer, rs []*controllerv1.Resource, output string) error {
	switch output {
	case "name":
		for _, r := range rs {
			fmt.Fprintf(w, "host/%s\n", r.GetHost().GetMetadata().GetName())
		}
		return nil
	case "json":
		var parts []string
		for _, r := range rs {
			b, err := manifest.MarshalJSON(r)
			if err != nil {
				return err
			}
			parts = append(parts, strings.TrimSpace(string(b)))
		}
		_, err := fmt.Fprintf(w, "[\n%s\n]\n", strings.Join(parts, ",\n"))
		return err
	}
	b, err := manifest.MarshalAll(rs)
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}
