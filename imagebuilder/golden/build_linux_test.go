package golden

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/klauspost/compress/zstd"
	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/imagebuilder/disk"
	"github.com/kilnhq/kiln/imagebuilder/manifest"
	"github.com/kilnhq/kiln/imagebuilder/spec"
	"github.com/kilnhq/kiln/internal/errdefs"
	resources "github.com/kilnhq/kiln/internal/manifest"
	"github.com/kilnhq/kiln/internal/testenv"
)

// testEpoch is the SOURCE_DATE_EPOCH of the test images.
const testEpoch = 1764633600 // 2025-12-02

// needBuilder skips unless this machine can build an image: root, the
// tools, and a rootfs cache entry for spec or a reachable mirror.
func needBuilder(t *testing.T, s *spec.Spec) {
	t.Helper()
	if os.Geteuid() != 0 {
		testenv.Skip(t, "building an image needs root")
	}
	for tool, pkg := range map[string]string{"debootstrap": "debootstrap", "sfdisk": "fdisk", "mkfs.fat": "dosfstools",
		"mcopy": "mtools", "mkfs.ext4": "e2fsprogs", "debugfs": "e2fsprogs"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (Debian package %s)", tool, pkg)
		}
	}
	if isDir(RootfsSpec(s, "").Dir()) {
		return
	}
	u, err := url.Parse(s.Mirror)
	require.NoError(t, err)
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), map[string]string{"https": "443"}[u.Scheme]+map[string]string{"http": "80"}[u.Scheme])
	}
	c, err := net.Dial("tcp", host)
	if err != nil {
		testenv.Skipf(t, "no rootfs cache entry %s and the mirror %s is unreachable: %v", RootfsSpec(s, "").Dir(), s.Mirror, err)
	}
	c.Close()
}

var agentOnce struct {
	sync.Once
	path string
	err  error
}

// agentBinary builds cmd/kiln-agent once per test run.
func agentBinary(t *testing.T) string {
	t.Helper()
	agentOnce.Do(func() {
		dir, err := os.MkdirTemp("", "kiln-golden-agent-")
		if err != nil {
			agentOnce.err = err
			return
		}
		agentOnce.path = filepath.Join(dir, "kiln-agent")
		cmd := exec.Command("go", "build", "-trimpath", "-o", agentOnce.path, "github.com/kilnhq/kiln/cmd/kiln-agent")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			agentOnce.err = err
			agentOnce.path = string(out)
		}
	})
	require.NoError(t, agentOnce.err, "go build ./cmd/kiln-agent: %s", agentOnce.path)
	return agentOnce.path
}

// shared is the minimal image built once for the tests that only read it.
var shared struct {
	sync.Mutex
	dir string
	res *Result
}

func sharedMinimal(t *testing.T) *Result {
	t.Helper()
	shared.Lock()
	defer shared.Unlock()
	if shared.res == nil {
		dir, err := os.MkdirTemp("", "kiln-golden-")
		require.NoError(t, err)
		shared.dir = dir
		shared.res = buildMinimal(t, dir)
	}
	return shared.res
}

func TestMain(m *testing.M) {
	code := m.Run()
	if agentOnce.path != "" && agentOnce.err == nil {
		os.RemoveAll(filepath.Dir(agentOnce.path))
	}
	if shared.dir != "" {
		os.RemoveAll(shared.dir)
	}
	os.Exit(code)
}

func minimalSpec(t *testing.T, agent string) *spec.Spec {
	s, err := spec.Parse([]byte("minimal: true\nsourceDateEpoch: 1764633600\nagent: " + agent + "\n"))
	require.NoError(t, err)
	return s
}

