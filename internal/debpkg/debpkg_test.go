package debpkg

import (
	"crypto/sha256"
	"encoding/hex"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
	"github.com/kilnhq/kiln/internal/units"
)

func TestDebVersion(t *testing.T) {
	commit := time.Date(2026, 12, 6, 12, 34, 56, 0, time.UTC)
	tests := []struct {
		describe, want string
	}{
		{"v1.2.0", "1.2.0"},
		{"1.2.0", "1.2.0"},
		{"v1.2.0-5-gabc1234", "1.2.0+git5.abc1234"},
		{"v1.2.0-5-gabc1234-dirty", "1.2.0+git5.abc1234.dirty"},
		{"v1.2.0-dirty", "1.2.0+dirty"},
		{"d8cba6a", "0~git20261206123456.d8cba6a"},
		{"d8cba6a-dirty", "0~git20261206123456.d8cba6a+dirty"},
		{"9b0c7bf", "0~git20261206123456.9b0c7bf"}, // a hash that starts with a digit
		{"1234567", "0~git20261206123456.1234567"},
		{"v1.2.0-5-g9b0c7bf", "1.2.0+git5.9b0c7bf"},
	}
	for _, tt := range tests {
		got, err := DebVersion(tt.describe, commit)
		require.NoError(t, err, "DebVersion(%q)", tt.describe)
		if got != tt.want {
			t.Errorf("DebVersion(%q) = %q, want %q", tt.describe, got, tt.want)
		}
		if !validVersion.MatchString(got) {
			t.Errorf("DebVersion(%q) = %q, not a Debian version", tt.describe, got)
		}
	}
	for _, bad := range []string{"", "dev", "vX", "v1.2.0; rm -rf /", "release-1"} {
		if _, err := DebVersion(bad, commit); !errdefs.IsInvalidArgument(err) {
			t.Errorf("DebVersion(%q) error = %v, want InvalidArgument", bad, err)
		}
	}
}

// fakeBinaries writes stand-in binaries into a new directory, with an
// mtime of now: Build must not let it into the packages.
func fakeBinaries(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for _, n := range Names {
		require.NoError(t, os.WriteFile(filepath.Join(dir, n), []byte("#!/bin/sh\necho "+n+"\n"), 0o755))
	}
	return dir
}

func sha(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	h := sha256.New()
	_, err = io.Copy(h, f)
	require.NoError(t, err)
	return hex.EncodeToString(h.Sum(nil))
}

// TestBuildReproducible builds the packages twice, from binaries copied
// at different times into different directories, and compares their
// sha256: the same inputs and SOURCE_DATE_EPOCH give identical files.
func TestBuildReproducible(t *testing.T) {
	mtime := time.Unix(1_796_557_585, 0)
	first, err := Build(Options{BinDir: fakeBinaries(t), OutDir: t.TempDir(), Version: "1.2.0+git5.abc1234", MTime: mtime})
	require.NoError(t, err)
	require.Len(t, first, len(Names))
	bin := fakeBinaries(t) // other copies, with other mtimes
	for _, n := range Names {
		require.NoError(t, os.Chtimes(filepath.Join(bin, n), time.Unix(1, 0), time.Unix(1, 0)))
	}
	second, err := Build(Options{BinDir: bin, OutDir: t.TempDir(), Version: "1.2.0+git5.abc1234", MTime: mtime})
	require.NoError(t, err)
	for i := range first {
		if filepath.Base(first[i]) != filepath.Base(second[i]) {
			t.Errorf("Build() names %s, then %s", filepath.Base(first[i]), filepath.Base(second[i]))
		}
		a, b := sha(t, first[i]), sha(t, second[i])
		t.Logf("%s sha256 %s / %s", filepath.Base(first[i]), a, b)
		if a != b {
			t.Errorf("%s: two builds differ: sha256 %s, then %s", filepath.Base(first[i]), a, b)
		}
	}
	other, err := Build(Options{BinDir: fakeBinaries(t), OutDir: t.TempDir(), Version: "1.2.0+git5.abc1234", MTime: mtime.Add(time.Second)})
	require.NoError(t, err)
	if sha(t, other[0]) == sha(t, first[0]) {
		t.Errorf("Build() with another MTime gave the same %s: the time stamp is not used", filepath.Base(first[0]))
	}
}

