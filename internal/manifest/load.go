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
	var all []*Document
	var errs Error
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
		docs, err := Decode(f, data)
		var derr *Error
		switch {
		case errors.As(err, &derr):
			errs.Problems = append(errs.Problems, derr.Problems...)
			continue
		case err != nil:
			return nil, nil, err
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
		return all, &errs, nil
	}
	return all, nil, nil
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

// Summary returns "Kind/name" for a document, for messages.
func (d *Document) Summary() string {
	kind, name := d.KindName()
	return strings.ToLower(kind) + "/" + name
}
