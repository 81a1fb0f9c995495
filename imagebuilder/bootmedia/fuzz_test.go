package bootmedia_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/kilnhq/kiln/imagebuilder/bootmedia"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

// cpioEntry is one entry read back from a newc archive.
type cpioEntry struct {
	name         string
	mode         uint32
	data         []byte
	rmaj, rmin   uint32
	nlink, mtime uint32
}

// readNewc reads a cpio newc archive as the kernel's initramfs unpacker
// does: headers, NUL-terminated names, 4-byte padding, up to TRAILER!!!,
// and checks that only zero padding follows.
func readNewc(b []byte) ([]cpioEntry, error) {
	var out []cpioEntry
	off := 0
	field := func(i int) (uint32, error) {
		v, err := strconv.ParseUint(string(b[off+6+8*i:off+6+8*i+8]), 16, 32)
		return uint32(v), err
	}
	for {
		if off+110 > len(b) {
			return nil, fmt.Errorf("truncated header at %d", off)
		}
		if string(b[off:off+6]) != "070701" {
			return nil, fmt.Errorf("bad magic at %d", off)
		}
		var f [13]uint32
		for i := range f {
			v, err := field(i)
			if err != nil {
				return nil, fmt.Errorf("header at %d field %d: %v", off, i, err)
			}
			f[i] = v
		}
		namesize, size := int(f[11]), int(f[6])
		start := off + 110
		if namesize < 1 || start+namesize > len(b) || b[start+namesize-1] != 0 {
			return nil, fmt.Errorf("name at %d: size %d not NUL-terminated", start, namesize)
		}
		name := string(b[start : start+namesize-1])
		if strings.IndexByte(name, 0) >= 0 {
			return nil, fmt.Errorf("name %q at %d holds a NUL: the unpacker would read %q", name, start, name[:strings.IndexByte(name, 0)])
		}
		off = (start + namesize + 3) &^ 3
		if name == "TRAILER!!!" {
			if bytes.Count(b[off:], []byte{0}) != len(b)-off {
				return nil, fmt.Errorf("data after the trailer at %d", off)
			}
			return out, nil
		}
		if off+size > len(b) {
			return nil, fmt.Errorf("%s: data of %d bytes beyond the archive", name, size)
		}
		out = append(out, cpioEntry{name: name, mode: f[1], data: b[off : off+size], rmaj: f[9], rmin: f[10], nlink: f[4], mtime: f[5]})
		off = (off + size + 3) &^ 3
	}
}

// FuzzArchive writes initramfs archives of fuzzed entries (names
// separated by '|', a type and mode per entry, data) and reads them back
// as the kernel would. Properties: WriteTo either refuses the archive
// with an error or writes one whose entries are exactly Paths() in order,
// each non-empty, relative, without "." or ".." components, with its type,
// permissions, data and device numbers, ending in TRAILER!!! and padded
// to 512 bytes.
func FuzzArchive(f *testing.F) {
	f.Add("init|sbin/kiln-agent|bin/sh|lib/modules/kernel/fs/ext4/ext4.ko|dev/console", []byte{0, 0, 1, 0, 3}, []byte("#!/bin/sh\necho hi\nbusybox"), int64(0))
	f.Add("a/b/c|a|/x/../y|./z", []byte{2, 0, 0, 0}, []byte("data"), int64(1700000000))
	f.Add("TRAILER!!!|a\x00b||/", []byte{0, 0, 0, 0}, []byte("x"), int64(-1))
	f.Fuzz(func(t *testing.T, names string, types, data []byte, mtime int64) {
		parts := strings.Split(names, "|")
		if len(parts) > 32 {
			return
		}
		ar := &bootmedia.Archive{}
		for i, p := range parts {
			var typ byte
			if i < len(types) {
				typ = types[i]
			}
			e := bootmedia.Entry{Path: p, Mode: fs.FileMode(0o644) | fs.FileMode(typ>>3)&0o7}
			chunk := data[min(len(data), i*len(data)/len(parts)):min(len(data), (i+1)*len(data)/len(parts))]
			switch typ % 5 {
			case 0:
				e.Data = chunk
			case 1:
				e.Mode, e.Data = fs.ModeSymlink, chunk
			case 2:
				e.Mode |= fs.ModeDir
			case 3:
				e.Mode |= fs.ModeDevice | fs.ModeCharDevice
				e.Major, e.Minor = uint32(typ), uint32(i)
			case 4:
				e.Mode |= fs.ModeDevice
				e.Major, e.Minor = uint32(i), uint32(typ)
			}
			ar.Add(e)
		}
		var buf bytes.Buffer
		n, err := ar.WriteTo(&buf, mtime)
		if err != nil {
			return
		}
		if n != int64(buf.Len()) || n%512 != 0 {
			t.Fatalf("WriteTo() = %d for %d bytes written, want equal and a multiple of 512", n, buf.Len())
		}
		got, err := readNewc(buf.Bytes())
		if err != nil {
			t.Fatalf("WriteTo(%q) wrote an archive the kernel would misread: %v", names, err)
		}
		paths := ar.Paths()
		if len(got) != len(paths) {
			t.Fatalf("archive of %q holds %d entries, want %d (%q)", names, len(got), len(paths), paths)
		}
		for i, e := range got {
			if e.name != paths[i] {
				t.Fatalf("entry %d is %q, want %q", i, e.name, paths[i])
			}
			if e.name == "" || strings.HasPrefix(e.name, "/") {
				t.Fatalf("entry %d has name %q: want a non-empty relative path", i, e.name)
			}
			for _, c := range strings.Split(e.name, "/") {
				if c == "" || c == "." || c == ".." {
					t.Fatalf("entry %d has name %q with component %q", i, e.name, c)
				}
			}
			if int64(e.mtime) != mtime {
				t.Fatalf("entry %q mtime %d, want %d", e.name, e.mtime, uint32(mtime))
			}
		}
	})
}

