package atomicfile

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// names lists the entries of dir.
func names(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}

func TestWriteContentAndMode(t *testing.T) {
	tests := []struct {
		name string
		mode os.FileMode
	}{
		{"private key", 0o600},
		{"group readable", 0o640},
		{"wider than the umask", 0o666}, // chmod, not open(2)'s perm & ^umask
		{"read only", 0o400},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "f")
			require.NoError(t, os.WriteFile(path, []byte("old, and longer than the new\n"), 0o644))
			if err := Write(path, []byte("new\n"), tt.mode); err != nil {
				t.Fatalf("Write(%q, %v) = %v, want nil", path, tt.mode, err)
			}
			b, err := os.ReadFile(path)
			require.NoError(t, err)
			if string(b) != "new\n" {
				t.Errorf("Write(%q) content = %q, want %q", path, b, "new\n")
			}
			fi, err := os.Stat(path)
			require.NoError(t, err)
			if fi.Mode() != tt.mode {
				t.Errorf("Write(%q, %v) mode = %v, want %v", path, tt.mode, fi.Mode(), tt.mode)
			}
			if got := names(t, dir); len(got) != 1 {
				t.Errorf("Write(%q) left %q in the directory, want only f", path, got)
			}
		})
	}
}

func TestWriteMkdirAll(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "etc/sysctl.d/99-kiln.conf")
	if err := Write(path, []byte("a = 1\n"), 0o644); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Write(%q) without MkdirAll = %v, want fs.ErrNotExist", path, err)
	}
	require.NoError(t, Write(path, []byte("a = 1\n"), 0o644, MkdirAll(0o750)))
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, "a = 1\n", string(b))
	fi, err := os.Stat(filepath.Dir(path))
	require.NoError(t, err)
	if fi.Mode().Perm()&^0o750 != 0 {
		t.Errorf("MkdirAll(0750) made %s with mode %v, want at most 0750", filepath.Dir(path), fi.Mode().Perm())
	}
	notDir := filepath.Join(dir, "file")
	require.NoError(t, os.WriteFile(notDir, nil, 0o644))
	if err := Write(filepath.Join(notDir, "x"), []byte("x"), 0o644, MkdirAll(0o755)); err == nil {
		t.Errorf("Write() under a regular file = nil, want an error")
	}
}

func TestWriteFunc(t *testing.T) {
	path := filepath.Join(t.TempDir(), "backup")
	err := WriteFunc(path, 0o600, func(w io.Writer) error {
		for i := range 3 {
			if _, err := fmt.Fprintf(w, "chunk %d\n", i); err != nil {
				return err
			}
		}
		return nil
	})
	require.NoError(t, err)
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, "chunk 0\nchunk 1\nchunk 2\n", string(b))
}

// faultFS is the real filesystem with one operation failing with err and
// every call recorded.
type faultFS struct {
	osFS
	fail string // "rename", "link", "sync", "syncdir", "create"
	err  error

	mu  sync.Mutex
	ops []string
}

func (f *faultFS) record(op string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ops = append(f.ops, op)
	if op == f.fail || strings.HasPrefix(op, f.fail+" ") {
		return f.err
	}
	return nil
}

func (f *faultFS) CreateTemp(dir, pattern string) (file, error) {
	if err := f.record("create " + dir); err != nil {
		return nil, err
	}
	tf, err := f.osFS.CreateTemp(dir, pattern)
	if err != nil {
		return nil, err
	}
	return &faultFile{file: tf, fs: f}, nil
}

func (f *faultFS) Rename(oldpath, newpath string) error {
	if err := f.record("rename " + newpath); err != nil {
		return err
	}
	return f.osFS.Rename(oldpath, newpath)
}

func (f *faultFS) Link(oldpath, newpath string) error {
	if err := f.record("link " + newpath); err != nil {
		return err
	}
	return f.osFS.Link(oldpath, newpath)
}

func (f *faultFS) SyncDir(dir string) error {
	if err := f.record("syncdir " + dir); err != nil {
		return err
	}
	return f.osFS.SyncDir(dir)
}

type faultFile struct {
	file
	fs *faultFS
}

func (f *faultFile) Sync() error {
	if err := f.fs.record("sync"); err != nil {
		return err
	}
	return f.file.Sync()
}

func (f *faultFile) Close() error {
	_ = f.fs.record("close")
	return f.file.Close()
}

