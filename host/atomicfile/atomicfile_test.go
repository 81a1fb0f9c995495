package atomicfile

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestWrite(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "etc/sysctl.d/99-kiln.conf")
	require.NoError(t, Write(path, []byte("a = 1\n"), 0o600))
	require.NoError(t, Write(path, []byte("a = 2\n"), 0o640))
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	if string(b) != "a = 2\n" {
		t.Errorf("Write() content = %q, want %q", b, "a = 2\n")
	}
	fi, err := os.Stat(path)
	require.NoError(t, err)
	if fi.Mode().Perm() != 0o640 {
		t.Errorf("Write() mode = %v, want 0640", fi.Mode().Perm())
	}
	entries, err := os.ReadDir(filepath.Dir(path))
	require.NoError(t, err)
	if len(entries) != 1 {
		t.Errorf("Write() left %d files in the directory, want 1 (no temporary files)", len(entries))
	}
}

func TestWriteIntoFile(t *testing.T) {
	dir := t.TempDir()
	notDir := filepath.Join(dir, "file")
	require.NoError(t, os.WriteFile(notDir, nil, 0o644))
	if err := Write(filepath.Join(notDir, "x"), []byte("x"), 0o644); err == nil {
		t.Errorf("Write() under a regular file error = nil, want an error")
	}
}
