package manifest

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// Files expands paths into the files to read: a file stands for itself,
// "-" for standard input, and a directory for its *.yaml and *.yml files
// in sorted order (not recursive). A directory without any is an error.
func Files(paths ...string) ([]string, error) {
	var out []string
	for _, p := range paths {
		if p == "-" {
			out = append(out, p)
			continue
		}
		st, err := os.Stat(p)
		if err != nil {
			return nil, fmt.Errorf("manifest: %w", err)
		}
		if !st.IsDir() {
			out = append(out, p)
			continue
		}
		entries, err := os.ReadDir(p)
		if err != nil {
			return nil, fmt.Errorf("manifest: %w", err)
		}
		var found []string
		for _, e := range entries {
			ext := filepath.Ext(e.Name())
			if !e.IsDir() && (ext == ".yaml" || ext == ".yml") {
				found = append(found, filepath.Join(p, e.Name()))
			}
		}
		if len(found) == 0 {
			return nil, fmt.Errorf("manifest: directory %s holds no *.yaml or *.yml files", p)
		}
		sort.Strings(found)
		out = append(out, found...)
	}
	return out, nil
}

// Read reads every file named by paths (see Files) and decodes every
// document. It returns the documents that decoded, and problems listing
// every problem of every file, each with its file and line (nil when
// there are none); the same kind and name twice is a problem too. err is
// an error reading the files. stdin is read for "-". Read does not
// validate the resources: controller/validation.LoadManifests reads and
// validates, all or nothing.
func Read(stdin io.Reader, paths ...string) (docs []*Document, problems *Error, err error) {
	files, err := Files(paths...)
	if err != nil {
		return nil, nil, err
	}
	return read(stdin, files)
}

// ReadRecursive is Read with directories read recursively
// (FilesRecursive).
func ReadRecursive(stdin io.Reader, paths ...string) (docs []*Document, problems *Error, err error) {
	files, err := FilesRecursive(paths...)
	if err != nil {
		return nil, nil, err
	}
	return read(stdin, files)
}

func read(stdin io.Reader, files []string) ([]*Document, *Error, error) {
	var err error
	var in []File
	for _, f := range files {
		var data []byte
		if f == "-" {
			data, err = io.ReadAll(stdin)
		} else {
			data, err = os.ReadFile(f)
		}
		if err != nil {
			return nil, nil, fmt.Errorf("manifest: %w", err)
		}
		in = append(in, File{Name: f, Data: data})
	}
	docs, problems := Parse(in)
	return docs, problems, nil
}

// File is one file's name and content, for Parse.
type File struct {
	Name string
	Data []byte
}

// Parse decodes every document of files, in order, as Read does: it
// returns the documents that decoded and the problems (nil when none),
// each with its file and line. A GitSource reads a commit's files with
// it (through controller/validation.ParseManifests, which validates).
func Parse(files []File) ([]*Document, *Error) {
	var all []*Document
	var errs Error
	for _, f := range files {
		docs, err := Decode(f.Name, f.Data)
		var derr *Error
		switch {
		case errors.As(err, &derr):
			errs.Problems = append(errs.Problems, derr.Problems...)
			continue
		case err != nil:
			errs.Add(f.Name, 0, "", "%v", err)
			continue
		}
		all = append(all, docs...)
	}
	seen := map[string]*Document{}
	for _, d := range all {
		kind, name := d.KindName()
		key := kind + "/" + name
		if first, dup := seen[key]; dup && name != "" {
			errs.Add(d.File, d.Line, "", "%s is also defined at %s:%d: each resource once", key, first.File, first.Line)
			continue
		}
		seen[key] = d
	}
	if len(errs.Problems) > 0 {
		return all, &errs
	}
	return all, nil
}

// KindName returns the kind ("Host") and the metadata name of the
// document's resource; both are empty for a Resource with no kind set.
func (d *Document) KindName() (kind, name string) {
	m := d.Resource.ProtoReflect()
	od := m.Descriptor().Oneofs().ByName("kind")
	if od == nil {
		return "", ""
	}
	fd := m.WhichOneof(od)
	if fd == nil {
		return "", ""
	}
	obj := m.Get(fd).Message()
	kind = string(obj.Descriptor().Name())
	md := obj.Descriptor().Fields().ByName("metadata")
	if md == nil || !obj.Has(md) {
		return kind, ""
	}
	meta := obj.Get(md).Message()
	return kind, meta.Get(meta.Descriptor().Fields().ByName("name")).String()
}

// Manifest reports whether a file name is one Files and a GitSource read:
// *.yaml or *.yml.
func Manifest(name string) bool {
	ext := filepath.Ext(name)
	return ext == ".yaml" || ext == ".yml"
}

// FilesRecursive is Files that also reads the subdirectories of a
// directory, depth first in sorted order (kilnctl apply -R).
func FilesRecursive(paths ...string) ([]string, error) {
	var out []string
	for _, p := range paths {
		st, err := os.Stat(p)
		if p == "-" || (err == nil && !st.IsDir()) {
			out = append(out, p)
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("manifest: %w", err)
		}
		n := len(out)
		err = filepath.WalkDir(p, func(path string, d os.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() && path != p && strings.HasPrefix(d.Name(), ".") {
				return filepath.SkipDir // .git and friends
			}
			if !d.IsDir() && Manifest(d.Name()) {
				out = append(out, path)
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("manifest: %w", err)
		}
		if len(out) == n {
			return nil, fmt.Errorf("manifest: directory %s holds no *.yaml or *.yml files", p)
		}
	}
	return out, nil
}

// Summary returns "Kind/name" for a document, for messages.
func (d *Document) Summary() string {
	kind, name := d.KindName()
	return strings.ToLower(kind) + "/" + name
}
