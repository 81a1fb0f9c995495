// Command kiln-imagebuilder builds what Kiln lays on hosts: golden images,
// agent boot media, and the pinned Kubernetes tools with their offline image
// archives.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/internal/version"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newRoot().ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "kiln-imagebuilder:", err)
		os.Exit(1)
	}
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func newRoot() *cobra.Command {
	root := &cobra.Command{
		Use:           "kiln-imagebuilder",
		Short:         "Build Kiln's golden images, boot media and pinned Kubernetes tools",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newKubeTools(), newArchives(), newBuild(),
		newBootMedia(), newVersion())
	return root
}

// kubeToolsFlags are shared by kube-tools and archives.
type kubeToolsFlags struct {
	cache   string
	verbose bool
	release string
	version string
}

func (f *kubeToolsFlags) register(cmd *cobra.Command) {
	cmd.Flags().StringVar(&f.cache, "cache", envOr("KILN_CACHE", "/var/cache/kiln"),
		"cache root; the tools go to <cache>/kube-tools/<version> (env KILN_CACHE)")
	cmd.Flags().BoolVarP(&f.verbose, "verbose", "v", false, "log every command")
	cmd.Flags().StringVar(&f.release, "release", kubetools.ReleasePinned,
		"which release: pinned ("+kubetools.Pinned().Kubernetes+") or previous ("+kubetools.Previous().Kubernetes+", the minor before, for upgrade tests)")
	cmd.Flags().StringVar(&f.version, "version", "",
		"the Kubernetes version instead of --release; only versions with a recipe ("+kubetools.Pinned().Kubernetes+", "+kubetools.Previous().Kubernetes+")")
}

// selectRelease resolves --release and --version.
func (f *kubeToolsFlags) selectRelease(cmd *cobra.Command) (kubetools.Release, error) {
	if f.version != "" {
		if cmd.Flags().Changed("release") {
			return kubetools.Release{}, fmt.Errorf("--release and --version are exclusive")
		}
		return kubetools.SelectRelease(f.version)
	}
	switch f.release {
	case kubetools.ReleasePinned, kubetools.ReleasePrevious:
		return kubetools.SelectRelease(f.release)
	}
	return kubetools.Release{}, fmt.Errorf("--release %q: want %s or %s (or --version)", f.release, kubetools.ReleasePinned, kubetools.ReleasePrevious)
}

func (f *kubeToolsFlags) builder(cmd *cobra.Command) (*kubetools.Builder, error) {
	rel, err := f.selectRelease(cmd)
	if err != nil {
		return nil, err
	}
	level := slog.LevelInfo
	if f.verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})).With("component", "kube-tools")
	return &kubetools.Builder{
		Release:  rel,
		Cache:    kubetools.Cache{Dir: filepath.Join(f.cache, "kube-tools")},
		Log:      log,
		Progress: os.Stdout,
	}, nil
}

func newKubeTools() *cobra.Command {
	var (
		f        kubeToolsFlags
		mirror   string
		jobs     int
		archives bool
	)
	defJobs, _ := strconv.Atoi(os.Getenv("KILN_BUILD_JOBS"))
	cmd := &cobra.Command{
		Use:   "kube-tools",
		Short: "Build (or download) the pinned Kubernetes binaries and their image archives",
		Long: `Builds kubeadm, kubelet, kube-apiserver, kube-controller-manager,
kube-scheduler, kube-proxy, kubectl (Kubernetes ` + kubetools.Pinned().Kubernetes + `), etcd, CoreDNS and
pause from the Go module proxy into <cache>/kube-tools/<version>/bin, with a
manifest of their sha256, then writes the seven images kubeadm pulls as
docker-archive tarballs into <cache>/kube-tools/<version>/images.

--release previous (or --version ` + kubetools.Previous().Kubernetes + `) builds the minor before
instead, with the etcd/CoreDNS/pause tags its kubeadm expects, for upgrade
tests (make lab-upgrade); other versions are refused.

A cache that verifies is used as is. With --mirror (env KILN_KUBE_MIRROR) the
binaries are downloaded from a dl.k8s.io-style mirror and checked against its
.sha256 files instead of being built.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			b, err := f.builder(cmd)
			if err != nil {
				return err
			}
			b.Mirror = mirror
			b.Jobs = jobs
			t0 := time.Now()
			m, err := b.Ensure(cmd.Context())
			if err != nil {
				return err
			}
			for _, bin := range m.Binaries {
				fmt.Printf("%-24s %-8s sha256:%s\n", bin.Name, bin.Version, bin.SHA256)
			}
			if archives {
				if _, err := b.WriteArchives(cmd.Context()); err != nil {
					return err
				}
			}
			fmt.Printf("kube-tools %s ready in %s: %s\n", m.Kubernetes, time.Since(t0).Round(time.Second), b.Cache.VersionDir(b.Release))
			return nil
		},
	}
	f.register(cmd)
	cmd.Flags().StringVar(&mirror, "mirror", os.Getenv("KILN_KUBE_MIRROR"),
		"download from this dl.k8s.io-style base URL instead of building (env KILN_KUBE_MIRROR)")
	cmd.Flags().IntVar(&jobs, "jobs", defJobs, "build parallelism (go build -p and GOMAXPROCS); 0 is Go's default (env KILN_BUILD_JOBS)")
	cmd.Flags().BoolVar(&archives, "archives", true, "also write the image archives")
	return cmd
}

func newArchives() *cobra.Command {
	var f kubeToolsFlags
	cmd := &cobra.Command{
		Use:   "archives",
		Short: "Write the kubeadm images as docker-archive tarballs from the kube-tools cache",
		Long: `Writes registry.k8s.io/kube-apiserver, kube-controller-manager,
kube-scheduler, kube-proxy, etcd, coredns/coredns and pause at the pinned
versions into <cache>/kube-tools/<version>/images/<name>.tar. Import with:

  ctr -n k8s.io images import <cache>/kube-tools/<version>/images/kube-proxy.tar

The kube-proxy image carries iptables (nft) and conntrack from this machine:
install the Debian packages iptables and conntrack first.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			b, err := f.builder(cmd)
			if err != nil {
				return err
			}
			out, err := b.WriteArchives(cmd.Context())
			if err != nil {
				return err
			}
			for _, a := range out {
				fmt.Printf("%-48s %s %s\n", a.Ref, a.ID, a.Path)
			}
			return nil
		},
	}
	f.register(cmd)
	return cmd
}

func newVersion() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Args:  cobra.NoArgs,
		Run: func(*cobra.Command, []string) {
			fmt.Println("kiln-imagebuilder", version.Version, "kubernetes", kubetools.Pinned().Kubernetes)
		},
	}
}
