package controller_test

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/datadir"
	"github.com/kilnhq/kiln/controller/operatorcert"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/kilnconfig"
	"github.com/kilnhq/kiln/internal/pki"
)

// tlsEtcd is a real etcd member in dir that serves clients over TLS and
// requires client certificates signed by its CA, and the PEM files of
// that CA and of a client certificate it accepts. The member stops when
// the test ends.
type tlsEtcd struct {
	endpoints                 []string
	caFile, certFile, keyFile string
	write                     func(name string, data []byte) string
}

func startTLSEtcd(ctx context.Context, t *testing.T, dir string) tlsEtcd {
	t.Helper()
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, data, 0o600))
		return p
	}
	etcdCA, err := pki.NewCA("etcd-ca", time.Now())
	require.NoError(t, err)
	srvCert, srvKey, err := etcdCA.Issue(pki.RoleController, "etcd", []string{"127.0.0.1", "localhost"}, time.Hour, time.Now())
	require.NoError(t, err)
	cliCert, cliKey, err := etcdCA.Issue(pki.RoleController, "kiln-controller", nil, time.Hour, time.Now())
	require.NoError(t, err)
	u, err := store.FreeLoopbackURL()
	require.NoError(t, err)
	e := tlsEtcd{caFile: write("etcd-ca.crt", etcdCA.CertPEM()), certFile: write("client.crt", cliCert), keyFile: write("client.key", cliKey), write: write}
	emb, err := store.StartEmbedded(ctx, store.EmbeddedConfig{
		DataDir:   filepath.Join(dir, "etcd"),
		ClientURL: strings.Replace(u, "http://", "https://", 1),
		TLS: &store.EmbeddedTLS{
			CertFile:      write("etcd.crt", srvCert),
			KeyFile:       write("etcd.key", srvKey),
			TrustedCAFile: e.caFile,
		},
	})
	require.NoError(t, err)
	t.Cleanup(emb.Close)
	e.endpoints = emb.Endpoints()
	return e
}

// TestExternalEtcdOverTLS: a controller reaches an external etcd that
// serves clients over TLS and requires client certificates (as a
// production etcd cluster does) with --etcd-cacert, --etcd-cert and
// --etcd-key, keeps its state there, and operator-cert reaches the same
// etcd with the same flags.
func TestExternalEtcdOverTLS(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := t.TempDir()
	etcd := startTLSEtcd(ctx, t, dir)

	cfg := controller.Config{
		DataDir:       filepath.Join(dir, "controller"),
		ListenAddr:    "127.0.0.1:0",
		EtcdEndpoints: etcd.endpoints,
		EtcdCAFile:    etcd.caFile,
		EtcdCertFile:  etcd.certFile,
		EtcdKeyFile:   etcd.keyFile,
	}
	var logs syncBuffer
	c, err := controller.New(cfg, slog.New(slog.NewTextHandler(&logs, nil)))
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	select {
	case <-c.Ready():
	case err := <-done:
		t.Fatalf("controller exited: %v; log:\n%s", err, logs.String())
	case <-ctx.Done():
		t.Fatalf("controller not ready on a TLS etcd; log:\n%s", logs.String())
	}
	require.Contains(t, logs.String(), "tls=true", "the controller's log says it reaches etcd over TLS")

	// Its CA lives in the external etcd: read it there with the same files.
	tlsCfg, err := store.ClientTLS(cfg.EtcdCAFile, cfg.EtcdCertFile, cfg.EtcdKeyFile)
	require.NoError(t, err)
	cl, err := store.Dial(etcd.endpoints, tlsCfg)
	require.NoError(t, err)
	defer cl.Close()
	resp, err := cl.Get(ctx, "/kiln/v1/pki/ca.crt")
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1, "the controller's CA is not in the external etcd")

	// operator-cert reaches the same etcd with the same flags.
	out := filepath.Join(dir, "alice.yaml")
	require.NoError(t, operatorcert.Write(ctx, datadir.Config{DataDir: cfg.DataDir, EtcdEndpoints: cfg.EtcdEndpoints, EtcdCAFile: cfg.EtcdCAFile, EtcdCertFile: cfg.EtcdCertFile, EtcdKeyFile: cfg.EtcdKeyFile}, operatorcert.Request{
		Role: "reader", Name: "alice", Out: out, Server: c.Addr(),
	}, nil))
	kc, err := kilnconfig.Load(out)
	require.NoError(t, err)
	require.Equal(t, c.Addr(), kc.Server)

	stop()
	require.NoError(t, <-done)
}