// TestWriteSyncsDirectoryAfterRename checks the order that makes a write
// durable: the file's data are fsynced before the rename, and the
// directory holding the new name is fsynced after it.
func TestWriteSyncsDirectoryAfterRename(t *testing.T) {
	for _, tt := range []struct {
		name  string
		opts  []Option
		place string
	}{
		{"replace", nil, "rename"},
		{"no replace", []Option{NoReplace()}, "link"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "kubeconfig")
			fsys := &faultFS{}
			require.NoError(t, writeFS(fsys, path, 0o600, func(w io.Writer) error {
				_, err := w.Write([]byte("x"))
				return err
			}, tt.opts...))
			want := []string{"create " + dir, "sync", "close", tt.place + " " + path, "syncdir " + dir}
			require.Equal(t, want, fsys.ops, "operations of writeFS(%q)", path)
		})
	}
}

// TestWriteFailureKeepsTheOldFile injects a failure at each step: the
// error comes back, the old content stays, and no temporary file is left.
func TestWriteFailureKeepsTheOldFile(t *testing.T) {
	eio := &fs.PathError{Op: "x", Path: "y", Err: syscall.EIO}
	errWrite := errors.New("stream broke")
	tests := []struct {
		name    string
		fail    string
		write   error
		opts    []Option
		wantErr error
		renamed bool // the new content is in place despite the error
	}{
		{name: "write callback", write: errWrite, wantErr: errWrite},
		{name: "fsync of the file", fail: "sync", wantErr: syscall.EIO},
		{name: "rename", fail: "rename", wantErr: syscall.EIO},
		{name: "temporary file", fail: "create", wantErr: syscall.EIO},
		{name: "no replace of an existing file", opts: []Option{NoReplace()}, wantErr: fs.ErrExist},
		{name: "fsync of the directory", fail: "syncdir", wantErr: syscall.EIO, renamed: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "config.yaml")
			require.NoError(t, os.WriteFile(path, []byte("old\n"), 0o600))
			fsys := &faultFS{fail: tt.fail, err: eio}
			err := writeFS(fsys, path, 0o644, func(w io.Writer) error {
				if _, err := w.Write([]byte("new, half written")); err != nil {
					return err
				}
				return tt.write
			}, tt.opts...)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("writeFS(%q) with %s failing = %v, want %v", path, tt.name, err, tt.wantErr)
			}
			b, rerr := os.ReadFile(path)
			require.NoError(t, rerr)
			want := "old\n"
			if tt.renamed {
				want = "new, half written"
			}
			if string(b) != want {
				t.Errorf("after a failed writeFS(%q) content = %q, want %q", path, b, want)
			}
			if got := names(t, dir); len(got) != 1 {
				t.Errorf("after a failed writeFS(%q) the directory holds %q, want only config.yaml", path, got)
			}
		})
	}
}

func TestWriteIgnoresUnsupportedDirectorySync(t *testing.T) {
	for _, errno := range []syscall.Errno{syscall.EINVAL, syscall.ENOTSUP} {
		path := filepath.Join(t.TempDir(), "f")
		fsys := &faultFS{fail: "syncdir", err: &fs.PathError{Op: "sync", Path: "d", Err: errno}}
		if err := writeFS(fsys, path, 0o644, func(io.Writer) error { return nil }); err != nil {
			t.Errorf("writeFS() with a directory fsync failing with %v = %v, want nil", errno, err)
		}
	}
}

// TestNoReplaceRace has many creators race for one path: exactly one
// wins, the others get fs.ErrExist, and the file is the winner's whole.
func TestNoReplaceRace(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "sealkey")
	const n = 8
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			errs[i] = Write(path, []byte(strings.Repeat(fmt.Sprint(i), 4096)), 0o600, NoReplace())
		})
	}
	wg.Wait()
	winner := -1
	for i, err := range errs {
		switch {
		case err == nil && winner >= 0:
			t.Fatalf("Write(NoReplace) succeeded for %d and %d, want one", winner, i)
		case err == nil:
			winner = i
		case !errors.Is(err, fs.ErrExist):
			t.Errorf("Write(NoReplace) #%d = %v, want fs.ErrExist", i, err)
		}
	}
	require.GreaterOrEqual(t, winner, 0, "no creator won")
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, strings.Repeat(fmt.Sprint(winner), 4096), string(b))
	if got := names(t, dir); len(got) != 1 {
		t.Errorf("after the race the directory holds %q, want only sealkey", got)
	}
}
