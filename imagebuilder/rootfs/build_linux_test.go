package rootfs

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/testenv"
)

// testWriter sends command output to the test log.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) { w.t.Log(string(p)); return len(p), nil }

// TestBuildCachedAndOverlay builds the lab's small root (debootstrap
// minbase + systemd + dbus, and procps installed inside with apt-get) into
// the shared cache, checks a second build is a cache hit, and makes an
// overlay copy with an added file and a unit symlink.
func TestBuildCachedAndOverlay(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: building a Debian root takes minutes")
	}
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root to debootstrap")
	}
	if _, err := os.Stat("/usr/sbin/debootstrap"); err != nil {
		testenv.Skip(t, "debootstrap not installed (Debian package debootstrap)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	spec := Spec{Packages: []string{"procps"}}
	dir, err := Build(ctx, spec, testWriter{t})
	require.NoError(t, err)
	for _, p := range []string{"usr/lib/systemd/systemd", "usr/bin/dbus-daemon", "usr/bin/ps", "usr/sbin/ip"} {
		if _, err := os.Stat(filepath.Join(dir, p)); err != nil {
			t.Errorf("Build(%+v): %s missing: %v", spec, p, err)
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, "etc/machine-id")); err != nil || len(b) != 0 {
		t.Errorf("Build(%+v): /etc/machine-id = %q, %v, want empty", spec, b, err)
	}

	if _, err := os.Stat(filepath.Join(dir, "etc/hostname")); err == nil {
		t.Errorf("Build(%+v): /etc/hostname of the build machine kept", spec)
	}

	again, err := Build(ctx, spec, nil)
	require.NoError(t, err)
	if again != dir {
		t.Errorf("second Build(%+v) = %q, want cached %q", spec, again, dir)
	}
	tmps, _ := filepath.Glob(filepath.Join(filepath.Dir(dir), ".tmp-"+spec.Key()+"-*"))
	if len(tmps) != 0 {
		t.Errorf("Build left temporary trees %v", tmps)
	}

	dst := filepath.Join(t.TempDir(), "image")
	files := []File{
		{Path: "/usr/local/bin/hello", Mode: 0o755, Data: []byte("#!/bin/sh\necho hi\n")},
		{Path: "/etc/systemd/system/hello.service", Data: []byte("[Service]\nExecStart=/usr/local/bin/hello\n")},
		{Path: "/etc/systemd/system/multi-user.target.wants/hello.service", Symlink: "/etc/systemd/system/hello.service"},
	}
	require.NoError(t, Overlay(ctx, dir, dst, files))
	st, err := os.Stat(filepath.Join(dst, "usr/local/bin/hello"))
	require.NoError(t, err)
	if st.Mode().Perm() != 0o755 {
		t.Errorf("Overlay: hello mode = %v, want 0755", st.Mode().Perm())
	}
	if l, err := os.Readlink(filepath.Join(dst, "etc/systemd/system/multi-user.target.wants/hello.service")); err != nil || l != "/etc/systemd/system/hello.service" {
		t.Errorf("Overlay: unit link = %q, %v", l, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "usr/local/bin/hello")); err == nil {
		t.Errorf("Overlay changed the cached base %s", dir)
	}
	if err := Overlay(ctx, dir, dst, nil); err == nil {
		t.Errorf("Overlay onto existing %s = nil, want AlreadyExists", dst)
	}
}
