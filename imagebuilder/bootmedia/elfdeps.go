package bootmedia

import (
	"debug/elf"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// LibDirs are the directories, relative to a root, where ELFDeps looks
// for shared libraries: the amd64 default search path of Debian's
// dynamic loader.
var LibDirs = []string{"lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib64", "usr/lib64", "lib", "usr/lib"}

// ELFDep is a file a dynamic executable needs at run time.
type ELFDep struct {
	// Path is where the loader looks for it, without a leading slash
	// ("lib64/ld-linux-x86-64.so.2", "lib/x86_64-linux-gnu/libc.so.6").
	Path string
	// Source is the file under root (symlinks are followed when read).
	Source string
}

// ELFDeps returns the ELF interpreter (PT_INTERP) of the executable bin
// and every shared library it needs (DT_NEEDED, recursively), found under
// root in LibDirs, sorted by Path. A static executable needs none.
// Equivalent to the "=>" column of `ldd BIN`.
//
// It returns NotFound naming the library and the binary that needs it
// when a library is in none of LibDirs.
func ELFDeps(root, bin string) ([]ELFDep, error) {
	f, err := elf.Open(bin)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", bin, err)
	}
	defer f.Close()
	deps := map[string]ELFDep{}
	seen := map[string]bool{}
	for _, p := range f.Progs {
		if p.Type != elf.PT_INTERP {
			continue
		}
		b := make([]byte, p.Filesz)
		if _, err := p.ReadAt(b, 0); err != nil {
			return nil, fmt.Errorf("%s: interpreter: %w", bin, err)
		}
		interp := strings.TrimRight(string(b), "\x00")
		rel := strings.TrimPrefix(path.Clean("/"+interp), "/")
		deps[rel] = ELFDep{Path: rel, Source: filepath.Join(root, rel)}
		// libc names the interpreter by its soname: it is loaded already.
		seen[path.Base(rel)] = true
	}
	var walk func(file string, f *elf.File) error
	walk = func(file string, f *elf.File) error {
		needed, err := f.ImportedLibraries()
		if err != nil {
			return fmt.Errorf("%s: %w", file, err)
		}
		for _, lib := range needed {
			if seen[lib] {
				continue
			}
			seen[lib] = true
			dep, ok := findLib(root, lib)
			if !ok {
				return errdefs.NotFound("%s needs %s, which is in none of %s under %s", file, lib, strings.Join(LibDirs, ", "), root)
			}
			deps[dep.Path] = dep
			lf, err := elf.Open(dep.Source)
			if err != nil {
				return fmt.Errorf("%s: %w", dep.Source, err)
			}
			err = walk(dep.Source, lf)
			lf.Close()
			if err != nil {
				return err
			}
		}
		return nil
	}
	if err := walk(bin, f); err != nil {
		return nil, err
	}
	out := make([]ELFDep, 0, len(deps))
	for _, d := range deps {
		out = append(out, d)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out, nil
}

func findLib(root, soname string) (ELFDep, bool) {
	if strings.Contains(soname, "/") {
		rel := strings.TrimPrefix(path.Clean("/"+soname), "/")
		return ELFDep{Path: rel, Source: filepath.Join(root, rel)}, true
	}
	for _, d := range LibDirs {
		src := filepath.Join(root, d, soname)
		if st, err := os.Stat(src); err == nil && st.Mode().IsRegular() {
			return ELFDep{Path: d + "/" + soname, Source: src}, true
		}
	}
	return ELFDep{}, false
}
