package cli

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// TestReadBMCPassword: the password of kilnctl lab bmc comes from a file
// (its trailing newline dropped) or the environment, never the command
// line.
func TestReadBMCPassword(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "pw")
	if err := os.WriteFile(file, []byte("from-file\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, file, env, want string
		invalid, fails        bool
	}{
		{name: "file", file: file, env: "from-env", want: "from-file"},
		{name: "env", env: "from-env", want: "from-env"},
		{name: "neither", invalid: true},
		{name: "empty file", file: empty, invalid: true},
		{name: "missing file", file: filepath.Join(dir, "nope"), fails: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(BMCPasswordEnv, tc.env)
			got, err := readBMCPassword(tc.file)
			switch {
			case tc.invalid && !errdefs.IsInvalidArgument(err):
				t.Errorf("readBMCPassword(%q) = %q, %v; want InvalidArgument", tc.file, got, err)
			case tc.fails && err == nil:
				t.Errorf("readBMCPassword(%q) = %q, nil; want an error", tc.file, got)
			case !tc.invalid && !tc.fails && (err != nil || got != tc.want):
				t.Errorf("readBMCPassword(%q) = %q, %v; want %q", tc.file, got, err, tc.want)
			}
		})
	}
	if f := labBMCCommand().Flags().Lookup("password"); f != nil {
		t.Errorf("kilnctl lab bmc has a --password flag: a password on the command line shows in ps")
	}
}
