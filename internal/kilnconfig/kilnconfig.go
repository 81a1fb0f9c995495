// Package kilnconfig finds, reads and dials the client configuration that
// kilnctl uses to reach a controller: the API address, the controller's CA
// and an operator certificate and key, all PEM inline in one YAML file.
//
//	server: 127.0.0.1:7443
//	ca: |
//	  -----BEGIN CERTIFICATE-----
//	  ...
//	cert: |
//	  -----BEGIN CERTIFICATE-----
//	  ...
//	key: |
//	  -----BEGIN EC PRIVATE KEY-----
//	  ...
//
// The file is found from --kilnconfig, else $KILNCONFIG, else
// ~/.kiln/config. The controller writes one for its admin to
// DATA_DIR/kilnconfig-admin.yaml. The format is the one
// controller/kilnconfig writes (a test keeps the two in step).
package kilnconfig

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"sigs.k8s.io/yaml"

	"github.com/kilnhq/kiln/internal/atomicfile"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
)

// EnvVar names the environment variable holding the config path.
const EnvVar = "KILNCONFIG"

// Config is the content of a kilnconfig file. Cert and Key are secrets in
// the sense that Key is: never print a Config.
type Config struct {
	Server string `json:"server"`
	CA     string `json:"ca"`
	Cert   string `json:"cert"`
	Key    string `json:"key"`

	// Path is the file the config was read from; not part of the file.
	Path string `json:"-"`
}

// missingHint is appended to every "no config" error.
const missingHint = "pass --kilnconfig or set KILNCONFIG; the controller writes DATA_DIR/kilnconfig-admin.yaml"

// Resolve returns the path of the config file: flagValue when not empty,
// else $KILNCONFIG, else ~/.kiln/config. getenv is os.Getenv in
// production. It does not check that the file exists.
func Resolve(flagValue string, getenv func(string) string) string {
	if flagValue != "" {
		return flagValue
	}
	if p := getenv(EnvVar); p != "" {
		return p
	}
	home := getenv("HOME")
	if home == "" {
		if h, err := os.UserHomeDir(); err == nil {
			home = h
		}
	}
	return filepath.Join(home, ".kiln", "config")
}

// Load reads and checks the config file at path. A missing file is
// errdefs.NotFound with a hint saying where configs come from; a file that
// is not valid YAML, has unknown keys or lacks server, ca, cert or key is
// errdefs.InvalidArgument. Errors never include the key.
func Load(path string) (*Config, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, errdefs.NotFound("no kilnctl config at %s: %s", path, missingHint)
	}
	if err != nil {
		return nil, fmt.Errorf("kilnctl config: %w", err)
	}
	var c Config
	if err := yaml.UnmarshalStrict(b, &c); err != nil {
		return nil, errdefs.InvalidArgument("kilnctl config %s is not a kilnconfig file: %v", path, err)
	}
	var missing []string
	for _, f := range []struct{ name, v string }{{"server", c.Server}, {"ca", c.CA}, {"cert", c.Cert}, {"key", c.Key}} {
		if strings.TrimSpace(f.v) == "" {
			missing = append(missing, f.name)
		}
	}
	if len(missing) > 0 {
		return nil, errdefs.InvalidArgument("kilnctl config %s lacks %s: %s", path, strings.Join(missing, ", "), missingHint)
	}
	c.Path = path
	return &c, nil
}

// Write writes c to path with mode 0600 (it holds a private key),
// replacing any file there atomically. The directory must exist.
func Write(path string, c *Config) error {
	b, err := yaml.Marshal(c)
	if err != nil {
		return fmt.Errorf("kilnconfig: %w", err)
	}
	if err := atomicfile.Write(path, b, 0o600); err != nil {
		return fmt.Errorf("kilnconfig: %w", err)
	}
	return nil
}

// TLS returns a client TLS configuration that trusts only the config's CA
// and presents its certificate. Bad PEM is errdefs.InvalidArgument.
func (c *Config) TLS() (*tls.Config, error) {
	pair, err := tls.X509KeyPair([]byte(c.Cert), []byte(c.Key))
	if err != nil {
		// tls errors never quote the key material.
		return nil, errdefs.InvalidArgument("kilnctl config %s: cert and key: %v", c.Path, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM([]byte(c.CA)) {
		return nil, errdefs.InvalidArgument("kilnctl config %s: ca holds no PEM certificate", c.Path)
	}
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		RootCAs:      pool,
		Certificates: []tls.Certificate{pair},
		// The CA and the address are not enough: agents hold certificates
		// of the same CA. Only a certificate with the controller role is
		// the controller (issue 12: an agent's certificate received a BMC
		// password from kilnctl apply).
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return errdefs.PermissionDenied("server %s presented no certificate", c.Server)
			}
			if err := pki.RequireRole(cs.PeerCertificates[0], pki.RoleController); err != nil {
				return errdefs.PermissionDenied("server %s is not the Kiln controller: %w", c.Server, err)
			}
			return nil
		},
	}, nil
}

// Dial returns a gRPC client connection to the controller named by c,
// authenticated with mutual TLS. It does not block: connection errors
// surface on the first call. ctx is reserved for blocking dials.
func Dial(ctx context.Context, c *Config, opts ...grpc.DialOption) (*grpc.ClientConn, error) {
	_ = ctx
	tc, err := c.TLS()
	if err != nil {
		return nil, err
	}
	opts = append([]grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(tc))}, opts...)
	conn, err := grpc.NewClient(c.Server, opts...)
	if err != nil {
		return nil, errdefs.InvalidArgument("kilnctl config %s: server %q: %v", c.Path, c.Server, err)
	}
	return conn, nil
}
