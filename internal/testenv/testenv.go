// Package testenv is how a test says the machine lacks something it needs
// (root, a tool, a file, a kernel feature, a cache): normally the test skips
// with that reason; with KILN_NO_SKIP=1 in the environment (CI, as root with
// hack/deps.sh run) it fails with the same reason, so a suite that passes
// has run every test.
//
// Only gaps in the environment go through testenv. A test skipped by
// choice stays a plain t.Skip: testing.Short() (the fast tier), a helper
// process that only runs as a child of another test, a test opted into by a
// KILN_* variable, a GOOS or CPU-specific path.
package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"testing"
)

// NoSkipVar is the environment variable that turns an environment skip
// into a failure: any value but "" and "0" turns it on.
const NoSkipVar = "KILN_NO_SKIP"

// NoSkip reports whether KILN_NO_SKIP asks for failures instead of skips.
func NoSkip() bool {
	v := os.Getenv(NoSkipVar)
	return v != "" && v != "0"
}

// Skipf skips t because the machine lacks what the test needs, with the
// reason formatted as by fmt.Sprintf; under KILN_NO_SKIP=1 it fails t with
// "KILN_NO_SKIP=1: " and the reason instead. Either way the test stops
// (runtime.Goexit), so Skipf must be called from the test's goroutine.
func Skipf(t testing.TB, format string, args ...any) {
	t.Helper()
	reason := fmt.Sprintf(format, args...)
	if NoSkip() {
		t.Fatalf("%s=1: %s", NoSkipVar, reason)
		return
	}
	t.Skip(reason)
}

// Skip is Skipf with the reason formatted as by fmt.Sprint.
func Skip(t testing.TB, args ...any) {
	t.Helper()
	Skipf(t, "%s", fmt.Sprint(args...))
}

// RequireRoot skips t (fails it under KILN_NO_SKIP=1) unless the test runs
// as root. why completes the reason "needs root ...", e.g. "to run
// containerd" or "for network namespaces".
func RequireRoot(t testing.TB, why string) {
	t.Helper()
	if os.Geteuid() != 0 {
		Skipf(t, "needs root %s", why)
	}
}

// RequireTool returns the path of tool on PATH, or skips t (fails it under
// KILN_NO_SKIP=1) naming pkgs, the Debian package(s) that install it as
// apt-get install takes them (hack/deps.sh installs them in CI).
func RequireTool(t testing.TB, tool, pkgs string) string {
	t.Helper()
	p, err := exec.LookPath(tool)
	if err != nil {
		Skipf(t, "%s not installed (apt-get install %s)", tool, pkgs)
	}
	return p
}

// RequireFile skips t (fails it under KILN_NO_SKIP=1) unless path exists.
// hint says how to make it exist, e.g. "run make kube-tools".
func RequireFile(t testing.TB, path, hint string) {
	t.Helper()
	if _, err := os.Stat(path); err != nil {
		Skipf(t, "%v (%s)", err, hint)
	}
}
