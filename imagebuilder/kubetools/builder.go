package kubetools

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	_ "embed"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/filelock"
)

//go:embed pause/main.go
var pauseMain []byte

// ColdBuildEstimate is printed before a build from source: measured on the
// project's 2-core machines (see docs/kube-tools.md).
const ColdBuildEstimate = "cold build ≈ 30-40 min on 2 cores; ≈ 3-4 min with a warm Go build cache"

// Builder fills the cache with one release. The zero value is not usable:
// set Release and Cache; the other fields have defaults.
type Builder struct {
	Release Release
	Cache   Cache
	// Go is the go command; empty means "go" from PATH.
	Go string
	// Jobs limits build parallelism (go build -p and GOMAXPROCS); zero
	// keeps Go's defaults. Use 1 on a shared machine.
	Jobs int
	// Mirror, when set, is a base URL in the dl.k8s.io layout
	// (<Mirror>/<version>/bin/linux/<arch>/<name> and <name>.sha256) to
	// download from instead of building. etcd, coredns and pause are
	// downloaded when the mirror has them and built otherwise.
	Mirror string
	// Arch is the GOARCH of the binaries; empty means the build machine's.
	Arch string
	// Runner runs the go commands; nil means ExecRunner.
	Runner Runner
	// HTTP is the client for the mirror; nil means a default client.
	HTTP *http.Client
	// Env is the base environment of the go commands; nil means
	// os.Environ().
	Env []string
	// Log receives structured logs; nil discards them.
	Log *slog.Logger
	// Progress receives one human-readable line per step with the elapsed
	// time; nil discards them.
	Progress io.Writer

	start    time.Time
	verified bool // Ensure succeeded: the cache matches its manifest
}

func (b *Builder) arch() string {
	if b.Arch != "" {
		return b.Arch
	}
	return runtime.GOARCH
}

func (b *Builder) runner() Runner {
	if b.Runner != nil {
		return b.Runner
	}
	return ExecRunner{}
}

func (b *Builder) log() *slog.Logger {
	if b.Log != nil {
		return b.Log
	}
	return slog.New(slog.DiscardHandler)
}

// stepf prints one progress line prefixed with the elapsed time.
func (b *Builder) stepf(format string, args ...any) {
	if b.Progress == nil {
		return
	}
	el := time.Since(b.start).Round(100 * time.Millisecond)
	fmt.Fprintf(b.Progress, "[%8s] %s\n", el, fmt.Sprintf(format, args...))
}

