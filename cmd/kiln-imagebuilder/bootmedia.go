package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/imagebuilder/bootmedia"
)

func newBootMedia() *cobra.Command {
	var (
		spec  bootmedia.Spec
		cache string
	)
	cmd := &cobra.Command{
		Use:   "bootmedia -o DIR --agent PATH",
		Short: "Build the agent's boot media: kernel, initramfs and a hybrid BIOS+UEFI ISO",
		Long: `Downloads a stock Debian kernel (cached in <cache>/bootmedia, keyed by
package and version), builds an initramfs holding busybox, the kernel
modules for virtio/NVMe/SATA disks and common NICs, an init that takes a
DHCP lease and the static kiln-agent in boot mode, and a hybrid ISO for
virtual media. Writes vmlinuz, initrd.img, kiln-agent.iso and
bootmedia.json (sizes and sha256) to DIR.

The agent enrolls from the kernel command line: kiln.controller=HOST:PORT
kiln.token=TOKEN kiln.ca_hash=sha256:... kiln.host=NAME. --cmdline bakes
them into the ISO; the controller's boot server adds them per host.

The outputs are byte-reproducible: every date in the initramfs and on the
ISO is --source-date-epoch (default $SOURCE_DATE_EPOCH, else 0), so the
same kernel, agent, busybox, command line, epoch and tool versions give
the same bytes. bootmedia.json records the inputs' sha256 and the tools'
versions.

Needs: apt-get, dpkg-deb, busybox-static, grub-mkimage (grub-common,
grub-pc-bin, grub-efi-amd64-bin), xorriso, mtools.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			spec.CacheDir = filepath.Join(cache, "bootmedia")
			m, err := bootmedia.Build(cmd.Context(), spec, func(line string) { fmt.Fprintln(os.Stderr, line) })
			if err != nil {
				return err
			}
			for _, f := range m.Files {
				fmt.Printf("%-16s %10d sha256:%s\n", f.Name, f.Size, f.SHA256)
			}
			return nil
		},
	}
	cmd.Flags().StringVarP(&spec.OutDir, "output", "o", "", "output directory (required)")
	cmd.Flags().StringVar(&spec.AgentBinary, "agent", "", "static kiln-agent binary (required; CGO_ENABLED=0 go build ./cmd/kiln-agent)")
	cmd.Flags().StringVar(&spec.KernelPackage, "kernel-package", "", "Debian kernel package (default: the newest linux-image-6.1.*-amd64)")
	cmd.Flags().StringSliceVar(&spec.Modules, "modules", nil, "kernel modules to load at boot (default: virtio, NVMe, SATA, common NICs, ext4, vfat, iso9660)")
	cmd.Flags().StringVar(&spec.Cmdline, "cmdline", "", "extra kernel parameters of the ISO, e.g. kiln.controller=10.0.0.1:7443")
	cmd.Flags().StringVar(&spec.Busybox, "busybox", bootmedia.DefaultBusybox, "static busybox binary")
	cmd.Flags().StringVar(&spec.Debugfs, "debugfs", bootmedia.DefaultDebugfs, "e2fsprogs debugfs; goes into the initramfs with its shared libraries")
	cmd.Flags().BoolVar(&spec.NoISO, "no-iso", false, "build kernel and initramfs only (iPXE)")
	cmd.Flags().Int64Var(&spec.SourceDateEpoch, "source-date-epoch", 0, "date of every file in the initramfs and on the ISO, in seconds since 1970 (default $SOURCE_DATE_EPOCH, else 0)")
	cmd.Flags().StringVar(&cache, "cache", envOr("KILN_CACHE", "/var/cache/kiln"), "cache root; kernels go to <cache>/bootmedia (env KILN_CACHE)")
	_ = cmd.MarkFlagRequired("output")
	_ = cmd.MarkFlagRequired("agent")
	return cmd
}
