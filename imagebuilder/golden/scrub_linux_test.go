package golden

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestScrubSlim(t *testing.T) {
	for _, slim := range []bool{false, true} {
		root := t.TempDir()
		for _, p := range []string{"usr/share/doc/systemd/copyright", "usr/share/doc/systemd/changelog.gz",
			"usr/share/man/man1/ls.1.gz", "usr/share/locale/de/LC_MESSAGES/x.mo", "var/lib/apt/lists/deb.debian.org_Packages",
			"var/log/dpkg.log", "usr/bin/kubelet"} {
			require.NoError(t, os.MkdirAll(filepath.Join(root, filepath.Dir(p)), 0o755))
			require.NoError(t, os.WriteFile(filepath.Join(root, p), []byte("x"), 0o644))
		}
		require.NoError(t, scrub(root, slim))
		for p, want := range map[string]bool{
			"usr/share/doc/systemd/copyright":           true,
			"usr/bin/kubelet":                           true,
			"var/log/dpkg.log":                          false,
			"usr/share/doc/systemd/changelog.gz":        !slim,
			"usr/share/man/man1/ls.1.gz":                !slim,
			"usr/share/locale/de/LC_MESSAGES/x.mo":      !slim,
			"var/lib/apt/lists/deb.debian.org_Packages": !slim,
		} {
			_, err := os.Stat(filepath.Join(root, p))
			if got := err == nil; got != want {
				t.Errorf("scrub(slim=%v): %s present = %v, want %v", slim, p, got, want)
			}
		}
	}
}
