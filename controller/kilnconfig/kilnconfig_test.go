package kilnconfig

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
)

func TestWriteLoadTLS(t *testing.T) {
	ca, err := pki.NewCA("test-ca", time.Now())
	require.NoError(t, err)
	certPEM, keyPEM, err := ca.Issue(pki.RoleReader, "alice", nil, time.Hour, time.Now())
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), "kilnconfig.yaml")
	in := &Config{Server: "127.0.0.1:7443", CA: string(ca.CertPEM()), Cert: string(certPEM), Key: string(keyPEM)}
	require.NoError(t, Write(path, in))

	st, err := os.Stat(path)
	require.NoError(t, err)
	if st.Mode().Perm() != 0o600 {
		t.Errorf("Write mode = %v, want 0600", st.Mode().Perm())
	}
	out, err := Load(path)
	require.NoError(t, err)
	if *out != *in {
		t.Errorf("Load(Write(c)) = %+v, want %+v", out, in)
	}
	tc, err := out.TLS()
	require.NoError(t, err)
	if len(tc.Certificates) != 1 || tc.RootCAs == nil {
		t.Errorf("TLS() = %d certificates, RootCAs %v; want 1 and the CA", len(tc.Certificates), tc.RootCAs)
	}
}

func TestLoadErrors(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(body), 0o600))
		return p
	}
	tests := []struct {
		name string
		path string
		is   func(error) bool
	}{
		{"missing", filepath.Join(dir, "nope.yaml"), errdefs.IsNotFound},
		{"empty key", write("nokey.yaml", "server: a:1\nca: x\ncert: y\n"), errdefs.IsInvalidArgument},
		{"unknown field", write("extra.yaml", "server: a:1\nca: x\ncert: y\nkey: z\ntoken: t\n"), errdefs.IsInvalidArgument},
		{"not yaml", write("bad.yaml", "server: [\n"), errdefs.IsInvalidArgument},
	}
	for _, tt := range tests {
		_, err := Load(tt.path)
		if !tt.is(err) {
			t.Errorf("Load(%q) = %v, want a classed error", tt.name, err)
		}
	}
}
