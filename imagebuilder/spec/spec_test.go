package spec

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/internal/errdefs"
)

const full = `os: debian
suite: bookworm
kubernetesVersion: v1.34.4
agent: bin/kiln-agent
packages: [vim-tiny]
size: 4GiB
sysctls:
  vm.max_map_count: "262144"
modules: [ip_vs]
sourceDateEpoch: 1764633600
`

func TestParseDefaults(t *testing.T) {
	s, err := Parse([]byte(full))
	require.NoError(t, err)
	require.NoError(t, s.Validate("v1.34.4"))
	if s.Mirror != DefaultMirror || s.Kernel != DefaultKernel || s.CgroupDriver != CgroupDriverSystemd || !*s.LabCgroupRemount {
		t.Errorf("defaults: mirror %q kernel %q cgroupDriver %q labCgroupRemount %v", s.Mirror, s.Kernel, s.CgroupDriver, *s.LabCgroupRemount)
	}
	if got, want := s.RootSize(), int64(4<<30); got != want {
		t.Errorf("RootSize() = %d, want %d", got, want)
	}
	if got, want := s.Tag("20251202"), "debian12-k8s1.34.4-20251202"; got != want {
		t.Errorf("Tag() = %q, want %q", got, want)
	}
	if s.LabSysctlBinds || s.LabNetwork || s.Slim {
		t.Errorf("defaults: labSysctlBinds %v labNetwork %v slim %v, want all false", s.LabSysctlBinds, s.LabNetwork, s.Slim)
	}
	m, err := Parse([]byte("minimal: true\nagent: /x\ntagDate: \"20261202\"\n"))
	require.NoError(t, err)
	require.NoError(t, m.Validate("v1.34.4"))
	if m.Kernel != KernelNone {
		t.Errorf("minimal kernel = %q, want %q", m.Kernel, KernelNone)
	}
	if got, want := m.Tag("20250101"), "debian12-minimal-20261202"; got != want {
		t.Errorf("Tag() = %q, want %q", got, want)
	}
}

func TestParseErrors(t *testing.T) {
	for _, tc := range []struct {
		name, yaml string
		want       []string
	}{
		{"unknown field", "os: debian\nagent: x\nkubernetesVersoin: v1.34.4\n", []string{"line 3: unknown field kubernetesVersoin"}},
		{"wrong type", "os: debian\nminimal: maybe\n", []string{"line 2:", "maybe"}},
		{"nested unknown", "sysctls:\n  a.b: \"1\"\npackages:\n  - x\n  - {a: 1}\n", []string{"line 5:"}},
		{"not yaml", "os: [debian\n", []string{"line"}},
		{"empty", "", []string{"empty"}},
		{"two documents", "os: debian\n---\nos: debian\n", []string{"more than one"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.yaml))
			if !errdefs.IsInvalidArgument(err) {
				t.Fatalf("Parse(%q) = %v, want InvalidArgument", tc.yaml, err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Parse(%q) = %v, want it to mention %q", tc.yaml, err, w)
				}
			}
		})
	}
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name, yaml string
		want       []string
	}{
		{"wrong version", "kubernetesVersion: v1.33.0\nagent: x\n", []string{`line 1: kubernetesVersion: "v1.33.0": this kiln-imagebuilder's kube-tools are pinned to v1.34.4`}},
		{"no version", "agent: x\n", []string{"kubernetesVersion: required"}},
		{"bad version", "kubernetesVersion: 1.34\nagent: x\n", []string{"not of the form v1.Y.Z"}},
		{"no agent", "kubernetesVersion: v1.34.4\n", []string{"agent: required"}},
		{"os", "os: ubuntu\nkubernetesVersion: v1.34.4\nagent: x\n", []string{`line 1: os: "ubuntu" is not supported`}},
		{"suite", "suite: buster\nkubernetesVersion: v1.34.4\nagent: x\n", []string{`line 1: suite: "buster" is not supported: use one of bookworm, trixie`}},
		{"mirror", "mirror: ftp://x\nkubernetesVersion: v1.34.4\nagent: x\n", []string{"line 1: mirror:"}},
		{"package", "packages: [\"vim; rm -rf /\"]\nkubernetesVersion: v1.34.4\nagent: x\n", []string{"line 1: packages:", "not a Debian package name"}},
		{"kernel", "kernel: vmlinuz\nkubernetesVersion: v1.34.4\nagent: x\n", []string{"line 1: kernel:"}},
		{"size", "size: 4 apples\nkubernetesVersion: v1.34.4\nagent: x\n", []string{"line 1: size:"}},
		{"size small", "size: 1MiB\nkubernetesVersion: v1.34.4\nagent: x\n", []string{"at least 64MiB"}},
		{"cgroup driver", "cgroupDriver: cgroupv2\nkubernetesVersion: v1.34.4\nagent: x\n", []string{"line 1: cgroupDriver:"}},
		{"sysctl", "sysctls: {\"bad key\": \"1\", net.core.somaxconn: \"\"}\nkubernetesVersion: v1.34.4\nagent: x\n", []string{"not a sysctl name", "must be one non-empty line"}},
		{"module", "modules: [\"../evil\"]\nkubernetesVersion: v1.34.4\nagent: x\n", []string{"not a kernel module name"}},
		{"tag date", "tagDate: \"2026-12-02\"\nkubernetesVersion: v1.34.4\nagent: x\n", []string{"want yyyymmdd"}},
		{"epoch", "sourceDateEpoch: -1\nkubernetesVersion: v1.34.4\nagent: x\n", []string{"not negative"}},
		{"minimal with kube", "minimal: true\nkubernetesVersion: v1.34.4\nagent: x\n", []string{"a minimal image has no Kubernetes"}},
		{"minimal with kernel", "minimal: true\nkernel: linux-image-amd64\nagent: x\n", []string{"a minimal image has no kernel"}},
		{"minimal with lab sysctls", "minimal: true\nagent: x\nlabSysctlBinds: true\n", []string{"line 3: labSysctlBinds: a minimal image has no kubelet"}},
		{"minimal with lab kubelet patch", "minimal: true\nagent: x\nlabKubeletPatch: true\n", []string{"line 3: labKubeletPatch: a minimal image has no kubelet"}},
		{"minimal with lab network", "minimal: true\nagent: x\nlabNetwork: true\n", []string{"line 3: labNetwork: a minimal image has no Kubernetes"}},
		{"minimal lab VM", "minimal: true\nagent: x\nlabVM: true\n", []string{"line 3: labVM: a minimal image has no control plane"}},
		{"publish url", "publishURL: /srv\nkubernetesVersion: v1.34.4\nagent: x\n", []string{"line 1: publishURL:"}},
		{"several", "os: ubuntu\ncgroupDriver: x\n", []string{"line 1: os:", "line 2: cgroupDriver:", "agent: required"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := Parse([]byte(tc.yaml))
			require.NoError(t, err)
			err = s.Validate("v1.34.4")
			if !errdefs.IsInvalidArgument(err) {
				t.Fatalf("Validate(%q) = %v, want InvalidArgument", tc.yaml, err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Validate(%q) = %v, want it to mention %q", tc.yaml, err, w)
				}
			}
		})
	}
}

