// Package atomicfile writes files so that a reader, or the machine after a
// crash, sees the old content or the new one, never a part: the data go to
// a temporary file in the same directory, which is fsynced, given its mode
// and renamed over the target, and then the directory is fsynced so that
// the rename itself survives a power cut. Every small file Kiln replaces
// (configs, keys, certificates, manifests, indexes) goes through it.
//
// Equivalent to: `install -m MODE /dev/stdin DIR/.NAME.tmp-XXX && sync
// DIR/.NAME.tmp-XXX && mv DIR/.NAME.tmp-XXX DIR/NAME && sync DIR`.
package atomicfile

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"
)

// Option changes how Write and WriteFunc place the file.
type Option func(*options)

type options struct {
	mkdir     bool
	mkdirPerm os.FileMode
	noReplace bool
}

// MkdirAll creates the file's directory, and its missing parents, with
// perm (before umask) when it does not exist. Without it a missing
// directory is an error.
func MkdirAll(perm os.FileMode) Option {
	return func(o *options) { o.mkdir, o.mkdirPerm = true, perm }
}

// NoReplace creates the file only if nothing is at path yet: the complete
// temporary file is hard-linked into place instead of renamed, so of two
// concurrent creators exactly one wins and the other gets an error
// matching fs.ErrExist, with the existing file untouched.
func NoReplace() Option {
	return func(o *options) { o.noReplace = true }
}

// Write replaces (or creates) path with data and mode. mode is set with
// chmod, so the umask does not narrow it, and the file never exists under
// path with another mode. The call blocks until data and rename are on
// disk. Errors wrap the underlying *fs.PathError (fs.ErrNotExist for a
// missing directory, fs.ErrExist with NoReplace); on any error path
// keeps its old content and no temporary file is left behind.
func Write(path string, data []byte, mode os.FileMode, opts ...Option) error {
	return WriteFunc(path, mode, func(w io.Writer) error {
		_, err := w.Write(data)
		return err
	}, opts...)
}

// WriteFunc is Write for content that is streamed: write is called once
// with the temporary file and its error, if any, is returned as it is
// (not wrapped), after the temporary file is removed.
func WriteFunc(path string, mode os.FileMode, write func(w io.Writer) error, opts ...Option) error {
	return writeFS(osFS{}, path, mode, write, opts...)
}

// fileSystem is the part of the OS that writeFS uses; tests embed osFS to
// record calls or inject faults.
type fileSystem interface {
	CreateTemp(dir, pattern string) (file, error)
	MkdirAll(dir string, perm os.FileMode) error
	Rename(oldpath, newpath string) error
	Link(oldpath, newpath string) error
	Remove(name string) error
	SyncDir(dir string) error
}

// file is the part of *os.File that writeFS uses.
type file interface {
	io.Writer
	Name() string
	Chmod(os.FileMode) error
	Sync() error
	Close() error
}

func writeFS(fsys fileSystem, path string, mode os.FileMode, write func(io.Writer) error, opts ...Option) error {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	dir := filepath.Dir(path)
	if o.mkdir {
		if err := fsys.MkdirAll(dir, o.mkdirPerm); err != nil {
			return fmt.Errorf("write %s: %w", path, err)
		}
	}
	f, err := fsys.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	tmp := f.Name()
	defer fsys.Remove(tmp) // fails harmlessly after a rename; drops the name after a link
	// Chmod first: content never sits under a wider mode, even in the
	// temporary file.
	if err := f.Chmod(mode); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := write(f); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("write %s: fsync: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if o.noReplace {
		err = fsys.Link(tmp, path)
	} else {
		err = fsys.Rename(tmp, path)
	}
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := fsys.SyncDir(dir); err != nil && !ignoredSyncDirError(err) {
		return fmt.Errorf("write %s: fsync directory: %w", path, err)
	}
	return nil
}

// ignoredSyncDirError reports whether err says that the filesystem cannot
// fsync a directory (some network and FUSE filesystems), not that it
// failed to: the rename is then as durable as that filesystem makes it.
func ignoredSyncDirError(err error) bool {
	return errors.Is(err, errors.ErrUnsupported) || errors.Is(err, syscall.EINVAL)
}

// osFS is the real filesystem.
type osFS struct{}

func (osFS) CreateTemp(dir, pattern string) (file, error) { return os.CreateTemp(dir, pattern) }
func (osFS) MkdirAll(dir string, perm os.FileMode) error  { return os.MkdirAll(dir, perm) }
func (osFS) Rename(oldpath, newpath string) error         { return os.Rename(oldpath, newpath) }
func (osFS) Link(oldpath, newpath string) error           { return os.Link(oldpath, newpath) }
func (osFS) Remove(name string) error                     { return os.Remove(name) }
func (osFS) SyncDir(dir string) error                     { return syncDir(dir) }

var (
	_ fileSystem = osFS{}
	_ file       = (*os.File)(nil)
)
