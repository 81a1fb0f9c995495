// Package agent_test holds checks over the whole agent binary.
package agent_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/kilnhq/kiln/internal/testenv"
)

// TestAgentDependencies keeps the agent binary lean: it must never link
// the controller, the etcd server, bmclib or client-go (ARCHITECTURE.md).
func TestAgentDependencies(t *testing.T) {
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := exec.LookPath(goBin); err != nil {
		if goBin, err = exec.LookPath("go"); err != nil {
			testenv.Skip(t, "go tool not found: cannot list the agent's dependencies")
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

// releaseTags are the build tags the Makefile builds kiln-agent with
// (TAGS_kiln-agent).
const releaseTags = "grpcnotrace"

// TestAgentKeepsMethodPruning keeps the linker's dead-code elimination of
// methods working for the agent. When any reachable function calls
// reflect's Method or MethodByName with a name known only at run time
// (text/template and html/template execution do), the linker must keep
// every exported method of every type the binary uses: the agent grows
// by 2.4 MiB, and since its pages are resident, so does its idle memory
// (docs/bench/agent.md). The failure names the call chain that brought
// such a function in.
func TestAgentKeepsMethodPruning(t *testing.T) {
	if testing.Short() {
		t.Skip("links the agent binary: skipped in -short")
	}
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := exec.LookPath(goBin); err != nil {
		if goBin, err = exec.LookPath("go"); err != nil {
			testenv.Skip(t, "go tool not found: cannot link the agent")
		}
	}
	// -dumpdep prints every edge of the linker's reachability walk as
	// "from -> to", each symbol once, with the parent that reached it first.
	cmd := exec.Command(goBin, "build", "-tags", releaseTags, "-ldflags=-dumpdep", "-o", os.DevNull, "github.com/kilnhq/kiln/cmd/kiln-agent")
	cmd.Env = append(cmd.Environ(), "CGO_ENABLED=0")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("go build -ldflags=-dumpdep ./cmd/kiln-agent: %v\n%s", err, tail(out))
	}
	const flag = " <ReflectMethod>"
	parent := map[string]string{}
	var culprits []string
	for _, line := range strings.Split(string(out), "\n") {
		from, to, ok := strings.Cut(line, " -> ")
		if !ok {
			continue
		}
		from, _, _ = strings.Cut(from, " <")
		to, flags, _ := strings.Cut(to, " <")
		if _, seen := parent[to]; !seen {
			parent[to] = from
		}
		if strings.Contains(" <"+flags, flag) && !slices.Contains(culprits, to) {
			culprits = append(culprits, to)
		}
	}
	// reflect's own Method functions carry the flag too; report the
	// callers that brought them in when there are any.
	inReflect := func(c string) bool { return strings.HasPrefix(c, "reflect.") }
	if slices.ContainsFunc(culprits, func(c string) bool { return !inReflect(c) }) {
		culprits = slices.DeleteFunc(culprits, inReflect)
	}
	if len(culprits) > 3 {
		t.Errorf("%d functions call reflect Method/MethodByName by a run-time name; the first three:", len(culprits))
		culprits = culprits[:3]
	}
	for _, c := range culprits {
		chain := []string{c}
		for s := parent[c]; s != "" && s != "_" && len(chain) < 40; s = parent[s] {
			chain = append(chain, s)
		}
		slices.Reverse(chain)
		t.Errorf("kiln-agent reaches %s, which calls reflect Method/MethodByName by a run-time name, so the linker keeps every exported method (+2.4 MiB). Reached through:\n  %s", c, strings.Join(chain, "\n  -> "))
	}
}

// tail returns the last lines of a long command output.
func tail(out []byte) string {
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) > 20 {
		lines = lines[len(lines)-20:]
	}
	return strings.Join(lines, "\n")
}
