package containerd

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// debianConfig is Debian 12's /etc/containerd/config.toml (containerd 1.6).
const debianConfig = `version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.internal.v1.opt"]
    path = "/var/lib/containerd/opt"
`

const v3Config = `version = 3
root = "/var/lib/containerd"

[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
    SystemdCgroup = false
    BinaryName = "/usr/bin/runc"
`

func TestWriteSystemdCgroup(t *testing.T) {
	tests := []struct {
		name       string
		initial    string // "" means no file
		want       bool
		wantBefore string
		keep       []string // values that must survive the edit
	}{
		{"debian 1.6 unset", debianConfig, true, "unset", []string{`bin_dir = '/usr/lib/cni'`, `path = '/var/lib/containerd/opt'`}},
		{"v3 false to true", v3Config, true, "false", []string{`BinaryName = '/usr/bin/runc'`, `root = '/var/lib/containerd'`, `runtime_type = 'io.containerd.runc.v2'`}},
		{"v3 to cgroupfs", v3Config, false, "false", nil},
		{"absent", "", true, "absent", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "config.toml")
			if tt.initial != "" {
				require.NoError(t, os.WriteFile(path, []byte(tt.initial), 0o600))
			}
			before, changed, err := WriteSystemdCgroup(path, tt.want)
			require.NoError(t, err)
			if before != tt.wantBefore {
				t.Errorf("WriteSystemdCgroup(%v) before = %q, want %q", tt.want, before, tt.wantBefore)
			}
			wantChanged := tt.wantBefore != fmtBool(tt.want)
			if changed != wantChanged {
				t.Errorf("WriteSystemdCgroup(%v) changed = %v, want %v", tt.want, changed, wantChanged)
			}
			got, set, err := ReadSystemdCgroup(path)
			require.NoError(t, err)
			if !set || got != tt.want {
				t.Errorf("ReadSystemdCgroup() = %v (set %v), want %v", got, set, tt.want)
			}
			b, err := os.ReadFile(path)
			require.NoError(t, err)
			for _, k := range tt.keep {
				if !strings.Contains(string(b), k) {
					t.Errorf("config after edit lost %q:\n%s", k, b)
				}
			}
			if tt.initial != "" {
				fi, err := os.Stat(path)
				require.NoError(t, err)
				require.Equal(t, os.FileMode(0o600), fi.Mode().Perm(), "mode kept")
			}
			// The file keeps its layout version.
			c, err := ParseConfig(b)
			require.NoError(t, err)
			init, _ := ParseConfig([]byte(tt.initial))
			if tt.initial != "" && c.Version() != init.Version() {
				t.Errorf("version after edit = %d, want %d", c.Version(), init.Version())
			}
			// Second run: nothing to do.
			_, changed, err = WriteSystemdCgroup(path, tt.want)
			require.NoError(t, err)
			if changed {
				t.Errorf("WriteSystemdCgroup(%v) again changed = true, want false", tt.want)
			}
		})
	}
}

func fmtBool(b bool) string {
	if b {
		return "true"
	}
	return "false"
}

func TestSystemdCgroupLayouts(t *testing.T) {
	tests := []struct {
		name, config string
		want, set    bool
	}{
		{"v2 true", "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\nSystemdCgroup = true\n", true, true},
		// A v3 table in a v2 file is not where containerd 1.x looks.
		{"v2 file with v3 table", "version = 2\n[plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.runc.options]\nSystemdCgroup = true\n", false, false},
		{"v3 true", "version = 3\n[plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.runc.options]\nSystemdCgroup = true\n", true, true},
		{"v1", "[plugins.cri.containerd.runtimes.runc.options]\nSystemdCgroup = true\n", true, true},
	}
	for _, tt := range tests {
		c, err := ParseConfig([]byte(tt.config))
		require.NoError(t, err)
		got, set, err := c.SystemdCgroup()
		require.NoError(t, err)
		if got != tt.want || set != tt.set {
			t.Errorf("%s: SystemdCgroup() = %v, %v, want %v, %v", tt.name, got, set, tt.want, tt.set)
		}
	}
}

func TestConfigErrors(t *testing.T) {
	if _, err := ParseConfig([]byte("version = \n")); !errdefs.IsInvalidArgument(err) {
		t.Errorf("ParseConfig(bad TOML) error = %v, want InvalidArgument", err)
	}
	c, err := ParseConfig([]byte("version = 9\n"))
	require.NoError(t, err)
	if _, _, err := c.SystemdCgroup(); !errdefs.IsNotSupported(err) {
		t.Errorf("SystemdCgroup() of version 9 error = %v, want NotSupported", err)
	}
	c, err = ParseConfig([]byte("version = 2\n[plugins]\n\"io.containerd.grpc.v1.cri\" = 5\n"))
	require.NoError(t, err)
	if err := c.SetSystemdCgroup(true); !errdefs.IsInvalidArgument(err) {
		t.Errorf("SetSystemdCgroup() through a non-table error = %v, want InvalidArgument", err)
	}
	if _, _, err := ReadSystemdCgroup(filepath.Join(t.TempDir(), "none.toml")); !errdefs.IsNotFound(err) {
		t.Errorf("ReadSystemdCgroup(missing) error = %v, want NotFound", err)
	}
}
