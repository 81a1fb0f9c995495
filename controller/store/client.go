package store

import (
	"crypto/tls"
	"fmt"
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