// TestExternalEtcdTLSRefusalExplained: when the members refuse the
// controller's TLS (no client certificate, a CA that did not sign them),
// the controller keeps waiting for etcd and its log says why and which
// flags to check; the etcd client alone only reports a timeout.
func TestExternalEtcdTLSRefusalExplained(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for a 5 s etcd request timeout: skipped with -short")
	}
	otherCA, err := pki.NewCA("other-ca", time.Now())
	require.NoError(t, err)
	// t.Cleanup, not defer: the subtests run in parallel after this
	// function returns.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	etcd := startTLSEtcd(ctx, t, t.TempDir())

	for _, tc := range []struct {
		name, ca, cert, key, want string
	}{
		{"no client certificate", etcd.caFile, "", "", "certificate required"},
		{"CA that did not sign the members", etcd.write("other-ca.crt", otherCA.CertPEM()), etcd.certFile, etcd.keyFile, "x509:"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var logs syncBuffer
			c, err := controller.New(controller.Config{
				DataDir: t.TempDir(), ListenAddr: "127.0.0.1:0", EtcdEndpoints: etcd.endpoints,
				EtcdCAFile: tc.ca, EtcdCertFile: tc.cert, EtcdKeyFile: tc.key,
			}, slog.New(slog.NewTextHandler(&logs, nil)))
			require.NoError(t, err)
			runCtx, stop := context.WithTimeout(ctx, 30*time.Second)
			defer stop()
			done := make(chan error, 1)
			go func() { done <- c.Run(runCtx) }()
			for !strings.Contains(logs.String(), "etcd unavailable, retrying") {
				select {
				case err := <-done:
					t.Fatalf("controller exited: %v; log:\n%s", err, logs.String())
				case <-c.Ready():
					t.Fatalf("controller became ready with a refused TLS configuration; log:\n%s", logs.String())
				case <-runCtx.Done():
					t.Fatalf("controller never reported waiting for etcd; log:\n%s", logs.String())
				case <-time.After(50 * time.Millisecond):
				}
			}
			stop()
			<-done
			log := logs.String()
			require.Contains(t, log, "refused the TLS connection")
			require.Contains(t, log, tc.want)
			require.Contains(t, log, "check --etcd-cacert, --etcd-cert and --etcd-key")
		})
	}
}

// TestExternalEtcdTLSFlagsRefused: TLS settings that cannot work are
// refused by New, before anything is created, with the fix.
func TestExternalEtcdTLSFlagsRefused(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  controller.Config
		want string
	}{
		{"TLS files without an external etcd", controller.Config{EtcdCAFile: "ca.crt"}, "pass its https:// client URLs with --etcd-endpoints"},
		{"mixed schemes", controller.Config{EtcdEndpoints: []string{"http://10.0.0.1:2379", "https://10.0.0.2:2379"}}, "mixes http:// (http://10.0.0.1:2379) and https://"},
		{"TLS files for http endpoints", controller.Config{EtcdEndpoints: []string{"http://10.0.0.1:2379"}, EtcdCAFile: "ca.crt"}, "use the members' https:// client URLs"},
		{"certificate without key", controller.Config{EtcdEndpoints: []string{"https://10.0.0.1:2379"}, EtcdCertFile: "c.crt"}, "--etcd-cert and --etcd-key go together"},
		{"no scheme", controller.Config{EtcdEndpoints: []string{"10.0.0.1:2379"}}, `etcd endpoint "10.0.0.1:2379": want a client URL`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dataDir := filepath.Join(t.TempDir(), "controller")
			tc.cfg.DataDir = dataDir
			_, err := controller.New(tc.cfg, nil)
			require.Error(t, err)
			require.True(t, errdefs.IsInvalidArgument(err), "New() = %v, want InvalidArgument", err)
			require.Contains(t, err.Error(), tc.want)
			require.NoDirExists(t, dataDir, "a refused configuration created the data directory")
		})
	}
}
