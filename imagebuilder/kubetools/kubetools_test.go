package kubetools

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
)

func TestStagingModulesOfKubernetes(t *testing.T) {
	gomod, err := os.ReadFile("testdata/kubernetes-v1.34.4.go.mod")
	require.NoError(t, err)
	mods, err := StagingModules(gomod)
	require.NoError(t, err)
	if len(mods) != 31 {
		t.Errorf("StagingModules(kubernetes v1.34.4) = %d modules, want 31: %v", len(mods), mods)
	}
	for _, m := range []string{"k8s.io/api", "k8s.io/client-go", "k8s.io/component-base", "k8s.io/kubectl", "k8s.io/sample-controller"} {
		if !slices.Contains(mods, m) {
			t.Errorf("StagingModules(kubernetes v1.34.4) lacks %s", m)
		}
	}
	for _, m := range []string{"k8s.io/klog/v2", "k8s.io/utils", "k8s.io/kube-openapi"} {
		if slices.Contains(mods, m) {
			t.Errorf("StagingModules(kubernetes v1.34.4) lists %s, which is not a staging module", m)
		}
	}
}

func TestStagingModules(t *testing.T) {
	tests := []struct {
		name  string
		gomod string
		want  []string
	}{
		{name: "block", gomod: "module k8s.io/kubernetes\nreplace (\n\tk8s.io/client-go => ./staging/src/k8s.io/client-go\n\tk8s.io/api => ./staging/src/k8s.io/api\n)\n", want: []string{"k8s.io/api", "k8s.io/client-go"}},
		{name: "single line", gomod: "module k8s.io/kubernetes\nreplace k8s.io/api => ./staging/src/k8s.io/api\n", want: []string{"k8s.io/api"}},
		{name: "versioned left side", gomod: "replace k8s.io/api v0.0.0 => ./staging/src/k8s.io/api\n", want: []string{"k8s.io/api"}},
		{name: "other replaces ignored", gomod: "replace (\n\tgithub.com/x/y => github.com/x/y v1.0.0\n\tk8s.io/api => ./staging/src/k8s.io/api\n)\n", want: []string{"k8s.io/api"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := StagingModules([]byte(tt.gomod))
			require.NoError(t, err)
			if !slices.Equal(got, tt.want) {
				t.Errorf("StagingModules(%q) = %v, want %v", tt.gomod, got, tt.want)
			}
		})
	}
	if _, err := StagingModules([]byte("module x\nrequire k8s.io/api v0.0.0\n")); !errdefs.IsInvalidArgument(err) {
		t.Errorf("StagingModules(no replaces) = %v, want InvalidArgument", err)
	}
}

func TestToolsGoMod(t *testing.T) {
	got := string(ToolsGoMod(Pinned(), []string{"k8s.io/api", "k8s.io/client-go"}))
	for _, want := range []string{
		"module kiln.local/kube-tools\n",
		"require k8s.io/kubernetes v1.34.4\n",
		"\tk8s.io/api => k8s.io/api v0.34.4\n",
		"\tk8s.io/client-go => k8s.io/client-go v0.34.4\n",
		"godebug default=go1.24\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("ToolsGoMod() = %q, want it to contain %q", got, want)
		}
	}
	tools := string(ToolsGo())
	for _, name := range KubernetesBinaries() {
		if !strings.Contains(tools, `"k8s.io/kubernetes/cmd/`+name+`"`) {
			t.Errorf("ToolsGo() does not import cmd/%s:\n%s", name, tools)
		}
	}
}

func TestKubernetesLDFlags(t *testing.T) {
	got := strings.Fields(KubernetesLDFlags(Pinned()))
	if !slices.Contains(got, "-s") || !slices.Contains(got, "-w") {
		t.Errorf("KubernetesLDFlags() = %v, want -s -w like upstream release builds", got)
	}
	for _, pkg := range []string{"k8s.io/client-go/pkg/version", "k8s.io/component-base/version"} {
		for _, kv := range []string{"gitVersion=v1.34.4", "gitMajor=1", "gitMinor=34", "gitTreeState=clean", "buildDate=2026-02-10T12:53:36Z", "gitCommit=0000000000000000000000000000000000000000"} {
			want := pkg + "." + kv
			if !slices.Contains(got, want) {
				t.Errorf("KubernetesLDFlags() = %v, want -X %s", got, want)
			}
		}
	}
}

