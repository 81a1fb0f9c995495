package manifest

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/kilnhq/kiln/controller/validation"
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

// Load reads every file named by paths (see Files), decodes every
// document and validates every resource with validation.Validate. It
// returns the documents only when all of them are good; otherwise an
// *Error listing every problem of every file, each with its file and line
// (class errdefs.InvalidArgument), so nothing is applied from a set with
// one bad document. The same kind and name twice is a problem too. stdin
// is read for "-".
func Load(stdin io.Reader, paths ...string) ([]*Document, error) {
	files, err := Files(paths...)
	if err != nil {
		return nil, err
	}
	return read(stdin, files)
}

// LoadRecursive is Load with directories read recursively
// (FilesRecursive).
func LoadRecursive(stdin io.Reader, paths ...string) ([]*Document, error) {
	files, err := FilesRecursive(paths...)
	if err != nil {
		return nil, err
	}
	return read(stdin, files)
}

func read(stdin io.Reader, files []string) ([]*Document, error) {
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
			return nil, fmt.Errorf("manifest: %w", err)
		}
		in = append(in, File{Name: f, Data: data})
	}
	return Parse(in)
}

// File is one file's name and content, for Parse.
type File struct {
	Name string
	Data []byte
}

// Parse decodes every document of files, in order, and validates every
// resource, as Load does: it returns the documents only when all of them
// are good, otherwise an *Error listing every problem with its file and
// line (InvalidArgument). A GitSource reads a commit's files with it.
func Parse(files []File) ([]*Document, error) {
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
			return nil, err
		}
		all = append(all, docs...)
	}
	seen := map[string]*Document{}
	for _, d := range all {
		CheckDocument(d, &errs)
		kind, name := validation.KindName(d.Resource)
		key := kind + "/" + name
		if first, dup := seen[key]; dup && name != "" {
			errs.add(d.File, d.Line, "", "%s is also defined at %s:%d: each resource once", key, first.File, first.Line)
			continue
		}
		seen[key] = d
	}
	if err := errs.orNil(); err != nil {
		return nil, err
	}
	return all, nil
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

// CheckDocument runs validation.Validate on d's resource and adds its
// problems to errs, each at the line of its field.
func CheckDocument(d *Document, errs *Error) {
	err := validation.Validate(d.Resource)
	if err == nil {
		return
	}
	var verr *validation.Error
	if !errors.As(err, &verr) {
		errs.add(d.File, d.Line, "", "%v", err)
		return
	}
	for _, f := range verr.Fields {
		errs.add(d.File, d.FieldLine(f.Field), f.Field, "%s", f.Message)
	}
}

// Summary returns "Kind/name" for a document, for messages.
func (d *Document) Summary() string {
	kind, name := validation.KindName(d.Resource)
	return strings.ToLower(kind) + "/" + name
}
