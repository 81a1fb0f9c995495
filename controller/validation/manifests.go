package validation

import (
	"errors"
	"io"

	"github.com/kilnhq/kiln/internal/manifest"
)

// LoadManifests reads every file named by paths (see manifest.Files),
// decodes every document and validates every resource with Validate. It
// returns the documents only when all of them are good; otherwise a
// *manifest.Error listing every problem of every file, each with its file
// and line (class errdefs.InvalidArgument), so nothing is applied from a
// set with one bad document. stdin is read for "-".
func LoadManifests(stdin io.Reader, paths ...string) ([]*manifest.Document, error) {
	docs, problems, err := manifest.Read(stdin, paths...)
	if err != nil {
		return nil, err
	}
	return checkAll(docs, problems)
}

// LoadManifestsRecursive is LoadManifests with directories read
// recursively (manifest.FilesRecursive; kilnctl apply -R).
func LoadManifestsRecursive(stdin io.Reader, paths ...string) ([]*manifest.Document, error) {
	docs, problems, err := manifest.ReadRecursive(stdin, paths...)
	if err != nil {
		return nil, err
	}
	return checkAll(docs, problems)
}

// ParseManifests is LoadManifests of files already read (a GitSource's
// commit).
func ParseManifests(files []manifest.File) ([]*manifest.Document, error) {
	docs, problems := manifest.Parse(files)
	return checkAll(docs, problems)
}

func checkAll(docs []*manifest.Document, problems *manifest.Error) ([]*manifest.Document, error) {
	if problems == nil {
		problems = &manifest.Error{}
	}
	for _, d := range docs {
		CheckDocument(d, problems)
	}
	if len(problems.Problems) > 0 {
		return nil, problems
	}
	return docs, nil
}

// CheckDocument runs Validate on d's resource and adds its problems to
// errs, each at the line of its field.
func CheckDocument(d *manifest.Document, errs *manifest.Error) {
	err := Validate(d.Resource)
	if err == nil {
		return
	}
	var verr *Error
	if !errors.As(err, &verr) {
		errs.Add(d.File, d.Line, "", "%v", err)
		return
	}
	for _, f := range verr.Fields {
		errs.Add(d.File, d.FieldLine(f.Field), f.Field, "%s", f.Message)
	}
}
