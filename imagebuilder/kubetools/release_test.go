package kubetools

import (
	"bufio"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/filelock"
)

func TestSelectRelease(t *testing.T) {
	tests := []struct {
		name, want string
	}{
		{"", "v1.34.4"},
		{"pinned", "v1.34.4"},
		{"previous", "v1.33.13"},
		{"v1.33.13", "v1.33.13"},
		{"1.33.13", "v1.33.13"},
		{"v1.34.4", "v1.34.4"},
	}
	for _, tt := range tests {
		r, err := SelectRelease(tt.name)
		require.NoError(t, err, "SelectRelease(%q)", tt.name)
		if r.Kubernetes != tt.want {
			t.Errorf("SelectRelease(%q) = %s, want %s", tt.name, r.Kubernetes, tt.want)
		}
	}
	for _, bad := range []string{"v1.33.12", "v1.32.0", "v1.35.0", "latest", "v2"} {
		_, err := SelectRelease(bad)
		if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "no recipe") ||
			!strings.Contains(err.Error(), "v1.34.4") || !strings.Contains(err.Error(), "v1.33.13") {
			t.Errorf("SelectRelease(%q) = %v, want InvalidArgument saying there is no recipe and naming the known releases", bad, err)
		}
	}
}

func TestReleaseFor(t *testing.T) {
	for v, want := range map[string]string{"": "v1.34.4", "v1.34.4": "v1.34.4", "v1.33.13": "v1.33.13"} {
		r, err := ReleaseFor(v)
		require.NoError(t, err)
		if r.Kubernetes != want {
			t.Errorf("ReleaseFor(%q) = %s, want %s", v, r.Kubernetes, want)
		}
	}
	for _, bad := range []string{"previous", "pinned", "v1.33.1"} {
		if _, err := ReleaseFor(bad); !errdefs.IsInvalidArgument(err) {
			t.Errorf("ReleaseFor(%q) = %v, want InvalidArgument", bad, err)
		}
	}
	if got := BuildCommand(Pinned()); got != "make kube-tools" {
		t.Errorf("BuildCommand(Pinned) = %q", got)
	}
	if got := BuildCommand(Previous()); got != "make kube-tools KUBE_RELEASE=v1.33.13" {
		t.Errorf("BuildCommand(Previous) = %q", got)
	}
}

// TestPreviousIsTheMinorBefore checks what the upgrade test relies on: the
// previous release is one minor below the pinned one, with its own cache
// directory and recipe.
func TestPreviousIsTheMinorBefore(t *testing.T) {
	p, q := Pinned(), Previous()
	require.NoError(t, q.Validate())
	if q.Minor() != "33" || p.Minor() != "34" {
		t.Errorf("minors = %s -> %s, want 33 -> 34", q.Minor(), p.Minor())
	}
	if !strings.HasPrefix(q.Staging, "v0.33.") || strings.TrimPrefix(q.Staging, "v0.") != strings.TrimPrefix(q.Kubernetes, "v1.") {
		t.Errorf("Previous staging %s does not match kubernetes %s", q.Staging, q.Kubernetes)
	}
	if q.EtcdModuleVersion() != "v3.5.24" {
		t.Errorf("Previous etcd module = %s, want v3.5.24", q.EtcdModuleVersion())
	}
	c := Cache{Dir: "/c"}
	if c.VersionDir(p) == c.VersionDir(q) || c.WorkDir(p) == c.WorkDir(q) {
		t.Errorf("pinned and previous share a cache directory")
	}
	if Recipe(p) == Recipe(q) {
		t.Errorf("pinned and previous have the same recipe")
	}
	if !strings.Contains(KubernetesLDFlags(q), "gitVersion=v1.33.13") || !strings.Contains(KubernetesLDFlags(q), "gitMinor=33") {
		t.Errorf("KubernetesLDFlags(Previous) = %s", KubernetesLDFlags(q))
	}
}

var constRE = regexp.MustCompile(`^\s*(DefaultEtcdVersion|CoreDNSVersion|PauseVersion)\s*=\s*"([^"]+)"`)

// kubeadmConstants reads the image tags from lines of kubeadm's
// cmd/kubeadm/app/constants/constants.go.
func kubeadmConstants(t *testing.T, name string) map[string]string {
	t.Helper()
	f, err := os.Open(name)
	require.NoError(t, err)
	defer f.Close()
	got := map[string]string{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if m := constRE.FindStringSubmatch(sc.Text()); m != nil {
			got[m[1]] = m[2]
		}
	}
	require.NoError(t, sc.Err())
	return got
}