// Ensure makes the cache hold b.Release and returns its manifest. A cache
// that verifies is returned as is (a few seconds: every binary is hashed).
// Otherwise the binaries are downloaded (Mirror set) or built into a
// temporary directory next to the cache, which replaces the version
// directory by rename only once complete: an interrupted or failed run never
// leaves a partial cache. Ensure blocks for the whole build (about 30 minutes
// cold on 2 cores) and holds a lock file so two runs do not build at once.
//
// Errors: InvalidArgument for a bad Release; NotFound when a mirror lacks a
// Kubernetes binary; FailedPrecondition when a download's sha256 does not
// match; Unavailable when the mirror fails; otherwise the failing step's
// error with the tail of its output.
func (b *Builder) Ensure(ctx context.Context) (*Manifest, error) {
	b.start = time.Now()
	b.verified = false
	r := b.Release
	if err := r.Validate(); err != nil {
		return nil, err
	}
	if b.Cache.Dir == "" {
		return nil, errdefs.InvalidArgument("kube-tools %s: no cache directory", r.Kubernetes)
	}
	if err := os.MkdirAll(b.Cache.Dir, 0o755); err != nil {
		return nil, fmt.Errorf("kube-tools %s: %w", r.Kubernetes, err)
	}
	// One lock per release: building the previous minor (30-40 min) must
	// not hold up a run that only verifies the pinned one.
	unlock, err := filelock.Lock(ctx, filepath.Join(b.Cache.Dir, ".lock-"+r.Kubernetes))
	if err != nil {
		return nil, fmt.Errorf("kube-tools %s: %w", r.Kubernetes, err)
	}
	defer unlock()

	m, err := b.Cache.Verify(r)
	if err == nil {
		b.stepf("kube-tools %s: cache %s verified (%d binaries), nothing to do", r.Kubernetes, b.Cache.VersionDir(r), len(m.Binaries))
		b.verified = true
		return m, nil
	}
	if !errdefs.IsNotFound(err) {
		b.stepf("rebuilding, the cache is not usable: %v", err)
	}
	b.removeLeftovers()

	tmp, err := os.MkdirTemp(b.Cache.Dir, "."+r.Kubernetes+".tmp-")
	if err != nil {
		return nil, fmt.Errorf("kube-tools %s: %w", r.Kubernetes, err)
	}
	defer os.RemoveAll(tmp) // gone after a successful rename
	if err := os.Chmod(tmp, 0o755); err != nil {
		return nil, fmt.Errorf("kube-tools %s: %w", r.Kubernetes, err)
	}
	binDir := filepath.Join(tmp, "bin")
	if err := os.Mkdir(binDir, 0o755); err != nil {
		return nil, fmt.Errorf("kube-tools %s: %w", r.Kubernetes, err)
	}

	m = &Manifest{Kubernetes: r.Kubernetes, Etcd: r.Etcd, CoreDNS: r.CoreDNS, Pause: r.Pause, Recipe: Recipe(r), Source: "go-module-proxy"}
	origin := map[string]string{}
	need := Binaries()
	if b.Mirror != "" {
		m.Source = "mirror " + redactURL(b.Mirror)
		got, err := b.download(ctx, binDir)
		if err != nil {
			return nil, err
		}
		need = need[:0:0]
		for _, name := range Binaries() {
			if got[name] {
				origin[name] = "downloaded"
			} else {
				need = append(need, name)
			}
		}
	}
	if len(need) > 0 {
		b.stepf("kube-tools %s: building %s from the Go module proxy (%s)", r.Kubernetes, strings.Join(need, ", "), ColdBuildEstimate)
		goVersion, err := b.build(ctx, binDir, need)
		if err != nil {
			return nil, err
		}
		m.GoVersion = goVersion
		for _, name := range need {
			origin[name] = "built"
		}
	}

	for _, name := range Binaries() {
		sum, size, err := fileSHA256(filepath.Join(binDir, name))
		if err != nil {
			return nil, fmt.Errorf("kube-tools %s: %s: %w", r.Kubernetes, name, err)
		}
		m.Binaries = append(m.Binaries, Binary{Name: name, Version: r.Version(name), SHA256: sum, Size: size, Origin: origin[name]})
	}
	mj, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("kube-tools %s: manifest: %w", r.Kubernetes, err)
	}
	if err := os.WriteFile(filepath.Join(tmp, ManifestFile), append(mj, '\n'), 0o644); err != nil {
		return nil, fmt.Errorf("kube-tools %s: manifest: %w", r.Kubernetes, err)
	}
	if err := b.commit(tmp); err != nil {
		return nil, err
	}
	b.stepf("kube-tools %s: done, cache in %s", r.Kubernetes, b.Cache.VersionDir(r))
	b.verified = true
	return m, nil
}

// commit replaces the version directory with tmp: a directory tree, so it
// is renamed into place rather than written with internal/atomicfile.
func (b *Builder) commit(tmp string) error {
	final := b.Cache.VersionDir(b.Release)
	var old string
	if _, err := os.Lstat(final); err == nil {
		old = filepath.Join(b.Cache.Dir, "."+b.Release.Kubernetes+".old-"+strconv.Itoa(os.Getpid()))
		if err := os.Rename(final, old); err != nil {
			return fmt.Errorf("kube-tools %s: move old cache aside: %w", b.Release.Kubernetes, err)
		}
	}
	if err := os.Rename(tmp, final); err != nil {
		return fmt.Errorf("kube-tools %s: install cache: %w", b.Release.Kubernetes, err)
	}
	if old != "" {
		if err := os.RemoveAll(old); err != nil {
			b.log().Warn("remove old cache", "dir", old, "err", err)
		}
	}
	return nil
}

// removeLeftovers deletes temporary directories of this release's runs that
// were killed (a defer does not run on SIGKILL). Called with the release's
// lock held; another release's build may be running next to it.
func (b *Builder) removeLeftovers() {
	v := b.Release.Kubernetes
	for _, pat := range []string{"." + v + ".tmp-*", "." + v + ".old-*"} {
		matches, _ := filepath.Glob(filepath.Join(b.Cache.Dir, pat))
		for _, m := range matches {
			b.log().Info("remove leftover of an interrupted run", "dir", m)
			if err := os.RemoveAll(m); err != nil {
				b.log().Warn("remove leftover", "dir", m, "err", err)
			}
		}
	}
}

