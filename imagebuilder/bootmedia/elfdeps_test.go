package bootmedia_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/imagebuilder/bootmedia"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

// TestELFDeps resolves the libraries of the build machine's debugfs and
// compares them with what ldd (the dynamic loader itself) finds.
func TestELFDeps(t *testing.T) {
	if _, err := os.Stat(bootmedia.DefaultDebugfs); err != nil {
		testenv.Skip(t, "no debugfs (apt-get install e2fsprogs)")
	}
	if _, err := exec.LookPath("ldd"); err != nil {
		testenv.Skip(t, "no ldd")
	}
	deps, err := bootmedia.ELFDeps("/", bootmedia.DefaultDebugfs)
	require.NoError(t, err)
	var got []string
	paths := map[string]bool{}
	for _, d := range deps {
		got = append(got, filepath.Base(d.Path))
		paths[d.Path] = true
		st, err := os.Stat(d.Source)
		require.NoError(t, err)
		require.True(t, st.Mode().IsRegular(), "%s is not a file", d.Source)
	}
	out, err := exec.Command("ldd", bootmedia.DefaultDebugfs).Output()
	require.NoError(t, err)
	var want []string
	for _, m := range regexp.MustCompile(`(?m)^\s*(\S+\.so[.0-9]*)\s+=>|^\s*/\S*/(ld-linux\S*)\s`).FindAllStringSubmatch(string(out), -1) {
		want = append(want, m[1]+m[2])
	}
	sort.Strings(got)
	sort.Strings(want)
	require.Equal(t, want, got, "ldd %s:\n%s", bootmedia.DefaultDebugfs, out)
	require.True(t, paths["lib64/ld-linux-x86-64.so.2"], "interpreter not at its PT_INTERP path: %v", deps)
	require.True(t, paths["lib/x86_64-linux-gnu/libext2fs.so.2"], "libext2fs not found in lib/x86_64-linux-gnu: %v", deps)

	// A static binary needs nothing.
	if _, err := os.Stat(bootmedia.DefaultBusybox); err == nil {
		deps, err := bootmedia.ELFDeps("/", bootmedia.DefaultBusybox)
		require.NoError(t, err)
		require.Empty(t, deps)
	}

	// Under a root without the libraries: NotFound naming the library.
	_, err = bootmedia.ELFDeps(t.TempDir(), bootmedia.DefaultDebugfs)
	require.True(t, errdefs.IsNotFound(err), "err = %v", err)
	require.Regexp(t, `needs lib\S+\.so`, err.Error())
}