func TestReleaseVersions(t *testing.T) {
	r := Pinned()
	tests := []struct {
		name, got, want string
	}{
		{"Minor", r.Minor(), "34"},
		{"EtcdModuleVersion", r.EtcdModuleVersion(), "v3.6.5"},
		{"Version(etcd)", r.Version(Etcd), "3.6.5-0"},
		{"Version(kubelet)", r.Version(Kubelet), "v1.34.4"},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("%s = %q, want %q", tt.name, tt.got, tt.want)
		}
	}
	require.NoError(t, r.Validate())
	bad := r
	bad.Etcd = ""
	if err := bad.Validate(); !errdefs.IsInvalidArgument(err) {
		t.Errorf("Validate(no etcd) = %v, want InvalidArgument", err)
	}
}

func newTestBuilder(t *testing.T, fake *fakeGo) (*Builder, *bytes.Buffer) {
	var progress bytes.Buffer
	return &Builder{
		Release:  Pinned(),
		Cache:    Cache{Dir: filepath.Join(t.TempDir(), "kube-tools")},
		Go:       "go",
		Jobs:     1,
		Runner:   fake,
		Env:      []string{"PATH=/usr/bin", "GOFLAGS=-buildvcs=false", "CGO_ENABLED=1"},
		Progress: &progress,
	}, &progress
}

// dirNames lists a directory's entries.
func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names
}

func TestEnsureBuildsThenUsesCache(t *testing.T) {
	fake := newFakeGo(t)
	b, progress := newTestBuilder(t, fake)
	ctx := context.Background()

	m, err := b.Ensure(ctx)
	require.NoError(t, err)
	t.Log(progress.String())

	// The manifest lists all ten binaries with the sha256 of the files.
	var names []string
	for _, bin := range m.Binaries {
		names = append(names, bin.Name)
		sum, size, err := fileSHA256(filepath.Join(b.Cache.BinDir(b.Release), bin.Name))
		require.NoError(t, err)
		if sum != bin.SHA256 || size != bin.Size || bin.Origin != "built" || bin.Version != b.Release.Version(bin.Name) {
			t.Errorf("manifest entry %+v, file sha256 %s size %d, want them equal, origin built", bin, sum, size)
		}
	}
	if !slices.Equal(names, Binaries()) {
		t.Errorf("manifest binaries = %v, want %v", names, Binaries())
	}
	if m.Source != "go-module-proxy" || m.GoVersion != "go1.26.8" {
		t.Errorf("manifest source %q go %q, want go-module-proxy go1.26.8", m.Source, m.GoVersion)
	}
	onDisk, err := os.ReadFile(filepath.Join(b.Cache.VersionDir(b.Release), ManifestFile))
	require.NoError(t, err)
	var m2 Manifest
	require.NoError(t, json.Unmarshal(onDisk, &m2))
	if m2.Kubernetes != "v1.34.4" || m2.Etcd != "3.6.5-0" || m2.CoreDNS != "v1.12.1" || m2.Pause != "3.10.1" {
		t.Errorf("manifest.json versions = %+v", m2)
	}

	// Every build is static, linux, low-parallelism, with the version set.
	for _, c := range fake.builds() {
		for k, want := range map[string]string{"CGO_ENABLED": "0", "GOOS": "linux", "GOMAXPROCS": "1", "GOWORK": "off", "GOTOOLCHAIN": "local"} {
			if got := envValue(c.Env, k); got != want {
				t.Errorf("go %s: %s=%q, want %q", strings.Join(c.Args, " "), k, got, want)
			}
		}
		if argValue(c.Args, "-p") != "1" || !slices.Contains(c.Args, "-trimpath") {
			t.Errorf("go %s: want -trimpath -p 1", strings.Join(c.Args, " "))
		}
		if pkg := c.Args[len(c.Args)-1]; strings.HasPrefix(pkg, "k8s.io/kubernetes/cmd/") {
			if !strings.Contains(argValue(c.Args, "-ldflags"), "k8s.io/component-base/version.gitVersion=v1.34.4") {
				t.Errorf("go build %s: ldflags %q lack the version", pkg, argValue(c.Args, "-ldflags"))
			}
			if c.Dir != filepath.Join(b.Cache.WorkDir(b.Release), "kubernetes") {
				t.Errorf("go build %s ran in %s, want the tools module", pkg, c.Dir)
			}
		}
	}
	if got := len(fake.builds()); got != 10 {
		t.Errorf("go build/install calls = %d, want 10", got)
	}
	gomod, err := os.ReadFile(filepath.Join(b.Cache.WorkDir(b.Release), "kubernetes", "go.mod"))
	require.NoError(t, err)
	if got := strings.Count(string(gomod), "=> k8s.io/"); got != 31 {
		t.Errorf("tools go.mod has %d staging replaces, want 31:\n%s", got, gomod)
	}
	pauseSrc, err := os.ReadFile(filepath.Join(b.Cache.WorkDir(b.Release), "pause", "main.go"))
	require.NoError(t, err)
	if !bytes.Contains(pauseSrc, []byte("syscall.Wait4")) {
		t.Errorf("pause module main.go is not the embedded pause source")
	}

	// A second run finds the cache and runs nothing.
	fake.reset()
	progress.Reset()
	m3, err := b.Ensure(ctx)
	require.NoError(t, err)
	if n := fake.count(); n != 0 {
		t.Errorf("Ensure() with a valid cache ran %d go commands, want 0", n)
	}
	if !strings.Contains(progress.String(), "verified") {
		t.Errorf("Ensure() with a valid cache printed %q, want it to say the cache verified", progress.String())
	}
	if len(m3.Binaries) != 10 {
		t.Errorf("Ensure() cached manifest has %d binaries, want 10", len(m3.Binaries))
	}
}