func buildMinimal(t *testing.T, out string) *Result {
	t.Helper()
	s := minimalSpec(t, agentBinary(t))
	var progress bytes.Buffer
	res, err := Build(context.Background(), Options{
		Spec: s, OutDir: out, Progress: io.MultiWriter(&progress, testWriter{t}),
		Getenv: func(string) string { return "" },
	})
	require.NoError(t, err, "progress:\n%s", progress.String())
	return res
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// TestBuildMinimal builds the small image twice with the same
// SOURCE_DATE_EPOCH and checks what a user checks: a GPT with an ESP and a
// discoverable x86-64 root, a manifest whose block map hashes match the
// raw file, a zstd file that decompresses to the raw file, an Image
// resource that kilnctl accepts, the agent and baked prep inside the root
// filesystem, and the same bytes both times.
func TestBuildMinimal(t *testing.T) {
	if testing.Short() {
		t.Skip("builds an image (about a minute with a warm rootfs cache)")
	}
	needBuilder(t, minimalSpec(t, "/unused"))
	res := sharedMinimal(t)
	out := filepath.Dir(res.RawPath)

	raw, zst, mj, iy := FileNames(res.Tag)
	entries, err := os.ReadDir(out)
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	require.ElementsMatch(t, []string{raw, zst, mj, iy}, names, "output directory holds only the four outputs")
	require.Equal(t, "debian12-minimal-"+res.Manifest.PatchLevel, res.Tag, "the tag carries the date of the OS packages")

	t.Run("gpt", func(t *testing.T) {
		b, err := exec.Command("sfdisk", "--json", res.RawPath).Output()
		require.NoError(t, err)
		var pt struct {
			PartitionTable struct {
				Label      string `json:"label"`
				Partitions []struct {
					Type string `json:"type"`
					Name string `json:"name"`
				} `json:"partitions"`
			} `json:"partitiontable"`
		}
		require.NoError(t, json.Unmarshal(b, &pt))
		if pt.PartitionTable.Label != "gpt" || len(pt.PartitionTable.Partitions) != 2 {
			t.Fatalf("sfdisk --json = %s, want a GPT with 2 partitions", b)
		}
		for i, want := range []string{disk.TypeESP, disk.TypeRootX8664} {
			if got := pt.PartitionTable.Partitions[i].Type; !strings.EqualFold(got, want) {
				t.Errorf("partition %d type = %s, want %s", i+1, got, want)
			}
		}
	})

	m, err := manifest.Read(res.ManifestPath)
	require.NoError(t, err)
	t.Run("manifest", func(t *testing.T) {
		f, err := os.Open(res.RawPath)
		require.NoError(t, err)
		defer f.Close()
		st, err := f.Stat()
		require.NoError(t, err)
		if uint64(st.Size()) != m.RawSize {
			t.Errorf("raw size = %d, manifest says %d", st.Size(), m.RawSize)
		}
		require.NotEmpty(t, m.BlockMap)
		for i, r := range m.BlockMap {
			h := sha256.New()
			_, err := io.Copy(h, io.NewSectionReader(f, int64(r.Offset), int64(r.Length)))
			require.NoError(t, err)
			if got := hex.EncodeToString(h.Sum(nil)); got != r.SHA256 {
				t.Errorf("block map range %d (offset %d, length %d): sha256 %s, manifest says %s", i, r.Offset, r.Length, got, r.SHA256)
			}
		}
		if m.DataSize() >= m.RawSize {
			t.Errorf("block map covers %d of %d bytes: holes not found", m.DataSize(), m.RawSize)
		}
		if got := sha256File(t, res.RawPath); got != m.RawSHA256 {
			t.Errorf("raw sha256 = %s, manifest says %s", got, m.RawSHA256)
		}
		if got := sha256File(t, res.ZstPath); got != m.CompressedSHA256 {
			t.Errorf("raw.zst sha256 = %s, manifest says %s", got, m.CompressedSHA256)
		}
		z, err := os.Open(res.ZstPath)
		require.NoError(t, err)
		defer z.Close()
		dec, err := zstd.NewReader(z)
		require.NoError(t, err)
		defer dec.Close()
		h := sha256.New()
		_, err = io.Copy(h, dec)
		require.NoError(t, err)
		if got := hex.EncodeToString(h.Sum(nil)); got != m.RawSHA256 {
			t.Errorf("decompressed raw.zst sha256 = %s, want the raw's %s", got, m.RawSHA256)
		}
		if m.OSVersion != "debian12" || m.KubernetesVersion != "" || m.AgentVersion == "" || m.AgentVersion == "unknown" || len(m.Packages) < 50 || len(m.PatchLevel) != 8 {
			t.Errorf("manifest os %q kubernetes %q agent %q packages %d patch level %q", m.OSVersion, m.KubernetesVersion, m.AgentVersion, len(m.Packages), m.PatchLevel)
		}
		var systemd bool
		for _, p := range m.Packages {
			systemd = systemd || p.Name == "systemd"
		}
		if !systemd {
			t.Errorf("manifest package list has no systemd")
		}
	})

	t.Run("image resource", func(t *testing.T) {
		y, err := os.ReadFile(res.ImagePath)
		require.NoError(t, err)
		docs, err := resources.Decode(res.ImagePath, y)
		require.NoError(t, err)
		require.Len(t, docs, 1)
		require.NoError(t, validation.Validate(docs[0].Resource))
		if got := docs[0].Resource.GetImage().GetSpec().GetSha256(); got != m.CompressedSHA256 {
			t.Errorf("Image spec.sha256 = %s, want %s", got, m.CompressedSHA256)
		}
	})

	t.Run("root filesystem", func(t *testing.T) {
		var root manifest.Partition
		for _, p := range m.Partitions {
			if p.Type == disk.TypeRootX8664 {
				root = p
			}
		}
		require.NotZero(t, root.Offset)
		fsys := res.RawPath + "?offset=" + strconv.FormatUint(root.Offset, 10)
		cat := func(path string) string {
			out, err := exec.Command("debugfs", "-R", "cat "+path, fsys).Output()
			require.NoError(t, err)
			return string(out)
		}
		for path, want := range map[string]string{
			"/etc/systemd/system/kiln-agent.service":                         "ExecStart=/usr/bin/kiln-agent run",
			"/etc/modules-load.d/kiln.conf":                                  "br_netfilter\noverlay\n",
			"/etc/sysctl.d/99-kiln.conf":                                     "net.bridge.bridge-nf-call-iptables = 1",
			"/etc/kiln-release":                                              "TAG=" + res.Tag,
			"/etc/systemd/system/sysinit.target.wants/cgroup-rw.service":     "", // a symlink: debugfs cat follows nothing
			"/etc/systemd/system/multi-user.target.wants/kiln-agent.service": "",
		} {
			got := cat(path)
			if !strings.Contains(got, want) {
				t.Errorf("%s in the image = %q, want it to contain %q", path, got, want)
			}
		}
		if got := cat("/etc/machine-id"); got != "" {
			t.Errorf("/etc/machine-id = %q, want empty (each host makes its own)", got)
		}
		if got := cat("/etc/fstab"); strings.Contains(got, " swap ") {
			t.Errorf("/etc/fstab has swap: %q", got)
		}
		st, err := exec.Command("debugfs", "-R", "stat /usr/bin/kiln-agent", fsys).Output()
		require.NoError(t, err)
		if !strings.Contains(string(st), "Mode:  0755") {
			t.Errorf("debugfs stat /usr/bin/kiln-agent = %s, want mode 0755", st)
		}
	})

	t.Run("reproducible", func(t *testing.T) {
		out2 := t.TempDir()
		res2 := buildMinimal(t, out2)
		m2, err := manifest.Read(res2.ManifestPath)
		require.NoError(t, err)
		if m2.RawSHA256 != m.RawSHA256 {
			t.Errorf("second build raw sha256 = %s, first %s (same spec and SOURCE_DATE_EPOCH)", m2.RawSHA256, m.RawSHA256)
			out, _ := exec.Command("sh", "-c", "cmp -l "+res.RawPath+" "+res2.RawPath+" | head -20").CombinedOutput()
			t.Logf("first differing bytes (offset, octal values):\n%s", out)
		}
		if m2.CompressedSHA256 != m.CompressedSHA256 {
			t.Errorf("second build raw.zst sha256 = %s, first %s", m2.CompressedSHA256, m.CompressedSHA256)
		}
		a, _ := os.ReadFile(res.ManifestPath)
		b, _ := os.ReadFile(res2.ManifestPath)
		if !bytes.Equal(a, b) {
			t.Errorf("manifests differ:\n%s\n---\n%s", a, b)
		}
	})
}

// TestBuildBadSpec: a bad spec fails before anything is written, with the
// line of the problem.
func TestBuildBadSpec(t *testing.T) {
	for _, tc := range []struct {
		name, yaml string
		want       string
		class      func(error) bool
	}{
		{"unknown field", "minimal: true\nagent: /bin/true\nsizee: 4GiB\n", "line 3: unknown field sizee", errdefs.IsInvalidArgument},
		{"wrong kubernetes", "kubernetesVersion: v1.30.0\nagent: /bin/true\n", `line 1: kubernetesVersion: "v1.30.0": this kiln-imagebuilder's kube-tools are pinned to v1.34.4`, errdefs.IsInvalidArgument},
		{"missing agent", "minimal: true\nagent: /nonexistent/kiln-agent\n", "agent binary /nonexistent/kiln-agent", errdefs.IsInvalidArgument},
		{"agent not executable", "minimal: true\nagent: image.yaml\n", "not an executable file", errdefs.IsInvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if os.Geteuid() != 0 && (tc.name == "agent not executable" || tc.name == "missing agent") {
				testenv.Skip(t, "the agent is checked after the root check")
			}
			dir := t.TempDir()
			f := filepath.Join(dir, "image.yaml")
			require.NoError(t, os.WriteFile(f, []byte(tc.yaml), 0o644))
			out := filepath.Join(dir, "out")
			s, err := spec.Load(f)
			if err == nil {
				_, err = Build(context.Background(), Options{Spec: s, OutDir: out})
			}
			if err == nil || !tc.class(err) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Build(%q) = %v, want an error containing %q", tc.yaml, err, tc.want)
			}
			if _, err := os.Stat(out); !os.IsNotExist(err) {
				t.Errorf("Build(%q) created %s (%v), want nothing written", tc.yaml, out, err)
			}
		})
	}
}

// TestBuildFailureLeavesNothing: a step that fails (here the disk, with a
// root size too small for the tree) leaves no output and no work directory.
func TestBuildFailureLeavesNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("builds an image (about a minute with a warm rootfs cache)")
	}
	s := minimalSpec(t, "/unused")
	needBuilder(t, s)
	s = minimalSpec(t, agentBinary(t))
	s.Size = "64MiB" // the minimal root needs more
	out := t.TempDir()
	_, err := Build(context.Background(), Options{Spec: s, OutDir: out, Getenv: func(string) string { return "" }})
	require.Error(t, err)
	if !strings.Contains(err.Error(), "disk") {
		t.Errorf("Build(size 64MiB) = %v, want a disk error", err)
	}
	entries, _ := os.ReadDir(out)
	for _, e := range entries {
		t.Errorf("failed build left %s in the output directory", e.Name())
	}
}

func sha256File(t *testing.T, p string) string {
	f, err := os.Open(p)
	require.NoError(t, err)
	defer f.Close()
	h := sha256.New()
	_, err = io.Copy(h, f)
	require.NoError(t, err)
	return hex.EncodeToString(h.Sum(nil))
}
