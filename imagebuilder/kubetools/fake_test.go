package kubetools

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
)

// fakeGo stands in for the go command: building Kubernetes takes half an
// hour, so these tests check the builder's orchestration (what it runs, in
// which module, with which flags, and what it leaves behind on failure). It
// writes a small distinct file for every binary and can fail any build.
type fakeGo struct {
	t         testing.TB
	kubeGoMod string
	// pad, when set, is appended to every written binary (benchmarks).
	pad []byte

	mu        sync.Mutex
	calls     []Cmd
	failBuild string // base name of the output whose build fails
}

var _ Runner = (*fakeGo)(nil)

func newFakeGo(t testing.TB) *fakeGo {
	p, err := filepath.Abs("testdata/kubernetes-v1.34.4.go.mod")
	if err != nil {
		t.Fatal(err)
	}
	return &fakeGo{t: t, kubeGoMod: p}
}

func (f *fakeGo) Run(ctx context.Context, c Cmd) error {
	f.mu.Lock()
	f.calls = append(f.calls, c)
	fail := f.failBuild
	f.mu.Unlock()
	if err := ctx.Err(); err != nil {
		return err
	}
	if c.Path == "ldd" {
		return ExecRunner{}.Run(ctx, c)
	}
	a := c.Args
	switch {
	case len(a) >= 2 && a[0] == "env" && a[1] == "GOVERSION":
		fmt.Fprintln(c.Stdout, "go1.26.8")
	case len(a) >= 2 && a[0] == "mod" && a[1] == "download":
		fmt.Fprintf(c.Stdout, "{\n\t\"Path\": \"k8s.io/kubernetes\",\n\t\"GoMod\": %q\n}\n", f.kubeGoMod)
	case len(a) >= 2 && a[0] == "mod" && a[1] == "tidy":
		return os.WriteFile(filepath.Join(c.Dir, "go.sum"), []byte("fake\n"), 0o644)
	case a[0] == "build":
		out := a[slices.Index(a, "-o")+1]
		if filepath.Base(out) == fail {
			_ = os.WriteFile(out, []byte("partial"), 0o755)
			fmt.Fprintln(c.Stderr, "compile: injected failure")
			return errors.New("exit status 1")
		}
		return os.WriteFile(out, append([]byte("built "+a[len(a)-1]+" in "+filepath.Base(c.Dir)), f.pad...), 0o755)
	case a[0] == "install":
		gobin := envValue(c.Env, "GOBIN")
		if fail == CoreDNS {
			return errors.New("exit status 1")
		}
		return os.WriteFile(filepath.Join(gobin, "coredns"), append([]byte("built "+a[len(a)-1]), f.pad...), 0o755)
	default:
		f.t.Errorf("fake go: unexpected command go %s", strings.Join(a, " "))
		return errors.New("unexpected")
	}
	return nil
}

// builds returns the go build/install calls made so far.
func (f *fakeGo) builds() []Cmd {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []Cmd
	for _, c := range f.calls {
		if c.Args[0] == "build" || c.Args[0] == "install" {
			out = append(out, c)
		}
	}
	return out
}

func (f *fakeGo) reset() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = nil
}

func (f *fakeGo) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.calls)
}

// envValue returns the last value of key in env, as exec uses it.
func envValue(env []string, key string) string {
	v := ""
	for _, kv := range env {
		if k, val, ok := strings.Cut(kv, "="); ok && k == key {
			v = val
		}
	}
	return v
}

func argValue(args []string, flag string) string {
	if i := slices.Index(args, flag); i >= 0 && i+1 < len(args) {
		return args[i+1]
	}
	return ""
}
