package bootmedia

import (
	"fmt"
	"io"
	"io/fs"
	"math"
	"path"
	"sort"
	"strings"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Entry is one file of an initramfs archive.
type Entry struct {
	// Path inside the archive, without a leading slash ("bin/busybox").
	Path string
	// Mode is the file type and permission bits (fs.ModeDir,
	// fs.ModeSymlink, fs.ModeCharDevice|fs.ModeDevice, or a regular file).
	Mode fs.FileMode
	// Data is the content of a regular file, or the target of a symlink.
	Data []byte
	// Source, when set, is a host file whose content is copied instead of
	// Data (read at write time, so large files are not held in memory).
	Source string
	// Major and Minor are the device numbers of a device node.
	Major, Minor uint32
}

// Archive is the set of entries of a cpio "newc" archive. Parent
// directories are added automatically.
type Archive struct {
	entries map[string]Entry
}

// Add adds or replaces an entry and creates its parent directories.
func (a *Archive) Add(e Entry) {
	if a.entries == nil {
		a.entries = map[string]Entry{}
	}
	e.Path = strings.TrimPrefix(path.Clean("/"+e.Path), "/")
	for d := path.Dir(e.Path); d != "." && d != "/"; d = path.Dir(d) {
		if _, ok := a.entries[d]; !ok {
			a.entries[d] = Entry{Path: d, Mode: fs.ModeDir | 0o755}
		}
	}
	a.entries[e.Path] = e
}

// Paths returns the archive's paths in the order WriteTo writes them.
func (a *Archive) Paths() []string {
	paths := make([]string, 0, len(a.entries))
	for p := range a.entries {
		paths = append(paths, p)
	}
	sort.Strings(paths) // a directory sorts before its contents
	return paths
}

// WriteTo writes the archive in cpio newc format, entries sorted by path,
// owned by 0:0, all with modification time mtime (SOURCE_DATE_EPOCH), so
// that the same inputs give the same bytes. Equivalent to:
// `find . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --reproducible`.
//
// It returns InvalidArgument, before writing anything, for an mtime
// outside newc's 32 bits, and on reaching an entry newc cannot hold: an
// empty path, the path TRAILER!!!, a NUL in a path, or a file of 4 GiB or
// more.
func (a *Archive) WriteTo(w io.Writer, mtime int64) (int64, error) {
	if mtime < 0 || mtime > math.MaxUint32 {
		return 0, errdefs.InvalidArgument("initramfs: modification time %d is outside cpio newc's 32-bit range (1970 to 2106)", mtime)
	}
	cw := &countWriter{w: w}
	ino := uint32(1)
	for _, p := range a.Paths() {
		e := a.entries[p]
		switch {
		case p == "":
			return cw.n, errdefs.InvalidArgument("initramfs: an entry has an empty path: the root directory is implied")
		case p == "TRAILER!!!":
			return cw.n, errdefs.InvalidArgument("initramfs: path %q marks the end of a cpio archive: rename it", p)
		case strings.IndexByte(p, 0) >= 0:
			return cw.n, errdefs.InvalidArgument("initramfs: path %q holds a NUL byte, which ends a cpio name", p)
		}
		var (
			mode uint32
			size int64
			body io.Reader
			rc   io.ReadCloser
		)
		perm := uint32(e.Mode.Perm())
		switch {
		case e.Mode&fs.ModeDir != 0:
			mode = 0o040000 | perm
		case e.Mode&fs.ModeSymlink != 0:
			mode = 0o120000 | 0o777
			size = int64(len(e.Data))
			body = strings.NewReader(string(e.Data))
		case e.Mode&fs.ModeCharDevice != 0:
			mode = 0o020000 | perm
		case e.Mode&fs.ModeDevice != 0:
			mode = 0o060000 | perm
		default:
			mode = 0o100000 | perm
			if e.Source != "" {
				var err error
				rc, size, err = openFile(e.Source)
				if err != nil {
					return cw.n, fmt.Errorf("initramfs %s: %w", p, err)
				}
				body = rc
			} else {
				size = int64(len(e.Data))
				body = strings.NewReader(string(e.Data))
			}
		}
		if size > math.MaxUint32 {
			if rc != nil {
				rc.Close()
			}
			return cw.n, errdefs.InvalidArgument("initramfs %s: %d bytes: a cpio newc entry holds at most 4 GiB", p, size)
		}
		nlink := uint32(1)
		if mode&0o170000 == 0o040000 {
			nlink = 2
		}
		err := writeHeader(cw, p, ino, mode, nlink, uint32(mtime), uint32(size), e.Major, e.Minor)
		if err == nil && body != nil {
			var n int64
			n, err = io.Copy(cw, body)
			if err == nil && n != size {
				err = fmt.Errorf("size changed while reading: %d bytes, want %d", n, size)
			}
			if err == nil {
				err = pad(cw, cw.n)
			}
		}
		if rc != nil {
			rc.Close()
		}
		if err != nil {
			return cw.n, fmt.Errorf("initramfs %s: %w", p, err)
		}
		ino++
	}
	if err := writeHeader(cw, "TRAILER!!!", 0, 0, 1, 0, 0, 0, 0); err != nil {
		return cw.n, err
	}
	// Pad the archive to a 512-byte block, like cpio does.
	if r := cw.n % 512; r != 0 {
		if _, err := cw.Write(make([]byte, 512-r)); err != nil {
			return cw.n, err
		}
	}
	return cw.n, nil
}

func writeHeader(w *countWriter, name string, ino, mode, nlink, mtime, size, rmaj, rmin uint32) error {
	hdr := fmt.Sprintf("070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		ino, mode, 0, 0, nlink, mtime, size, 0, 0, rmaj, rmin, len(name)+1, 0)
	if _, err := io.WriteString(w, hdr+name+"\x00"); err != nil {
		return err
	}
	return pad(w, w.n)
}

func pad(w *countWriter, n int64) error {
	if r := n % 4; r != 0 {
		_, err := w.Write(make([]byte, 4-r))
		return err
	}
	return nil
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
