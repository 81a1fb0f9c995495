package store

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
)

// TestTLSEtcd runs etcd with client-certificate TLS, as an external
// production cluster is, and checks that the store reaches it with
// ClientTLS files and that a client without a certificate is refused.
func TestTLSEtcd(t *testing.T) {
	ctx := testCtx(t)
	dir := t.TempDir()
	ca, err := pki.NewCA("etcd-ca", time.Now())
	require.NoError(t, err)
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, data, 0o600))
		return p
	}
	caFile := write("ca.crt", ca.CertPEM())
	srvCert, srvKey, err := ca.Issue(pki.RoleController, "etcd", []string{"127.0.0.1", "localhost"}, time.Hour, time.Now())
	require.NoError(t, err)
	cliCert, cliKey, err := ca.Issue(pki.RoleController, pki.ControllerName, nil, time.Hour, time.Now())
	require.NoError(t, err)

	u, err := FreeLoopbackURL()
	require.NoError(t, err)
	e, err := StartEmbedded(ctx, EmbeddedConfig{
		DataDir:   filepath.Join(dir, "etcd"),
		ClientURL: strings.Replace(u, "http://", "https://", 1),
		TLS: &EmbeddedTLS{
			CertFile:      write("etcd.crt", srvCert),
			KeyFile:       write("etcd.key", srvKey),
			TrustedCAFile: caFile,
		},
		Logger: testLogger(t),
	})
	require.NoError(t, err)
	defer e.Close()

	tlsCfg, err := ClientTLS(caFile, write("client.crt", cliCert), write("client.key", cliKey))
	require.NoError(t, err)
	c, err := Dial(e.Endpoints(), tlsCfg)
	require.NoError(t, err)
	defer c.Close()
	s := New(c)
	_, err = s.Create(ctx, "hosts", "rack1-01", host("rack1-01", ""))
	require.NoError(t, err)

	// Without a client certificate the member refuses the connection.
	noCert, err := ClientTLS(caFile, "", "")
	require.NoError(t, err)
	c2, err := Dial(e.Endpoints(), noCert)
	require.NoError(t, err)
	defer c2.Close()
	short, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if _, err := New(c2).Create(short, "hosts", "rack1-02", host("rack1-02", "")); err == nil {
		t.Error("Create() without a client certificate succeeded, want an error")
	}

	if _, err := ClientTLS(caFile, "client.crt", ""); !errdefs.IsInvalidArgument(err) {
		t.Errorf("ClientTLS(cert without key) = %v, want InvalidArgument", err)
	}
	if _, err := ClientTLS(write("junk.crt", []byte("junk")), "", ""); !errdefs.IsInvalidArgument(err) {
		t.Errorf("ClientTLS(junk CA) = %v, want InvalidArgument", err)
	}
}
