package main

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/imagebuilder/golden"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/imagebuilder/spec"
)

func newBuild() *cobra.Command {
	var (
		file, out, cache, agent string
		verbose                 bool
	)
	cmd := &cobra.Command{
		Use:   "build -f image.yaml -o DIR",
		Short: "Build a golden image from image.yaml",
		Long: `Builds the golden image an image spec describes (see
examples/images/image-spec.yaml and docs/imagebuilder.md): a Debian root from the
mirror (cached in <cache>/rootfs) with containerd, runc, the CNI plugins,
kubeadm/kubelet/kubectl of the spec's kubernetesVersion from the kube-tools
cache (` + kubetools.Pinned().Kubernetes + `, or ` + kubetools.Previous().Kubernetes + ` for upgrade tests: kube-tools --release previous), the control-plane
images for offline use, the kiln-agent and its unit, the baked host
preparation, a kernel and GRUB on the EFI system partition; laid out as a
GPT raw disk, compressed with zstd. Writes to DIR:

  <tag>.raw         the raw disk (sparse)
  <tag>.raw.zst     the same, zstd-compressed
  <tag>.json        the manifest: sha256 and sizes, block map, versions, packages
  <tag>.image.yaml  the Image resource: kilnctl apply -f <tag>.image.yaml

The tag is <os><ver>-k8s<ver>-<yyyymmdd>. The same spec and
SOURCE_DATE_EPOCH give the same bytes. A failed build writes nothing
under these names. Needs root, debootstrap, systemd-nspawn, fdisk,
dosfstools, mtools, e2fsprogs, grub-efi-amd64-bin and syslinux.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, err := spec.Load(file)
			if err != nil {
				return err
			}
			if agent != "" {
				abs, err := filepath.Abs(agent)
				if err != nil {
					return err
				}
				s.Agent = abs
			}
			level := slog.LevelInfo
			var tools io.Writer
			if verbose {
				level, tools = slog.LevelDebug, os.Stderr
			}
			res, err := golden.Build(cmd.Context(), golden.Options{
				Spec:           s,
				OutDir:         out,
				KubeTools:      kubetools.Cache{Dir: filepath.Join(cache, "kube-tools")},
				RootfsCacheDir: filepath.Join(cache, "rootfs"),
				Progress:       os.Stdout,
				ToolOutput:     tools,
				Log:            slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})),
			})
			if err != nil {
				return err
			}
			fmt.Printf("manifest %s\nimage    %s\napply    kilnctl apply -f %s\n", res.ManifestPath, res.ZstPath, res.ImagePath)
			return nil
		},
	}
	cmd.Flags().StringVarP(&file, "file", "f", "image.yaml", "image spec")
	cmd.Flags().StringVarP(&out, "output", "o", "", "output directory (required)")
	cmd.Flags().StringVar(&agent, "agent", "", "kiln-agent binary to install (overrides the spec's agent:)")
	cmd.Flags().StringVar(&cache, "cache", envOr("KILN_CACHE", "/var/cache/kiln"), "cache root: <cache>/rootfs and <cache>/kube-tools (env KILN_CACHE)")
	cmd.Flags().BoolVarP(&verbose, "verbose", "v", false, "show the output of debootstrap, apt-get and the disk tools")
	_ = cmd.MarkFlagRequired("output")
	_ = cmd.MarkFlagFilename("file", "yaml", "yml")
	return cmd
}
