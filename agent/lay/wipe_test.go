package lay

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

// signatures returns what blkid finds on path ("" for nothing).
// Equivalent to: `blkid -p -o export PATH`.
func signatures(t *testing.T, path string) string {
	t.Helper()
	out, err := exec.Command("blkid", "-p", "-o", "export", path).CombinedOutput()
	if ee, ok := err.(*exec.ExitError); ok && ee.ExitCode() == 2 {
		return "" // nothing found
	}
	require.NoError(t, err, "blkid: %s", out)
	return strings.TrimSpace(string(out))
}

func need(t *testing.T, tools ...string) {
	t.Helper()
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (Debian packages util-linux, fdisk, e2fsprogs)", tool)
		}
	}
}

func run(t *testing.T, stdin string, name string, args ...string) {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Stdin = strings.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s %v: %s", name, args, out)
}

func TestWipe(t *testing.T) {
	need(t, "blkid", "sfdisk", "mkfs.ext4")
	tests := []struct {
		name string
		make func(t *testing.T, path string)
		want string // what blkid sees before the wipe
	}{
		{"gpt", func(t *testing.T, p string) {
			run(t, "label: gpt\n,32M,L\n,,L\n", "sfdisk", "-q", p)
		}, "PTTYPE=gpt"},
		{"dos", func(t *testing.T, p string) {
			run(t, "label: dos\n,,L\n", "sfdisk", "-q", p)
		}, "PTTYPE=dos"},
		{"ext4", func(t *testing.T, p string) {
			run(t, "", "mkfs.ext4", "-q", "-F", p)
		}, "TYPE=ext4"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := tempTarget(t)
			f, err := os.Create(p)
			require.NoError(t, err)
			require.NoError(t, f.Truncate(96<<20))
			require.NoError(t, f.Close())
			tt.make(t, p)
			require.Contains(t, signatures(t, p), tt.want, "before the wipe")

			require.NoError(t, testLayer(t).Wipe(context.Background(), p, nil))
			if got := signatures(t, p); got != "" {
				t.Errorf("Wipe(%s): blkid still finds %q", tt.name, got)
			}
			b, err := os.ReadFile(p)
			require.NoError(t, err)
			require.Len(t, b, 96<<20, "Wipe keeps the size")
			if !bytes.Equal(b, make([]byte, len(b))) {
				t.Errorf("Wipe(%s): the discarded file target does not read as zeros", tt.name)
			}
			if a := allocated(t, p); a != 0 {
				t.Errorf("Wipe(%s): file target still allocates %d bytes after the discard", tt.name, a)
			}
		})
	}
}

func TestWipeMissingTarget(t *testing.T) {
	p := tempTarget(t)
	err := testLayer(t).Wipe(context.Background(), p, nil)
	if !errdefs.IsNotFound(err) {
		t.Errorf("Wipe(%q) = %v, want NotFound", p, err)
	}
	if _, err := os.Stat(p); err == nil {
		t.Errorf("Wipe(%q) created the target", p)
	}
}
