package store

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Dial returns an etcd client for endpoints (an embedded member's
// Endpoints, or the --etcd-endpoints of an external cluster), with TLS when
// tlsConfig is set. It does not wait for a connection: the first request
// does, and fails with Unavailable when no endpoint answers. With several
// endpoints the client fails over between them when a member goes away.
func Dial(endpoints []string, tlsConfig *tls.Config) (*clientv3.Client, error) {
	if len(endpoints) == 0 {
		return nil, errdefs.InvalidArgument("etcd: no endpoints")
	}
	c, err := clientv3.New(clientv3.Config{
		Endpoints:            endpoints,
		DialTimeout:          5 * time.Second,
		DialKeepAliveTime:    10 * time.Second,
		DialKeepAliveTimeout: 5 * time.Second,
		TLS:                  tlsConfig,
		Logger:               zap.NewNop(),
	})
	if err != nil {
		return nil, fmt.Errorf("etcd %v: %w", endpoints, err)
	}
	return c, nil
}

// ClientTLS builds the TLS configuration for an external etcd from PEM
// files, as etcdctl's --cacert, --cert and --key: caFile verifies the
// members' certificates; certFile and keyFile (both or neither) are the
// controller's client certificate. It returns InvalidArgument when a file
// does not parse.
func ClientTLS(caFile, certFile, keyFile string) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pemData, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("etcd CA: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pemData) {
			return nil, errdefs.InvalidArgument("etcd CA %s: no PEM certificate", caFile)
		}
		cfg.RootCAs = pool
	}
	if (certFile == "") != (keyFile == "") {
		return nil, errdefs.InvalidArgument("etcd client certificate: need both a certificate and a key file")
	}
	if certFile != "" {
		pair, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, errdefs.InvalidArgument("etcd client certificate %s: %w", certFile, err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg, nil
}
