// Package agent_test holds checks over the whole agent binary.
package agent_test

import (
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// TestAgentDependencies keeps the agent binary lean: it must never link
// the controller, the etcd server, bmclib or client-go (ARCHITECTURE.md).
func TestAgentDependencies(t *testing.T) {
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := exec.LookPath(goBin); err != nil {
		if goBin, err = exec.LookPath("go"); err != nil {
			t.Skip("go tool not found: cannot list the agent's dependencies")
		}
	}
	for _, goos := range []string{"linux", "darwin"} {
		cmd := exec.Command(goBin, "list", "-deps", "github.com/kilnhq/kiln/cmd/kiln-agent")
		cmd.Env = append(cmd.Environ(), "GOOS="+goos)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("go list -deps ./cmd/kiln-agent (GOOS=%s): %v", goos, err)
		}
		forbidden := []string{
			"go.etcd.io/etcd/server",
			"github.com/kilnhq/kiln/controller",
			"github.com/bmc-toolbox/bmclib",
			"k8s.io/client-go",
		}
		for _, pkg := range strings.Fields(string(out)) {
			for _, f := range forbidden {
				if pkg == f || strings.HasPrefix(pkg, f+"/") {
					t.Errorf("GOOS=%s: kiln-agent links %s (forbidden prefix %s); find the import with: go list -deps -f '{{.ImportPath}}: {{.Imports}}' ./cmd/kiln-agent", goos, pkg, f)
				}
			}
		}
	}
}
