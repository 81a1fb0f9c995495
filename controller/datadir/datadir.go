// Package datadir reaches a controller's state: the etcd it keeps its
// store in (an external cluster, the embedded member of a controller
// running on the data directory, or one started here on a stopped
// controller's data directory) and the secret key file sealing its
// secrets. The controller opens its etcd through it, and so do the
// commands that work on a controller's data from outside it (operator
// certificates, restore, secret key and CA rotation).
package datadir

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// Config names a controller's state: the flags every kiln-controller
// command takes (--data-dir, --secret-key-file, --etcd-*).
type Config struct {
	// DataDir holds the embedded etcd, the sealing key and the admin
	// kilnconfig.
	DataDir string
	// SecretKeyFile is the AES-256 key sealing secrets at rest (default
	// DataDir/secret.key).
	SecretKeyFile string
	// EtcdEndpoints are the client URLs of an external etcd cluster;
	// empty: the single-member etcd embedded in DataDir/etcd.
	EtcdEndpoints []string
	// EtcdCAFile, EtcdCertFile and EtcdKeyFile are PEM files for an
	// external etcd served over TLS (https:// endpoints), as etcdctl's
	// --cacert, --cert and --key.
	EtcdCAFile, EtcdCertFile, EtcdKeyFile string
}

// KeyFile is the secret key file: SecretKeyFile, or DataDir/secret.key.
func (cfg Config) KeyFile() string {
	if cfg.SecretKeyFile != "" {
		return cfg.SecretKeyFile
	}
	return filepath.Join(cfg.DataDir, "secret.key")
}

// EtcdDir is the embedded etcd's directory.
func (cfg Config) EtcdDir() string { return filepath.Join(cfg.DataDir, "etcd") }

// URLFile records the client URL of the embedded etcd while the
// controller runs, for the commands that reach it from outside (Open).
const URLFile = "etcd.url"

// TLS reports whether the external etcd is reached over TLS: an https://
// endpoint or a TLS file names it.
func (cfg Config) TLS() bool {
	if cfg.EtcdCAFile != "" || cfg.EtcdCertFile != "" || cfg.EtcdKeyFile != "" {
		return true
	}
	for _, e := range cfg.EtcdEndpoints {
		if strings.HasPrefix(e, "https://") {
			return true
		}
	}
	return false
}

// Check refuses TLS files without an external etcd, endpoints that mix
// http:// and https://, TLS files for http:// endpoints, and a client
// certificate without its key, before anything is touched. It returns
// InvalidArgument.
func (cfg Config) Check() error {
	files := cfg.EtcdCAFile != "" || cfg.EtcdCertFile != "" || cfg.EtcdKeyFile != ""
	if len(cfg.EtcdEndpoints) == 0 {
		if files {
			return errdefs.InvalidArgument("controller: --etcd-cacert, --etcd-cert and --etcd-key are for an external etcd: pass its https:// client URLs with --etcd-endpoints (the embedded etcd serves only the controller, on a unix socket in its data directory)")
		}
		return nil
	}
	var plain, secure []string
	for _, e := range cfg.EtcdEndpoints {
		switch {
		case strings.HasPrefix(e, "https://"):
			secure = append(secure, e)
		case strings.HasPrefix(e, "http://"):
			plain = append(plain, e)
		default:
			return errdefs.InvalidArgument("controller: etcd endpoint %q: want a client URL, http://HOST:PORT or https://HOST:PORT", e)
		}
	}
	if len(plain) > 0 && len(secure) > 0 {
		return errdefs.InvalidArgument("controller: --etcd-endpoints mixes http:// (%s) and https:// (%s): an etcd cluster serves clients one way; use https:// for all", strings.Join(plain, ","), strings.Join(secure, ","))
	}
	if len(plain) > 0 && files {
		return errdefs.InvalidArgument("controller: --etcd-cacert/--etcd-cert/--etcd-key given but --etcd-endpoints are http:// (%s): use the members' https:// client URLs", strings.Join(plain, ","))
	}
	if (cfg.EtcdCertFile == "") != (cfg.EtcdKeyFile == "") {
		return errdefs.InvalidArgument("controller: --etcd-cert and --etcd-key go together: pass both the client certificate and its key")
	}
	return nil
}

// DialExternal connects to cfg's external etcd, over TLS with cfg's
// files (returned) when it serves https://. It returns Unavailable when
// the client cannot be made and the errors of store.ClientTLS.
func DialExternal(cfg Config, opts ...grpc.DialOption) (*clientv3.Client, *tls.Config, error) {
	if !cfg.TLS() {
		cl, err := Dial(cfg.EtcdEndpoints, nil, opts...)
		return cl, nil, err
	}
	tlsCfg, err := store.ClientTLS(cfg.EtcdCAFile, cfg.EtcdCertFile, cfg.EtcdKeyFile)
	if err != nil {
		return nil, nil, fmt.Errorf("controller: %w", err)
	}
	cl, err := Dial(cfg.EtcdEndpoints, tlsCfg, opts...)
	return cl, tlsCfg, err
}

// Dial makes a client of endpoints (store.Dial); it returns Unavailable
// when it cannot.
func Dial(endpoints []string, tlsCfg *tls.Config, opts ...grpc.DialOption) (*clientv3.Client, error) {
	cl, err := store.Dial(endpoints, tlsCfg, opts...)
	if err != nil {
		return nil, errdefs.Unavailable("controller: %w", err)
	}
	return cl, nil
}

// Open reaches the controller's etcd from outside the controller: the
// external endpoints, the running controller's embedded member, or an
// embedded member started here when the controller is stopped. The
// returned function closes what Open opened. It returns the errors of
// Check, DialExternal and store.StartEmbedded.
func Open(ctx context.Context, cfg Config, log *slog.Logger) (*clientv3.Client, func(), error) {
	if len(cfg.EtcdEndpoints) > 0 {
		if err := cfg.Check(); err != nil {
			return nil, nil, err
		}
		cl, _, err := DialExternal(cfg)
		if err != nil {
			return nil, nil, err
		}
		return cl, func() { cl.Close() }, nil
	}
	if cl := DialRunning(ctx, cfg.DataDir); cl != nil {
		return cl, func() { cl.Close() }, nil
	}
	emb, err := store.StartEmbedded(ctx, store.EmbeddedConfig{
		DataDir:      cfg.EtcdDir(),
		Logger:       log,
		ReadyTimeout: 20 * time.Second,
	})
	if err != nil {
		return nil, nil, fmt.Errorf("open the controller's embedded etcd (is the controller running with another data directory?): %w", err)
	}
	cl, err := Dial(emb.Endpoints(), nil)
	if err != nil {
		emb.Close()
		return nil, nil, err
	}
	return cl, func() { cl.Close(); emb.Close() }, nil
}

// DialRunning returns a client of the embedded etcd of a controller
// running on dataDir (the client URL it recorded there in URLFile, if it
// answers within 3 s), or nil.
func DialRunning(ctx context.Context, dataDir string) *clientv3.Client {
	b, err := os.ReadFile(filepath.Join(dataDir, URLFile))
	if err != nil {
		return nil
	}
	cl, err := Dial(strings.Split(strings.TrimSpace(string(b)), ","), nil)
	if err != nil {
		return nil
	}
	pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if _, err := cl.Get(pctx, store.Prefix, clientv3.WithCountOnly()); err != nil {
		cl.Close()
		return nil
	}
	return cl
}