func TestParseSize(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		ok   bool
	}{
		{"4GiB", 4 << 30, true},
		{"4G", 4 << 30, true},
		{"1536MiB", 1536 << 20, true},
		{"134217728", 128 << 20, true},
		{"1T", 1 << 40, true},
		{"100000000", 0, false}, // not whole MiB
		{"32MiB", 0, false},
		{"-1G", 0, false},
		{"4 GB", 4 << 30, true},
		{"lots", 0, false},
	} {
		got, err := ParseSize(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("ParseSize(%q) = %d, %v, want %d (ok %v)", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

func TestEpoch(t *testing.T) {
	now := time.Unix(1800000000, 0)
	s := &Spec{SourceDateEpoch: 1700000000}
	env := map[string]string{}
	getenv := func(k string) string { return env[k] }
	for _, tc := range []struct {
		env  string
		spec int64
		want int64
		ok   bool
	}{
		{"", 1700000000, 1700000000, true},
		{"1600000000", 1700000000, 1600000000, true},
		{"", 0, 1800000000, true},
		{"yesterday", 0, 0, false},
	} {
		env["SOURCE_DATE_EPOCH"] = tc.env
		s.SourceDateEpoch = tc.spec
		got, err := s.Epoch(getenv, now)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("Epoch(env %q, spec %d) = %d, %v, want %d", tc.env, tc.spec, got, err, tc.want)
		}
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "image.yaml")
	require.NoError(t, os.WriteFile(p, []byte(full), 0o644))
	s, err := Load(p)
	require.NoError(t, err)
	if got, want := s.AgentPath(), filepath.Join(dir, "bin/kiln-agent"); got != want {
		t.Errorf("AgentPath() = %q, want %q", got, want)
	}
	_, err = Load(filepath.Join(dir, "missing.yaml"))
	if !errdefs.IsNotFound(err) {
		t.Errorf("Load(missing) = %v, want NotFound", err)
	}
	require.NoError(t, os.WriteFile(p, []byte("agent: x\nsize: 2G\nbogus: 1\n"), 0o644))
	_, err = Load(p)
	if err == nil || !strings.Contains(err.Error(), p+": image spec: line 3: unknown field bogus") {
		t.Errorf("Load(bogus) = %v, want the file, line and field", err)
	}
}

func TestExamples(t *testing.T) {
	files, _ := filepath.Glob("../../examples/images/*.yaml")
	require.NotEmpty(t, files)
	for _, f := range files {
		s, err := Load(f)
		require.NoError(t, err, f)
		// Each against the kube-tools release it names (the pinned one, or
		// the previous minor of lab-previous.yaml).
		want := kubetools.Pinned().Kubernetes
		if !s.Minimal {
			r, err := kubetools.ReleaseFor(s.KubernetesVersion)
			require.NoError(t, err, f)
			want = r.Kubernetes
		}
		if err := s.Validate(want); err != nil {
			t.Errorf("Validate(%q) = %v, want nil", f, err)
		}
	}
}
