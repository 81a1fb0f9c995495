package layers_test

import (
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/kilnhq/kiln/internal/testenv"
)

const module = "github.com/kilnhq/kiln/"

// rules says, for packages under a prefix of the module, which prefixes
// of the module they must not import (non-test imports).
var rules = []struct {
	from   string
	forbid []string
	why    string
}{
	{"internal/", []string{"agent/", "bmc/", "cmd/", "controller/", "e2e/", "host/", "imagebuilder/"},
		"internal/ holds leaves: small shared pieces that import nothing else of Kiln"},
	{"controller/", []string{"agent/", "cmd/", "e2e/"},
		"the controller reaches agents through the proto clients it owns (controller/agentclient)"},
	{"agent/", []string{"controller/", "bmc/", "cmd/", "e2e/"},
		"the agent binary must not link the controller or bmclib"},
	{"host/", []string{"agent/", "controller/", "bmc/", "cmd/", "e2e/"},
		"host/ is the agent's Linux layer and knows nothing above it"},
	{"bmc/", []string{"agent/", "controller/", "cmd/", "e2e/", "host/"},
		"bmc/ is the only user of bmclib and a leaf below the controller"},
}

// root is the controller's root package: it assembles a replica (Config,
// New, Run) from the packages under controller/, so none of them imports
// it, except test-support packages (controller/controllertest).
const root = "controller"

// TestImportLayering lists every package's imports (for linux and darwin)
// and fails on an import a rule forbids, naming both packages and the rule.
// Test-support packages (named *test, like host/systemd/systemdtest) may
// use the lab under e2e/ and the controller's root: only tests link them.
func TestImportLayering(t *testing.T) {
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := exec.LookPath(goBin); err != nil {
		if goBin, err = exec.LookPath("go"); err != nil {
			testenv.Skip(t, "go tool not found: cannot list the packages' imports")
		}
	}
	checked := 0
	for _, goos := range []string{"linux", "darwin"} {
		cmd := exec.Command(goBin, "list", "-f", "{{.ImportPath}} {{join .Imports \" \"}}", module+"...")
		cmd.Dir = "../.."
		cmd.Env = append(cmd.Environ(), "GOOS="+goos)
		out, err := cmd.Output()
		if err != nil {
			var stderr []byte
			if ee, ok := err.(*exec.ExitError); ok {
				stderr = ee.Stderr
			}
			t.Fatalf("go list (GOOS=%s): %v\n%s", goos, err, stderr)
		}
		for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			f := strings.Fields(line)
			if len(f) == 0 {
				continue
			}
			from := strings.TrimPrefix(f[0], module)
			for _, r := range rules {
				if !strings.HasPrefix(from, r.from) {
					continue
				}
				checked++
				for _, imp := range f[1:] {
					to, ok := strings.CutPrefix(imp, module)
					if !ok {
						continue
					}
					if r.from == "controller/" && to == root && !strings.HasSuffix(from, "test") {
						t.Errorf("GOOS=%s: %s imports %s: the root package assembles a replica from the packages under controller/; none of them imports it", goos, from, to)
					}
					for _, bad := range r.forbid {
						if bad == "e2e/" && strings.HasSuffix(from, "test") {
							continue
						}
						if strings.HasPrefix(to, bad) {
							t.Errorf("GOOS=%s: %s imports %s: %s", goos, from, to, r.why)
						}
					}
				}
			}
		}
	}
	if checked < 50 {
		t.Fatalf("checked only %d packages against the rules: go list found too few", checked)
	}
}
