// Package kilnconfig reads and writes the client configuration file that
// kilnctl uses to reach a controller: the API address, the controller CA
// and a client certificate and key, all PEM inline.
//
//	server: 127.0.0.1:7443
//	ca: |
//	  -----BEGIN CERTIFICATE-----
//	cert: |
//	  -----BEGIN CERTIFICATE-----
//	key: |
//	  -----BEGIN EC PRIVATE KEY-----
package kilnconfig

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"path/filepath"

	"sigs.k8s.io/yaml"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Config is the content of a kilnconfig file.
type Config struct {
	Server string `json:"server"`
	CA     string `json:"ca"`
	Cert   string `json:"cert"`
	Key    string `json:"key"`
}

// Marshal returns the YAML form of c.
func (c *Config) Marshal() ([]byte, error) {
	return yaml.Marshal(c)
}

// Write writes c to path with mode 0600 (it holds a private key),
// replacing the file atomically.
func Write(path string, c *Config) error {
	b, err := c.Marshal()
	if err != nil {
		return fmt.Errorf("kilnconfig: %w", err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".kilnconfig-*")
	if err != nil {
		return fmt.Errorf("kilnconfig: %w", err)
	}
	defer os.Remove(tmp.Name())
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return fmt.Errorf("kilnconfig: %w", err)
	}
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return fmt.Errorf("kilnconfig: write %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("kilnconfig: write %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("kilnconfig: %w", err)
	}
	return nil
}

// Load reads a kilnconfig file. A missing file is NotFound; a file
// without server, ca, cert or key is InvalidArgument.
func Load(path string) (*Config, error) {
	b, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return nil, errdefs.NotFound("kilnconfig %s does not exist", path)
	}
	if err != nil {
		return nil, fmt.Errorf("kilnconfig: %w", err)
	}
	var c Config
	if err := yaml.UnmarshalStrict(b, &c); err != nil {
		return nil, errdefs.InvalidArgument("kilnconfig %s: %v", path, err)
	}
	for k, v := range map[string]string{"server": c.Server, "ca": c.CA, "cert": c.Cert, "key": c.Key} {
		if v == "" {
			return nil, errdefs.InvalidArgument("kilnconfig %s: %s is empty", path, k)
		}
	}
	return &c, nil
}

// TLS returns a client TLS configuration that trusts only the config's CA
// and presents its certificate.
func (c *Config) TLS() (*tls.Config, error) {
	pair, err := tls.X509KeyPair([]byte(c.Cert), []byte(c.Key))
	if err != nil {
		return nil, errdefs.InvalidArgument("kilnconfig: client certificate: %v", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM([]byte(c.CA)) {
		return nil, errdefs.InvalidArgument("kilnconfig: ca holds no PEM certificate")
	}
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		RootCAs:      pool,
		Certificates: []tls.Certificate{pair},
	}, nil
}