func TestEnsureFailureLeavesNoCache(t *testing.T) {
	for _, fail := range []string{KubeProxy, Etcd, CoreDNS, Pause} {
		t.Run(fail, func(t *testing.T) {
			fake := newFakeGo(t)
			fake.failBuild = fail
			b, _ := newTestBuilder(t, fake)
			_, err := b.Ensure(context.Background())
			if err == nil || !strings.Contains(err.Error(), fail) {
				t.Fatalf("Ensure() with %s failing = %v, want an error naming it", fail, err)
			}
			if _, serr := os.Stat(b.Cache.VersionDir(b.Release)); !os.IsNotExist(serr) {
				t.Errorf("after a failed build %s exists (%v), want no cache", b.Cache.VersionDir(b.Release), serr)
			}
			if _, verr := b.Cache.Verify(b.Release); !errdefs.IsNotFound(verr) {
				t.Errorf("Verify() after a failed build = %v, want NotFound", verr)
			}
			for _, n := range dirNames(t, b.Cache.Dir) {
				if strings.Contains(n, ".tmp-") {
					t.Errorf("after a failed build the cache directory holds %s, want no temporary directory", n)
				}
			}
		})
	}
}

func TestEnsureCleansKilledRunAndCorruptCache(t *testing.T) {
	fake := newFakeGo(t)
	b, progress := newTestBuilder(t, fake)
	ctx := context.Background()
	// A run killed with SIGKILL leaves its temporary directory.
	leftover := filepath.Join(b.Cache.Dir, ".v1.34.4.tmp-12345")
	require.NoError(t, os.MkdirAll(filepath.Join(leftover, "bin"), 0o755))
	_, err := b.Ensure(ctx)
	require.NoError(t, err)
	if _, err := os.Stat(leftover); !os.IsNotExist(err) {
		t.Errorf("leftover %s still exists after Ensure (%v)", leftover, err)
	}

	// A binary changed after the build: the cache no longer verifies, and
	// Ensure rebuilds it.
	kubelet := filepath.Join(b.Cache.BinDir(b.Release), Kubelet)
	require.NoError(t, os.WriteFile(kubelet, []byte("tampered"), 0o755))
	if _, err := b.Cache.Verify(b.Release); !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "kubelet") {
		t.Errorf("Verify() with a changed kubelet = %v, want FailedPrecondition naming kubelet", err)
	}
	fake.reset()
	progress.Reset()
	_, err = b.Ensure(ctx)
	require.NoError(t, err)
	if _, err := b.Cache.Verify(b.Release); err != nil {
		t.Errorf("Verify() after rebuild = %v, want nil", err)
	}
	if got, _ := os.ReadFile(kubelet); string(got) == "tampered" {
		t.Errorf("kubelet still tampered after rebuild")
	}
	if !strings.Contains(progress.String(), "not usable") {
		t.Errorf("progress %q, want it to say why it rebuilds", progress.String())
	}
	for _, n := range dirNames(t, b.Cache.Dir) {
		if strings.HasPrefix(n, ".v1.34.4.") {
			t.Errorf("cache directory holds %s after the rebuild", n)
		}
	}
}

