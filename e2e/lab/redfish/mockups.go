package redfish

import (
	"os"
	"path/filepath"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// MockupsDir finds the DMTF Redfish mockup trees (public-rackmount1,
// public-tower, public-bladed, public-telemetry): $KILN_REDFISH_MOCKUPS,
// else shared/fixtures/redfish-mockups beside the repository (where CI and
// the lab machines keep it). It returns errdefs.NotFound when neither has
// them.
func MockupsDir() (string, error) {
	cands := []string{os.Getenv("KILN_REDFISH_MOCKUPS")}
	if wd, err := os.Getwd(); err == nil {
		for d := wd; ; d = filepath.Dir(d) {
			if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
				cands = append(cands, filepath.Join(filepath.Dir(d), "shared", "fixtures", "redfish-mockups"))
				break
			}
			if filepath.Dir(d) == d {
				break
			}
		}
	}
	for _, d := range cands {
		if d == "" {
			continue
		}
		if _, err := os.Stat(filepath.Join(d, "public-rackmount1", "index.json")); err == nil {
			return d, nil
		}
	}
	return "", errdefs.NotFound("DMTF Redfish mockups not found: set KILN_REDFISH_MOCKUPS to the directory holding public-rackmount1, or keep shared/fixtures/redfish-mockups beside the repository")
}
