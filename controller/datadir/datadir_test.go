package datadir_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/datadir"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
)

func TestKeyFile(t *testing.T) {
	tests := []struct {
		cfg  datadir.Config
		want string
	}{
		{datadir.Config{DataDir: "/var/lib/kiln-controller"}, "/var/lib/kiln-controller/secret.key"},
		{datadir.Config{DataDir: "/var/lib/kiln-controller", SecretKeyFile: "/etc/kiln/secret.key"}, "/etc/kiln/secret.key"},
	}
	for _, tt := range tests {
		if got := tt.cfg.KeyFile(); got != tt.want {
			t.Errorf("%+v.KeyFile() = %q, want %q", tt.cfg, got, tt.want)
		}
	}
}

func TestCheck(t *testing.T) {
	tests := []struct {
		name string
		cfg  datadir.Config
		bad  string // "" when accepted
	}{
		{"embedded", datadir.Config{DataDir: "d"}, ""},
		{"plain external", datadir.Config{EtcdEndpoints: []string{"http://10.0.0.1:2379"}}, ""},
		{"TLS external", datadir.Config{EtcdEndpoints: []string{"https://10.0.0.1:2379"}, EtcdCertFile: "c", EtcdKeyFile: "k"}, ""},
		{"TLS files without an external etcd", datadir.Config{EtcdCAFile: "ca.crt"}, "--etcd-endpoints"},
		{"mixed schemes", datadir.Config{EtcdEndpoints: []string{"http://10.0.0.1:2379", "https://10.0.0.2:2379"}}, "mixes http://"},
		{"certificate without key", datadir.Config{EtcdEndpoints: []string{"https://10.0.0.1:2379"}, EtcdCertFile: "c"}, "go together"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Check()
			switch {
			case tt.bad == "" && err != nil:
				t.Errorf("Check() = %v, want nil", err)
			case tt.bad != "" && (!errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), tt.bad)):
				t.Errorf("Check() = %v, want InvalidArgument naming %q", err, tt.bad)
			}
		})
	}
}

// TestOpen reaches a stopped controller's data directory (an embedded etcd
// started for the call, holding what an earlier call wrote) and a running
// one's through the client URL it records in etcd.url.
func TestOpen(t *testing.T) {
	if testing.Short() {
		t.Skip("starts embedded etcd")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg := datadir.Config{DataDir: t.TempDir()}
	require.Nil(t, datadir.DialRunning(ctx, cfg.DataDir), "DialRunning with no controller running")

	cl, done, err := datadir.Open(ctx, cfg, nil)
	require.NoError(t, err)
	_, err = cl.Put(ctx, store.Prefix+"test/mark", "1")
	require.NoError(t, err)
	done()

	// The controller starts on the data directory and records its URL.
	emb, err := store.StartEmbedded(ctx, store.EmbeddedConfig{DataDir: cfg.EtcdDir()})
	require.NoError(t, err)
	defer emb.Close()
	require.NoError(t, os.WriteFile(filepath.Join(cfg.DataDir, datadir.URLFile), []byte(strings.Join(emb.Endpoints(), ",")), 0o600))
	cl, done, err = datadir.Open(ctx, cfg, nil)
	require.NoError(t, err)
	defer done()
	resp, err := cl.Get(ctx, store.Prefix+"test/mark")
	require.NoError(t, err)
	if len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "1" {
		t.Errorf("Get(mark) through the running controller's etcd = %v, want the value written while it was stopped", resp.Kvs)
	}
}
