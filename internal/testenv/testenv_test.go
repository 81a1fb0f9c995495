package testenv

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"
)

// recorder is a testing.TB that records whether the code under test skipped
// or failed, and stops the calling goroutine as the real ones do. Any other
// method of testing.TB panics (nil embedded interface).
type recorder struct {
	testing.TB
	skipped, failed bool
	msg             string
}

func (r *recorder) Helper() {}

func (r *recorder) Skip(args ...any) {
	r.skipped, r.msg = true, args[0].(string)
	runtime.Goexit()
}

func (r *recorder) Fatalf(format string, args ...any) {
	r.failed = true
	r.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// run calls f with a recorder on its own goroutine, as the testing package
// runs a test, and returns what f did to it.
func run(f func(testing.TB)) *recorder {
	r := &recorder{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		f(r)
	}()
	<-done
	return r
}

func TestSkipOrFail(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing")
	present := t.TempDir()
	for _, tc := range []struct {
		name      string
		noSkip    string
		call      func(testing.TB)
		wantSkip  bool
		wantFatal bool
		wantMsg   string
	}{
		{name: "Skipf skips", call: func(tb testing.TB) { Skipf(tb, "no %s", "ipmi_sim") },
			wantSkip: true, wantMsg: "no ipmi_sim"},
		{name: "Skipf fails under KILN_NO_SKIP=1", noSkip: "1", call: func(tb testing.TB) { Skipf(tb, "no %s", "ipmi_sim") },
			wantFatal: true, wantMsg: "KILN_NO_SKIP=1: no ipmi_sim"},
		{name: "KILN_NO_SKIP=0 still skips", noSkip: "0", call: func(tb testing.TB) { Skipf(tb, "no %s", "ipmi_sim") },
			wantSkip: true, wantMsg: "no ipmi_sim"},
		{name: "Skip formats as Sprint", noSkip: "1", call: func(tb testing.TB) { Skip(tb, "no mockups: ", 3) },
			wantFatal: true, wantMsg: "KILN_NO_SKIP=1: no mockups: 3"},
		{name: "missing tool skips naming its package", call: func(tb testing.TB) { RequireTool(tb, "kiln-no-such-tool", "kiln-pkg") },
			wantSkip: true, wantMsg: "kiln-no-such-tool not installed (apt-get install kiln-pkg)"},
		{name: "missing tool fails under KILN_NO_SKIP=1", noSkip: "1", call: func(tb testing.TB) { RequireTool(tb, "kiln-no-such-tool", "kiln-pkg") },
			wantFatal: true, wantMsg: "KILN_NO_SKIP=1: kiln-no-such-tool not installed (apt-get install kiln-pkg)"},
		{name: "present tool passes", noSkip: "1", call: func(tb testing.TB) {
			if RequireTool(tb, "go", "golang") == "" {
				panic("RequireTool returned no path for a tool on PATH")
			}
		}},
		{name: "missing file fails under KILN_NO_SKIP=1", noSkip: "1", call: func(tb testing.TB) { RequireFile(tb, missing, "run make kube-tools") },
			wantFatal: true, wantMsg: "KILN_NO_SKIP=1: stat " + missing + ": no such file or directory (run make kube-tools)"},
		{name: "present file passes", noSkip: "1", call: func(tb testing.TB) { RequireFile(tb, present, "unused") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(NoSkipVar, tc.noSkip)
			r := run(tc.call)
			if r.skipped != tc.wantSkip || r.failed != tc.wantFatal || r.msg != tc.wantMsg {
				t.Errorf("skipped, failed, message = %v, %v, %q; want %v, %v, %q", r.skipped, r.failed, r.msg, tc.wantSkip, tc.wantFatal, tc.wantMsg)
			}
		})
	}
}

// TestRequireRoot checks the reason and the switch on whichever side of
// root this test runs: as root nothing happens, otherwise it skips or,
// under KILN_NO_SKIP=1, fails.
func TestRequireRoot(t *testing.T) {
	for _, noSkip := range []string{"", "1"} {
		t.Setenv(NoSkipVar, noSkip)
		r := run(func(tb testing.TB) { RequireRoot(tb, "to run containerd") })
		want := &recorder{}
		if os.Geteuid() != 0 {
			want.msg = "needs root to run containerd"
			want.skipped = noSkip == ""
			if noSkip != "" {
				want.failed, want.msg = true, "KILN_NO_SKIP=1: "+want.msg
			}
		}
		if r.skipped != want.skipped || r.failed != want.failed || r.msg != want.msg {
			t.Errorf("KILN_NO_SKIP=%q: RequireRoot: skipped, failed, message = %v, %v, %q; want %v, %v, %q",
				noSkip, r.skipped, r.failed, r.msg, want.skipped, want.failed, want.msg)
		}
	}
}
