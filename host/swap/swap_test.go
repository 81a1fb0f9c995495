package swap

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/host/command"
)

func write(t *testing.T, path, content string, mode os.FileMode) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	require.NoError(t, os.WriteFile(path, []byte(content), mode))
}

func TestOff(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	write(t, filepath.Join(root, "proc/swaps"), "Filename\tType\tSize\tUsed\tPriority\n/swapfile\tfile\t1048572\t0\t-2\n", 0o644)
	r := &command.Recorder{}
	was, err := Off(ctx, root, r)
	require.NoError(t, err)
	require.Equal(t, []string{"/swapfile"}, was)
	require.Equal(t, []string{"swapoff -a"}, r.Lines())

	write(t, filepath.Join(root, "proc/swaps"), "Filename\tType\tSize\tUsed\tPriority\n", 0o644)
	r = &command.Recorder{}
	was, err = Off(ctx, root, r)
	require.NoError(t, err)
	if len(was) != 0 || len(r.Lines()) != 0 {
		t.Errorf("Off() with no swap = %v running %v, want nothing", was, r.Lines())
	}
}

func TestDisableInFstab(t *testing.T) {
	root := t.TempDir()
	fstab := "# /etc/fstab: static file system information.\n" +
		"UUID=1234 /               ext4    errors=remount-ro 0       1\n" +
		"UUID=abcd none            swap    sw              0       0\n" +
		"#/swapfile none swap sw 0 0\n" +
		"/swapfile\tnone\tswap\tdefaults\t0\t0" // no final newline
	write(t, filepath.Join(root, "etc/fstab"), fstab, 0o600)

	disabled, err := DisableInFstab(root)
	require.NoError(t, err)
	require.Equal(t, []string{"UUID=abcd none            swap    sw              0       0", "/swapfile\tnone\tswap\tdefaults\t0\t0"}, disabled)
	b, err := os.ReadFile(filepath.Join(root, "etc/fstab"))
	require.NoError(t, err)
	want := "# /etc/fstab: static file system information.\n" +
		"UUID=1234 /               ext4    errors=remount-ro 0       1\n" +
		"#UUID=abcd none            swap    sw              0       0\n" +
		"#/swapfile none swap sw 0 0\n" +
		"#/swapfile\tnone\tswap\tdefaults\t0\t0"
	if string(b) != want {
		t.Errorf("DisableInFstab() wrote %q, want %q", b, want)
	}
	fi, err := os.Stat(filepath.Join(root, "etc/fstab"))
	require.NoError(t, err)
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("DisableInFstab() mode = %v, want 0600 kept", fi.Mode().Perm())
	}

	disabled, err = DisableInFstab(root)
	require.NoError(t, err)
	if len(disabled) != 0 {
		t.Errorf("DisableInFstab() again = %v, want nothing", disabled)
	}
}

func TestDisableInFstabMissing(t *testing.T) {
	disabled, err := DisableInFstab(t.TempDir())
	if err != nil || len(disabled) != 0 {
		t.Errorf("DisableInFstab(no fstab) = %v, %v, want nothing, nil", disabled, err)
	}
}