func TestEnsureRebuildsOnRecipeChange(t *testing.T) {
	fake := newFakeGo(t)
	b, _ := newTestBuilder(t, fake)
	ctx := context.Background()
	m, err := b.Ensure(ctx)
	require.NoError(t, err)
	if m.Recipe != Recipe(b.Release) {
		t.Errorf("manifest recipe = %q, want %q", m.Recipe, Recipe(b.Release))
	}
	st, err := os.Stat(b.Cache.VersionDir(b.Release))
	require.NoError(t, err)
	if st.Mode().Perm() != 0o755 {
		t.Errorf("cache directory mode = %v, want 0755 (readable by the lab and nspawn hosts)", st.Mode().Perm())
	}

	// A cache from a kiln-imagebuilder that built with other flags.
	mf := filepath.Join(b.Cache.VersionDir(b.Release), ManifestFile)
	old := *m
	old.Recipe = "sha256:older"
	j, err := json.Marshal(old)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(mf, j, 0o644))
	if _, err := b.Cache.Verify(b.Release); !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "recipe") {
		t.Errorf("Verify(other recipe) = %v, want FailedPrecondition about the recipe", err)
	}
	fake.reset()
	_, err = b.Ensure(ctx)
	require.NoError(t, err)
	if n := len(fake.builds()); n != 10 {
		t.Errorf("Ensure() after a recipe change built %d binaries, want 10", n)
	}
}

func TestEnsureCancelled(t *testing.T) {
	fake := newFakeGo(t)
	b, _ := newTestBuilder(t, fake)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := b.Ensure(ctx); err == nil {
		t.Fatalf("Ensure(cancelled) = nil, want an error")
	}
	if _, err := b.Cache.Verify(b.Release); !errdefs.IsNotFound(err) {
		t.Errorf("Verify() after a cancelled build = %v, want NotFound", err)
	}
}

func TestParseLDD(t *testing.T) {
	tests := []struct {
		name string
		out  string
		want []string
	}{
		{
			name: "dynamic",
			out: "\tlinux-vdso.so.1 (0x00007ffd)\n\tlibxtables.so.12 => /lib/x86_64-linux-gnu/libxtables.so.12 (0x00007f27)\n" +
				"\tlibm.so.6 => /lib/x86_64-linux-gnu/libm.so.6 (0x00007fbc)\n\t/lib64/ld-linux-x86-64.so.2 (0x00007f27)\n",
			want: []string{"/lib/x86_64-linux-gnu/libxtables.so.12", "/lib/x86_64-linux-gnu/libm.so.6", "/lib64/ld-linux-x86-64.so.2"},
		},
		{name: "static", out: "\tnot a dynamic executable\n", want: nil},
		{name: "statically linked", out: "\tstatically linked\n", want: nil},
		{name: "header line", out: "/usr/sbin/conntrack:\n\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x1)\n", want: []string{"/lib/x86_64-linux-gnu/libc.so.6"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseLDD([]byte(tt.out))
			require.NoError(t, err)
			if !slices.Equal(got, tt.want) {
				t.Errorf("ParseLDD(%q) = %v, want %v", tt.out, got, tt.want)
			}
		})
	}
	if _, err := ParseLDD([]byte("\tlibgone.so.1 => not found\n")); !errdefs.IsNotFound(err) {
		t.Errorf("ParseLDD(not found) = %v, want NotFound", err)
	}
}

func TestImageRefs(t *testing.T) {
	want := []string{
		"registry.k8s.io/kube-apiserver:v1.34.4",
		"registry.k8s.io/kube-controller-manager:v1.34.4",
		"registry.k8s.io/kube-scheduler:v1.34.4",
		"registry.k8s.io/kube-proxy:v1.34.4",
		"registry.k8s.io/coredns/coredns:v1.12.1",
		"registry.k8s.io/pause:3.10.1",
		"registry.k8s.io/etcd:3.6.5-0",
	}
	if got := ImageRefs(Pinned()); !slices.Equal(got, want) {
		t.Errorf("ImageRefs(Pinned()) = %v, want %v", got, want)
	}
}