// goEnv is the environment of every go command: static binaries for linux,
// no workspace, no toolchain switch.
func (b *Builder) goEnv(extra ...string) []string {
	base := b.Env
	if base == nil {
		base = os.Environ()
	}
	drop := map[string]bool{"GOFLAGS": true, "CGO_ENABLED": true, "GOOS": true, "GOARCH": true, "GOWORK": true, "GOTOOLCHAIN": true, "GOMAXPROCS": true, "GOBIN": true}
	var env []string
	for _, kv := range base {
		k, _, _ := strings.Cut(kv, "=")
		if !drop[k] {
			env = append(env, kv)
		}
	}
	env = append(env, "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+b.arch(), "GOWORK=off", "GOTOOLCHAIN=local", "GOFLAGS=-mod=mod")
	if b.Jobs > 0 {
		env = append(env, "GOMAXPROCS="+strconv.Itoa(b.Jobs))
	}
	return append(env, extra...)
}

// goCmd runs the go command in dir. On failure the error carries the last
// lines of its output.
func (b *Builder) goCmd(ctx context.Context, dir string, env []string, stdout io.Writer, args ...string) error {
	goTool := b.Go
	if goTool == "" {
		goTool = "go"
	}
	var out tailBuffer
	if stdout == nil {
		stdout = &out
	}
	b.log().Debug("run go", "dir", dir, "args", args)
	err := b.runner().Run(ctx, Cmd{Dir: dir, Env: env, Path: goTool, Args: args, Stdout: stdout, Stderr: &out})
	if err != nil {
		return fmt.Errorf("go %s: %w\n%s", strings.Join(args[:min(len(args), 2)], " "), err, out.String())
	}
	return nil
}

func (b *Builder) buildArgs(ldflags, out string, pkg string) []string {
	args := []string{"build", "-trimpath"}
	if b.Jobs > 0 {
		args = append(args, "-p", strconv.Itoa(b.Jobs))
	}
	return append(args, "-ldflags", ldflags, "-o", out, pkg)
}

// build builds the named binaries into binDir and returns the Go version.
func (b *Builder) build(ctx context.Context, binDir string, names []string) (string, error) {
	r := b.Release
	work := b.Cache.WorkDir(r)
	want := map[string]bool{}
	for _, n := range names {
		want[n] = true
	}

	var ver bytes.Buffer
	if err := b.goCmd(ctx, b.Cache.Dir, b.goEnv(), &ver, "env", "GOVERSION"); err != nil {
		return "", fmt.Errorf("kube-tools %s: %w", r.Kubernetes, err)
	}
	goVersion := strings.TrimSpace(ver.String())

	total, n := len(names), 0
	buildOne := func(name, dir, ldflags, pkg string) error {
		n++
		b.stepf("building %s (%d/%d)", name, n, total)
		t0 := time.Now()
		if err := b.goCmd(ctx, dir, b.goEnv(), nil, b.buildArgs(ldflags, filepath.Join(binDir, name), pkg)...); err != nil {
			return fmt.Errorf("kube-tools %s: build %s: %w", r.Kubernetes, name, err)
		}
		b.stepf("built %s in %s", name, time.Since(t0).Round(time.Second))
		return nil
	}

	needK8s := false
	for _, name := range KubernetesBinaries() {
		needK8s = needK8s || want[name]
	}
	if needK8s {
		dir := filepath.Join(work, "kubernetes")
		if err := b.prepareKubernetes(ctx, dir); err != nil {
			return "", err
		}
		for _, name := range KubernetesBinaries() {
			if want[name] {
				if err := buildOne(name, dir, KubernetesLDFlags(r), "k8s.io/kubernetes/cmd/"+name); err != nil {
					return "", err
				}
			}
		}
	}
	if want[Etcd] {
		dir := filepath.Join(work, "etcd")
		if err := b.writeModule(ctx, dir, "etcd "+r.EtcdModuleVersion(), EtcdGoMod(r), map[string][]byte{"main.go": EtcdMain()}); err != nil {
			return "", err
		}
		if err := buildOne(Etcd, dir, EtcdLDFlags(r), "."); err != nil {
			return "", err
		}
	}
	if want[CoreDNS] {
		// go install pkg@version builds with CoreDNS's own go.mod, exactly
		// as its maintainers resolved it.
		n++
		b.stepf("building %s %s (%d/%d)", CoreDNS, r.CoreDNS, n, total)
		t0 := time.Now()
		gobin, err := os.MkdirTemp(filepath.Dir(binDir), "gobin-")
		if err != nil {
			return "", fmt.Errorf("kube-tools %s: %w", r.Kubernetes, err)
		}
		args := []string{"install", "-trimpath"}
		if b.Jobs > 0 {
			args = append(args, "-p", strconv.Itoa(b.Jobs))
		}
		args = append(args, "-ldflags", CoreDNSLDFlags(r), "github.com/coredns/coredns@"+r.CoreDNS)
		// go install pkg@version refuses -mod=mod; GOBIN only works for
		// the build machine's own GOOS/GOARCH.
		if err := b.goCmd(ctx, b.Cache.Dir, b.goEnv("GOFLAGS=", "GOBIN="+gobin), nil, args...); err != nil {
			return "", fmt.Errorf("kube-tools %s: build coredns: %w", r.Kubernetes, err)
		}
		if err := os.Rename(filepath.Join(gobin, "coredns"), filepath.Join(binDir, CoreDNS)); err != nil {
			return "", fmt.Errorf("kube-tools %s: build coredns: %w", r.Kubernetes, err)
		}
		os.Remove(gobin)
		b.stepf("built %s in %s", CoreDNS, time.Since(t0).Round(time.Second))
	}
	if want[Pause] {
		dir := filepath.Join(work, "pause")
		if err := b.writeModule(ctx, dir, "", PauseGoMod(), map[string][]byte{"main.go": pauseMain}); err != nil {
			return "", err
		}
		if err := buildOne(Pause, dir, StripFlags, "."); err != nil {
			return "", err
		}
	}
	return goVersion, nil
}

// prepareKubernetes writes the tools module that builds Kubernetes: it reads
// the staging modules from kubernetes' own go.mod in the module cache.
func (b *Builder) prepareKubernetes(ctx context.Context, dir string) error {
	r := b.Release
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("kube-tools %s: %w", r.Kubernetes, err)
	}
	// A placeholder module keeps `go mod download` from resolving against
	// any module above the cache directory.
	if _, err := os.Stat(filepath.Join(dir, "go.mod")); os.IsNotExist(err) {
		if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module kiln.local/kube-tools\n\ngo 1.24.0\n"), 0o644); err != nil {
			return fmt.Errorf("kube-tools %s: %w", r.Kubernetes, err)
		}
	}
	b.stepf("downloading k8s.io/kubernetes@%s", r.Kubernetes)
	var out bytes.Buffer
	if err := b.goCmd(ctx, dir, b.goEnv(), &out, "mod", "download", "-json", "k8s.io/kubernetes@"+r.Kubernetes); err != nil {
		return fmt.Errorf("kube-tools %s: download k8s.io/kubernetes: %w", r.Kubernetes, err)
	}
	var info struct {
		GoMod string
		Error string
	}
	if err := json.Unmarshal(out.Bytes(), &info); err != nil {
		return fmt.Errorf("kube-tools %s: go mod download: %w", r.Kubernetes, err)
	}
	if info.Error != "" || info.GoMod == "" {
		return errdefs.Unavailable("kube-tools %s: go mod download k8s.io/kubernetes: %s", r.Kubernetes, info.Error)
	}
	kgomod, err := os.ReadFile(info.GoMod)
	if err != nil {
		return fmt.Errorf("kube-tools %s: %w", r.Kubernetes, err)
	}
	staging, err := StagingModules(kgomod)
	if err != nil {
		return fmt.Errorf("kube-tools %s: %w", r.Kubernetes, err)
	}
	b.log().Info("staging modules", "count", len(staging))
	return b.writeModule(ctx, dir, fmt.Sprintf("kubernetes %s with %d staging modules at %s", r.Kubernetes, len(staging), r.Staging),
		ToolsGoMod(r, staging), map[string][]byte{"tools.go": ToolsGo()})
}

