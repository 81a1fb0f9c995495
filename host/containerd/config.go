// Package containerd edits containerd's configuration structurally (TOML
// decoded to a map, one value set, encoded again; never string
// replacement), and asks a running containerd what it actually uses.
//
// Layouts by the file's `version`:
//
//	version 2 (containerd 1.x): plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options
//	version 3 (containerd 2.x): plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options
//	no version (1, legacy):     plugins.cri.containerd.runtimes.runc.options
package containerd

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"

	"github.com/pelletier/go-toml/v2"

	"github.com/kilnhq/kiln/internal/atomicfile"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// DefaultConfig is containerd's config path relative to the root.
const DefaultConfig = "etc/containerd/config.toml"

// RuncRuntimeType is the runtime type of containerd's runc runtime.
const RuncRuntimeType = "io.containerd.runc.v2"

// Cgroup drivers, as the kubelet names them.
const (
	DriverSystemd  = "systemd"
	DriverCgroupfs = "cgroupfs"
)

// Driver names the cgroup driver that SystemdCgroup selects.
func Driver(systemdCgroup bool) string {
	if systemdCgroup {
		return DriverSystemd
	}
	return DriverCgroupfs
}

// RuncOptionsPath returns the table path of the runc runtime's options for
// a config file version.
//
// It returns a NotSupported error for versions Kiln does not know.
func RuncOptionsPath(version int64) ([]string, error) {
	switch version {
	case 0, 1:
		return []string{"plugins", "cri", "containerd", "runtimes", "runc", "options"}, nil
	case 2:
		return []string{"plugins", "io.containerd.grpc.v1.cri", "containerd", "runtimes", "runc", "options"}, nil
	case 3:
		return []string{"plugins", "io.containerd.cri.v1.runtime", "containerd", "runtimes", "runc", "options"}, nil
	}
	return nil, errdefs.NotSupported("containerd config version %d: Kiln knows versions 2 (containerd 1.x) and 3 (containerd 2.x)", version)
}

// Config is a decoded containerd config file.
type Config struct {
	tree map[string]any
}

// ParseConfig decodes a containerd config file's contents.
//
// It returns an InvalidArgument error when data is not TOML.
func ParseConfig(data []byte) (*Config, error) {
	tree := map[string]any{}
	if err := toml.Unmarshal(data, &tree); err != nil {
		return nil, errdefs.InvalidArgument("containerd config: %v", err)
	}
	return &Config{tree: tree}, nil
}

// Version returns the file's `version` (0 when absent).
func (c *Config) Version() int64 {
	switch v := c.tree["version"].(type) {
	case int64:
		return v
	case float64:
		return int64(v)
	}
	return 0
}

// SystemdCgroup returns the runc runtime's SystemdCgroup option and
// whether the file sets it (containerd's default when unset is false).
func (c *Config) SystemdCgroup() (value, set bool, err error) {
	p, err := RuncOptionsPath(c.Version())
	if err != nil {
		return false, false, err
	}
	opts, ok := lookup(c.tree, p)
	if !ok {
		return false, false, nil
	}
	v, ok := opts["SystemdCgroup"]
	if !ok {
		return false, false, nil
	}
	b, ok := v.(bool)
	if !ok {
		return false, false, errdefs.InvalidArgument("containerd config: %s.SystemdCgroup is %T, want a boolean", strings.Join(p, "."), v)
	}
	return b, true, nil
}

// SetSystemdCgroup sets the runc runtime's SystemdCgroup option, creating
// the tables on the way.
func (c *Config) SetSystemdCgroup(v bool) error {
	p, err := RuncOptionsPath(c.Version())
	if err != nil {
		return err
	}
	m := c.tree
	for i, k := range p {
		next, ok := m[k].(map[string]any)
		if !ok {
			if _, exists := m[k]; exists {
				return errdefs.InvalidArgument("containerd config: %s is not a table", k)
			}
			next = map[string]any{}
			m[k] = next
		}
		m = next
		// A runc table of our making needs its runtime type: containerd
		// replaces its default runtime entry with the decoded one.
		if p[i] == "runc" {
			if _, ok := m["runtime_type"]; !ok {
				m["runtime_type"] = RuncRuntimeType
			}
		}
	}
	m["SystemdCgroup"] = v
	return nil
}

// Encode returns the config as TOML.
func (c *Config) Encode() ([]byte, error) {
	var b bytes.Buffer
	enc := toml.NewEncoder(&b)
	enc.SetIndentTables(true)
	if err := enc.Encode(c.tree); err != nil {
		return nil, fmt.Errorf("containerd config: encode: %w", err)
	}
	return b.Bytes(), nil
}

func lookup(m map[string]any, path []string) (map[string]any, bool) {
	for _, k := range path {
		next, ok := m[k].(map[string]any)
		if !ok {
			return nil, false
		}
		m = next
	}
	return m, true
}

// ReadSystemdCgroup reads SystemdCgroup from the config file at path.
//
// It returns a NotFound error when the file does not exist and an
// InvalidArgument error when it is not a containerd config.
func ReadSystemdCgroup(path string) (value, set bool, err error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, false, errdefs.NotFound("containerd config %s does not exist", path)
	}
	if err != nil {
		return false, false, fmt.Errorf("containerd config: %w", err)
	}
	c, err := ParseConfig(b)
	if err != nil {
		return false, false, fmt.Errorf("%s: %w", path, err)
	}
	return c.SystemdCgroup()
}

// WriteSystemdCgroup makes the config file at path set SystemdCgroup to
// want, and returns what it was before ("true", "false", "unset", or
// "absent" when there was no file; a missing file is created as a
// version 2 config) and whether the file changed. A file that already says
// want is not rewritten.
//
// Equivalent to: editing `SystemdCgroup = true` under the runc runtime's
// options in /etc/containerd/config.toml.
func WriteSystemdCgroup(path string, want bool) (before string, changed bool, err error) {
	data, err := os.ReadFile(path)
	mode := os.FileMode(0o644)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		before, data = "absent", []byte("version = 2\n")
	case err != nil:
		return "", false, fmt.Errorf("containerd config: %w", err)
	default:
		if fi, err := os.Stat(path); err == nil {
			mode = fi.Mode().Perm()
		}
	}
	c, err := ParseConfig(data)
	if err != nil {
		return "", false, fmt.Errorf("%s: %w", path, err)
	}
	v, set, err := c.SystemdCgroup()
	if err != nil {
		return "", false, fmt.Errorf("%s: %w", path, err)
	}
	if before == "" {
		before = "unset"
		if set {
			before = fmt.Sprint(v)
		}
	}
	if set && v == want {
		return before, false, nil
	}
	if err := c.SetSystemdCgroup(want); err != nil {
		return before, false, fmt.Errorf("%s: %w", path, err)
	}
	out, err := c.Encode()
	if err != nil {
		return before, false, err
	}
	if err := atomicfile.Write(path, out, mode, atomicfile.MkdirAll(0o755)); err != nil {
		return before, false, err
	}
	return before, true, nil
}
