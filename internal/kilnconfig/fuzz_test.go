package kilnconfig

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
)

// FuzzLoad reads kilnconfig files made of a fuzzed head and a fuzzed
// private key block, as a hand-edited or damaged ~/.kiln/config would be.
// Properties:
//   - a refusal is InvalidArgument and never quotes a line of the key,
//     whether the YAML, a field or the PEM is what is wrong (TLS too);
//   - a file Load accepts, written back by Write, loads equal.
func FuzzLoad(f *testing.F) {
	now := time.Now()
	ca, err := pki.NewCA("kiln fuzz CA", now)
	if err != nil {
		f.Fatal(err)
	}
	cert, key, err := ca.Issue(pki.RoleOperator, "alice", nil, time.Hour, now)
	if err != nil {
		f.Fatal(err)
	}
	head := "server: 127.0.0.1:7443\nca: |\n" + indent(string(ca.CertPEM())) + "cert: |\n" + indent(string(cert))
	f.Add([]byte(head), string(key))
	f.Add([]byte("server: 127.0.0.1:7443\nca: x\ncert: y\n"), "-----BEGIN EC PRIVATE KEY-----\nc2VjcmV0LWtleS1ieXRlcw==\n-----END EC PRIVATE KEY-----\n")
	f.Add([]byte("server: [\n"), string(key))
	f.Add([]byte("server: a:1\nca: x\ncert: x\ntoken: y\n"), "MHcCAQEEIB0secretsecretsecret")
	f.Add([]byte(head), "\"unterminated MHcCAQEEIB0secretsecretsecret\n  : x")
	f.Add([]byte(head), "  - [MHcCAQEEIB0secretsecretsecret, {a: b}]")
	dir := f.TempDir()

	f.Fuzz(func(t *testing.T, head []byte, key string) {
		path := filepath.Join(dir, "config")
		data := append(append([]byte(nil), head...), "\nkey: |\n"+indent(key)...)
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		leaks := func(what string, err error) {
			for _, l := range strings.Split(key, "\n") {
				l = strings.TrimSpace(l)
				if len(l) >= 12 && !strings.Contains(string(head), l) && !strings.Contains(path, l) && strings.Contains(err.Error(), l) {
					t.Fatalf("%s error quotes key line %q: %v", what, l, err)
				}
			}
		}
		c, err := Load(path)
		if err != nil {
			if !errdefs.IsInvalidArgument(err) {
				t.Fatalf("Load() = %v, want InvalidArgument", err)
			}
			leaks("Load", err)
			return
		}
		if _, err := c.TLS(); err != nil {
			leaks("TLS", err)
		}
		out := filepath.Join(dir, "written")
		if err := Write(out, c); err != nil {
			t.Fatalf("Write(Load(x)): %v", err)
		}
		back, err := Load(out)
		if err != nil {
			t.Fatalf("Load(Write(Load(x))): %v", err)
		}
		back.Path = c.Path
		if *back != *c {
			t.Fatalf("Load(Write(c)) = %+v, want %+v", back, c)
		}
	})
}

func indent(s string) string {
	var b strings.Builder
	for _, l := range strings.SplitAfter(s, "\n") {
		if l != "" {
			b.WriteString("  " + l)
		}
	}
	if !strings.HasSuffix(b.String(), "\n") {
		b.WriteString("\n")
	}
	return b.String()
}
