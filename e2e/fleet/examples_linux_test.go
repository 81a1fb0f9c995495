package fleet_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestExamplesNameNoLabTagDate checks the premise of the lab tests: their
// lab image's tag date (labTagDate) appears in no file of examples/, so
// provisioning the shipped examples proves that they do not depend on the
// day they were written.
func TestExamplesNameNoLabTagDate(t *testing.T) {
	root := filepath.Join(repoRoot(), "examples")
	n := 0
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		n++
		if strings.Contains(string(b), labTagDate) {
			t.Errorf("%s names %s, the lab tests' tag date: choose another labTagDate", p, labTagDate)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n == 0 {
		t.Fatalf("no files under %s", root)
	}
}