// TestBuildContents reads the packages back with dpkg-deb: file names,
// modes and owners, time stamps, conffiles and maintainer scripts.
func TestBuildContents(t *testing.T) {
	dpkgDeb := testenv.RequireTool(t, "dpkg-deb", "dpkg")
	mtime := time.Date(2026, 12, 6, 11, 46, 25, 0, time.UTC)
	debs, err := Build(Options{BinDir: fakeBinaries(t), OutDir: t.TempDir(), Version: "1.2.0", MTime: mtime})
	require.NoError(t, err)
	run := func(args ...string) string {
		cmd := exec.Command(dpkgDeb, args...)
		cmd.Env = append(os.Environ(), "TZ=UTC")
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "dpkg-deb %v: %s", args, out)
		return string(out)
	}
	tests := []struct {
		deb       string
		files     []string // "mode owner path" as dpkg-deb -c prints them
		conffiles []string
		scripts   []string
	}{
		{debs[0], []string{
			"-rwxr-xr-x root/root ./usr/bin/kiln-agent",
			"-rw-r--r-- root/root ./usr/lib/systemd/system/" + units.AgentName,
			"-rw-r--r-- root/root ." + units.AgentEnvFile,
		}, []string{units.AgentEnvFile}, []string{"postinst", "prerm", "postrm"}},
		{debs[1], []string{
			"-rwxr-xr-x root/root ./usr/bin/kiln-controller",
			"-rw-r--r-- root/root ./usr/lib/systemd/system/" + units.ControllerName,
			"-rw-r--r-- root/root ." + units.ControllerEnvFile,
		}, []string{units.ControllerEnvFile}, []string{"postinst", "prerm", "postrm"}},
		{debs[2], []string{"-rwxr-xr-x root/root ./usr/bin/kilnctl"}, nil, nil},
	}
	for _, tt := range tests {
		t.Run(filepath.Base(tt.deb), func(t *testing.T) {
			list := run("-c", tt.deb)
			var got []string
			for _, l := range strings.Split(strings.TrimSpace(list), "\n") {
				f := strings.Fields(l) // mode owner size date time path
				require.Len(t, f, 6, "dpkg-deb -c line %q", l)
				if f[3]+" "+f[4] != "2026-12-06 11:46" {
					t.Errorf("%s: time stamp %s %s, want the given MTime 2026-12-06 11:46", f[5], f[3], f[4])
				}
				if !strings.HasSuffix(f[5], "/") {
					got = append(got, f[0]+" "+f[1]+" "+f[5])
				}
			}
			require.ElementsMatch(t, tt.files, got, "dpkg-deb -c %s", filepath.Base(tt.deb))
			info := run("-I", tt.deb)
			require.Contains(t, info, "Version: 1.2.0\n")
			require.Contains(t, info, "Architecture: amd64\n")
			require.NotContains(t, info, "Depends:", "the binaries are static: no dependencies to satisfy offline")
			ctl := t.TempDir()
			run("-e", tt.deb, ctl)
			conf, _ := os.ReadFile(filepath.Join(ctl, "conffiles"))
			require.ElementsMatch(t, tt.conffiles, strings.Fields(string(conf)), "conffiles")
			for _, s := range tt.scripts {
				b, err := os.ReadFile(filepath.Join(ctl, s))
				require.NoError(t, err, "maintainer script %s", s)
				if out, err := exec.Command("sh", "-n", filepath.Join(ctl, s)).CombinedOutput(); err != nil {
					t.Errorf("sh -n %s: %v: %s\n%s", s, err, out, b)
				}
			}
		})
	}
}

func TestBuildRefuses(t *testing.T) {
	mtime := time.Unix(1_796_557_585, 0)
	_, err := Build(Options{BinDir: t.TempDir(), OutDir: t.TempDir(), Version: "1.0", MTime: mtime})
	if !errdefs.IsNotFound(err) {
		t.Errorf("Build() without binaries = %v, want NotFound", err)
	}
	_, err = Build(Options{BinDir: fakeBinaries(t), OutDir: t.TempDir(), Version: "v1.0", MTime: mtime})
	if !errdefs.IsInvalidArgument(err) {
		t.Errorf("Build(version v1.0) = %v, want InvalidArgument", err)
	}
	_, err = Build(Options{BinDir: fakeBinaries(t), OutDir: t.TempDir(), Version: "1.0"})
	if !errdefs.IsInvalidArgument(err) {
		t.Errorf("Build() without MTime = %v, want InvalidArgument", err)
	}
}
