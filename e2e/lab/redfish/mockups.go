package redfish

import (
	"os"
	"path/filepath"
	"sort"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// MockupsDir finds a directory of DMTF Redfish mockup trees (each a
// subdirectory whose index.json is a service root, such as
// public-rackmount1): $KILN_REDFISH_MOCKUPS when set, else
// shared/fixtures/redfish-mockups beside the repository (where CI and the
// lab machines keep it).
//
// It returns errdefs.NotFound when the variable is unset and the fixtures
// are not there (tests skip), and errdefs.FailedPrecondition when the
// variable is set but names no directory holding a tree (tests fail: a
// mistyped path must not silently skip every mockup test).
func MockupsDir() (string, error) {
	if d := os.Getenv("KILN_REDFISH_MOCKUPS"); d != "" {
		trees, err := MockupTrees(d)
		if err != nil || len(trees) == 0 {
			return "", errdefs.FailedPrecondition("KILN_REDFISH_MOCKUPS=%s holds no Redfish mockup tree (a directory with index.json, such as public-rackmount1)", d)
		}
		return d, nil
	}
	if wd, err := os.Getwd(); err == nil {
		for d := wd; ; d = filepath.Dir(d) {
			if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
				cand := filepath.Join(filepath.Dir(d), "shared", "fixtures", "redfish-mockups")
				if trees, _ := MockupTrees(cand); len(trees) > 0 {
					return cand, nil
				}
				break
			}
			if filepath.Dir(d) == d {
				break
			}
		}
	}
	return "", errdefs.NotFound("DMTF Redfish mockups not found: set KILN_REDFISH_MOCKUPS to the directory holding the trees (public-rackmount1 ...), or keep shared/fixtures/redfish-mockups beside the repository")
}

// MockupTrees lists the mockup trees in dir: the subdirectories that hold
// an index.json, sorted.
func MockupTrees(dir string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var trees []string
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		if _, err := os.Stat(filepath.Join(dir, e.Name(), "index.json")); err == nil {
			trees = append(trees, e.Name())
		}
	}
	sort.Strings(trees)
	return trees, nil
}
