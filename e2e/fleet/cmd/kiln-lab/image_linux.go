package main

import (
	"context"
	"os"
	"path/filepath"

	"github.com/kilnhq/kiln/e2e/fleet"
)

// labImage builds (or finds in the cache) the lab's golden image and
// returns its directory and Image resource file.
func labImage(ctx context.Context, f *flags) (dir, resource string, err error) {
	dir, m, err := fleet.LabImage(ctx, fleet.ImageOptions{Spec: f.imageSpec, Agent: filepath.Join(f.bin, "kiln-agent"), TagDate: f.tagDate, Progress: os.Stdout})
	if err != nil {
		return "", "", err
	}
	return dir, filepath.Join(dir, m.Tag+".image.yaml"), nil
}
