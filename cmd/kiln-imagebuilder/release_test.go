package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestKubeToolsRefusesUnknownRelease runs `kiln-imagebuilder kube-tools`
// and `archives` with releases they have no recipe for: each fails before
// touching the cache, with an error naming what is accepted.
func TestKubeToolsRefusesUnknownRelease(t *testing.T) {
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"kube-tools", "--version", "v1.32.0"}, "known releases are v1.34.4 (pinned) and v1.33.13 (previous)"},
		{[]string{"kube-tools", "--release", "latest"}, `--release "latest": want pinned or previous`},
		{[]string{"kube-tools", "--release", "previous", "--version", "v1.33.13"}, "exclusive"},
		{[]string{"archives", "--version", "1.35.0"}, "no recipe"},
	} {
		cache := filepath.Join(t.TempDir(), "cache")
		root := newRoot()
		root.SetArgs(append(tt.args, "--cache", cache))
		err := root.ExecuteContext(context.Background())
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("kiln-imagebuilder %s = %v, want an error containing %q", strings.Join(tt.args, " "), err, tt.want)
		}
		if _, serr := os.Stat(cache); !os.IsNotExist(serr) {
			t.Errorf("kiln-imagebuilder %s created %s", strings.Join(tt.args, " "), cache)
		}
	}
}
