package main

import (
	"time"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/bootservice"
)

// bootFlags are the flags of the boot server (controller/bootservice).
type bootFlags struct {
	listen, mediaDir, imageDir string
	tokenTTL                   time.Duration
	tokenLimit                 int
}

func (b *bootFlags) bind(cmd *cobra.Command) {
	cmd.Flags().StringVar(&b.listen, "boot-listen", "", "serve boot media, images, per-host iPXE scripts and ISOs over plain HTTP on this address (host:port; off when empty)")
	cmd.Flags().StringVar(&b.mediaDir, "boot-media-dir", "", "agent boot media served under /boot/files/ (kiln-imagebuilder bootmedia -o DIR); required with --boot-listen")
	cmd.Flags().StringVar(&b.imageDir, "image-dir", "", "golden images served under /images/")
	cmd.Flags().DurationVar(&b.tokenTTL, "boot-token-ttl", bootservice.DefaultTokenTTL, "validity of the one-time enrollment token minted for each boot request")
	cmd.Flags().IntVar(&b.tokenLimit, "boot-token-limit", bootservice.DefaultTokenLimit, "boot tokens one host may get per --boot-token-ttl (beyond: 503 until it refills; -1: no limit)")
}

func (b *bootFlags) apply(cfg *controller.Config) {
	cfg.BootListenAddr = b.listen
	cfg.BootMediaDir = b.mediaDir
	cfg.ImageDir = b.imageDir
	cfg.BootTokenTTL = b.tokenTTL
	cfg.BootTokenLimit = b.tokenLimit
}