// fakeGrubDir makes a GRUB directory with the files WriteISO checks for
// and no modules.
func fakeGrubDir(f *testing.F) string {
	dir := f.TempDir()
	for _, plat := range []string{"i386-pc", "x86_64-efi"} {
		if err := os.MkdirAll(filepath.Join(dir, plat), 0o755); err != nil {
			f.Fatal(err)
		}
		for _, name := range []string{"kernel.img", "boot_hybrid.img"} {
			if err := os.WriteFile(filepath.Join(dir, plat, name), []byte("x"), 0o644); err != nil {
				f.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(dir, plat, "partmap.lst"), []byte("part_gpt\npart_msdos\n"), 0o644); err != nil {
			f.Fatal(err)
		}
	}
	return dir
}

// isoRecorder reads grub.cfg when WriteISO runs its first tool, and stops
// it at xorriso, keeping the arguments.
type isoRecorder struct {
	grubCfg string
	xorriso []string
}

var errStop = errors.New("stop before xorriso")

func (r *isoRecorder) Run(_ context.Context, dir, name string, args ...string) ([]byte, error) {
	if r.grubCfg == "" {
		b, err := os.ReadFile(filepath.Join(dir, "root", "boot", "grub", "grub.cfg"))
		if err != nil {
			return nil, err
		}
		r.grubCfg = string(b)
	}
	if name == "env" && len(args) > 3 && args[3] == "xorriso" {
		r.xorriso = args
		return nil, errStop
	}
	return nil, nil
}

// grubMeta are the characters GRUB's script lexer gives a meaning
// (metacharacters, quoting, variables, comments).
const grubMeta = "{}|&$;<>\"'\\#"

// FuzzWriteISO writes boot ISOs with a fuzzed kernel command line and
// date, up to the point where xorriso would run. Properties: a command
// line WriteISO accepts is written verbatim as the linux line of the
// GrubConfig grub.cfg and holds nothing GRUB's lexer would interpret (no
// metacharacter, quote, '#' or control character), so it reaches the
// kernel as given; an accepted date becomes xorriso's 16-digit
// --modification-date and its SOURCE_DATE_EPOCH.
func FuzzWriteISO(f *testing.F) {
	for _, tool := range []string{"grub-mkimage", "xorriso", "mformat", "mcopy"} {
		if _, err := execLookPath(tool); err != nil {
			testenv.Skipf(f, "%s not installed (apt-get install grub-common xorriso mtools)", tool)
		}
	}
	grub := fakeGrubDir(f)
	in := f.TempDir()
	kernel, initrd := filepath.Join(in, "vmlinuz"), filepath.Join(in, "initrd.img")
	for _, p := range []string{kernel, initrd} {
		if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
			f.Fatal(err)
		}
	}
	out := filepath.Join(f.TempDir(), "out.iso")
	f.Add("console=ttyS0,115200 kiln.boot=virtualmedia kiln.controller=10.0.0.1:7443 kiln.token=abc.def kiln.host=rack1-07", int64(0))
	f.Add(`kiln.host=a"; reboot`, int64(1700000000))
	f.Add("quiet } menuentry x {", int64(253402300800))
	f.Add("a #b", int64(-1))
	f.Fuzz(func(t *testing.T, cmdline string, epoch int64) {
		rec := &isoRecorder{}
		err := bootmedia.WriteISO(context.Background(), rec, bootmedia.ISO{Kernel: kernel, Initrd: initrd, Cmdline: cmdline, SourceDateEpoch: epoch, GrubDir: grub}, out)
		if !errors.Is(err, errStop) {
			if !errdefs.IsInvalidArgument(err) {
				t.Fatalf("WriteISO(%q, %d) = %v, want InvalidArgument or to reach xorriso", cmdline, epoch, err)
			}
			return
		}
		if rec.grubCfg != bootmedia.GrubConfig(cmdline) {
			t.Fatalf("grub.cfg is not GrubConfig(%q):\n%s", cmdline, rec.grubCfg)
		}
		for _, c := range cmdline {
			if c < 0x20 || c == 0x7f || strings.ContainsRune(grubMeta, c) {
				t.Fatalf("WriteISO accepted command line %q, whose %q GRUB's lexer would interpret", cmdline, c)
			}
		}
		var date string
		for _, a := range rec.xorriso {
			if d, ok := strings.CutPrefix(a, "--modification-date="); ok {
				date = d
			}
		}
		if len(date) != 16 || strings.Trim(date, "0123456789") != "" {
			t.Fatalf("WriteISO(epoch %d) gives xorriso --modification-date=%q: want 16 digits", epoch, date)
		}
		if rec.xorriso[2] != "SOURCE_DATE_EPOCH="+strconv.FormatInt(epoch, 10) {
			t.Fatalf("xorriso runs with %q, want SOURCE_DATE_EPOCH=%d", rec.xorriso[2], epoch)
		}
	})
}

var execLookPath = exec.LookPath