// writeModule writes a module's go.mod and sources into dir and resolves
// its dependencies with go mod tidy. An unchanged go.mod with a go.sum is
// not tidied again.
func (b *Builder) writeModule(ctx context.Context, dir, what string, gomod []byte, files map[string][]byte) error {
	r := b.Release
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("kube-tools %s: %w", r.Kubernetes, err)
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			return fmt.Errorf("kube-tools %s: %w", r.Kubernetes, err)
		}
	}
	// tidy rewrites go.mod; keep what was generated next to it to notice a
	// change of pins.
	gen := filepath.Join(dir, "go.mod.generated")
	prev, _ := os.ReadFile(gen)
	_, sumErr := os.Stat(filepath.Join(dir, "go.sum"))
	if bytes.Equal(prev, gomod) && sumErr == nil {
		return nil
	}
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), gomod, 0o644); err != nil {
		return fmt.Errorf("kube-tools %s: %w", r.Kubernetes, err)
	}
	if what != "" {
		b.stepf("resolving module %s (go mod tidy)", what)
	}
	if err := b.goCmd(ctx, dir, b.goEnv(), nil, "mod", "tidy"); err != nil {
		return fmt.Errorf("kube-tools %s: %s: %w", r.Kubernetes, dir, err)
	}
	if err := os.WriteFile(gen, gomod, 0o644); err != nil {
		return fmt.Errorf("kube-tools %s: %w", r.Kubernetes, err)
	}
	return nil
}

// tailBuffer keeps the last 4 KiB written to it.
type tailBuffer struct{ b []byte }

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.b = append(t.b, p...)
	if over := len(t.b) - 4096; over > 0 {
		t.b = t.b[over:]
	}
	return len(p), nil
}

func (t *tailBuffer) String() string { return string(t.b) }