// TestReleaseImageTagsMatchKubeadm checks every release's etcd, CoreDNS and
// pause tags against its kubeadm's constants: a wrong tag makes kubeadm pull
// an image the node does not hold, and init fails offline. The testdata
// holds those lines; when the module cache holds the whole source, it is
// checked too.
func TestReleaseImageTagsMatchKubeadm(t *testing.T) {
	modcache := os.Getenv("GOMODCACHE")
	if modcache == "" {
		if home, err := os.UserHomeDir(); err == nil {
			modcache = filepath.Join(home, "go", "pkg", "mod")
		}
	}
	for _, r := range Releases() {
		files := []string{filepath.Join("testdata", "kubeadm-constants-"+r.Kubernetes+".txt")}
		src := filepath.Join(modcache, "k8s.io", "kubernetes@"+r.Kubernetes, "cmd", "kubeadm", "app", "constants", "constants.go")
		if _, err := os.Stat(src); err == nil {
			files = append(files, src)
		} else {
			t.Logf("%s: module source not in the module cache (%s), checking testdata only", r.Kubernetes, src)
		}
		for _, name := range files {
			got := kubeadmConstants(t, name)
			want := map[string]string{"DefaultEtcdVersion": r.Etcd, "CoreDNSVersion": r.CoreDNS, "PauseVersion": r.Pause}
			for k, v := range want {
				if got[k] != v {
					t.Errorf("%s: %s says %s = %q, the release says %q", r.Kubernetes, name, k, got[k], v)
				}
			}
		}
	}
}

// TestToolsGoModFitsKubernetes checks that the generated tools module of
// every release is at least at kubernetes' own go directive (go mod tidy
// fails otherwise) and replaces each of its staging modules.
func TestToolsGoModFitsKubernetes(t *testing.T) {
	for _, r := range Releases() {
		kb, err := os.ReadFile(filepath.Join("testdata", "kubernetes-"+r.Kubernetes+".go.mod"))
		require.NoError(t, err)
		staging, err := StagingModules(kb)
		require.NoError(t, err)
		tools := ToolsGoMod(r, staging)
		kgo, tgo := goDirective(kb), goDirective(tools)
		if kgo == "" || tgo == "" || compareGo(tgo, kgo) < 0 {
			t.Errorf("%s: tools go.mod says go %q, kubernetes needs go %q", r.Kubernetes, tgo, kgo)
		}
		for _, m := range staging {
			if want := "\t" + m + " => " + m + " " + r.Staging + "\n"; !strings.Contains(string(tools), want) {
				t.Errorf("%s: tools go.mod lacks %q", r.Kubernetes, want)
			}
		}
	}
}

// goDirective returns the version of a go.mod's go line.
func goDirective(gomod []byte) string {
	for _, line := range strings.Split(string(gomod), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "go "); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// compareGo compares go directive versions ("1.24.0", "1.24").
func compareGo(a, b string) int {
	pa, pb := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < max(len(pa), len(pb)); i++ {
		var x, y string
		if i < len(pa) {
			x = pa[i]
		}
		if i < len(pb) {
			y = pb[i]
		}
		if len(x) != len(y) {
			if len(x) < len(y) {
				return -1
			}
			return 1
		}
		if c := strings.Compare(x, y); c != 0 {
			return c
		}
	}
	return 0
}

// TestEnsureLeavesOtherReleaseAlone: building one release (the previous
// minor takes 30-40 min) neither waits for nor cleans up another release's
// build running next to it.
func TestEnsureLeavesOtherReleaseAlone(t *testing.T) {
	fake := newFakeGo(t)
	b, _ := newTestBuilder(t, fake)
	require.NoError(t, os.MkdirAll(b.Cache.Dir, 0o755))
	// A build of the previous release is running: it holds its lock and
	// its temporary directory.
	unlock, err := filelock.Lock(context.Background(), filepath.Join(b.Cache.Dir, ".lock-"+Previous().Kubernetes))
	require.NoError(t, err)
	defer unlock()
	running := filepath.Join(b.Cache.Dir, "."+Previous().Kubernetes+".tmp-999")
	require.NoError(t, os.MkdirAll(filepath.Join(running, "bin"), 0o755))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, err = b.Ensure(ctx)
	require.NoError(t, err, "Ensure(pinned) while the previous release builds")
	if _, err := os.Stat(running); err != nil {
		t.Errorf("Ensure(pinned) removed the running build of %s: %v", Previous().Kubernetes, err)
	}
}
