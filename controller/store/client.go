package store

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Dial returns an etcd client for endpoints (an embedded member's
// Endpoints, or the --etcd-endpoints of an external cluster), with TLS when
// tlsConfig is set. It does not wait for a connection: the first request
// does, and fails with Unavailable when no endpoint answers. With several
// endpoints the client fails over between them when a member goes away.
//
// opts are extra gRPC dial options (an interceptor timing requests).
func Dial(endpoints []string, tlsConfig *tls.Config, opts ...grpc.DialOption) (*clientv3.Client, error) {
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
		DialOptions:          append([]grpc.DialOption{grpc.WithContextDialer(dialEtcd)}, opts...),
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

// CheckTLS tells why members refuse a TLS connection, which the etcd
// client reports only as a timeout: it dials each endpoint, completes the
// TLS handshake with cfg and waits briefly for the member's answer (with
// TLS 1.3 a member rejects a client certificate after the handshake). It
// returns the first refusal, naming the endpoint and the TLS error, or nil
// when no member refused (members that do not answer at all are not its
// business: the caller retries those).
func CheckTLS(ctx context.Context, endpoints []string, cfg *tls.Config) error {
	for _, ep := range endpoints {
		u, err := url.Parse(ep)
		if err != nil || u.Scheme != "https" {
			continue
		}
		if err := checkTLS(ctx, u.Host, cfg); err != nil {
			return fmt.Errorf("etcd %s refused the TLS connection: %w", ep, err)
		}
	}
	return nil
}

func checkTLS(ctx context.Context, hostport string, cfg *tls.Config) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	c := cfg.Clone()
	if c.ServerName == "" {
		host, _, err := net.SplitHostPort(hostport)
		if err != nil {
			return nil
		}
		c.ServerName = host
	}
	c.NextProtos = []string{"h2"}
	raw, err := (&net.Dialer{}).DialContext(ctx, "tcp", hostport)
	if err != nil {
		return nil // not answering: not a TLS refusal
	}
	conn := tls.Client(raw, c)
	defer conn.Close()
	if err := conn.HandshakeContext(ctx); err != nil {
		return err
	}
	// A refused client certificate arrives as an alert on the first read;
	// a member that accepted us waits for the HTTP/2 preface instead.
	_ = conn.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	var b [1]byte
	if _, err := conn.Read(b[:]); err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return nil
		}
		return err // "remote error: tls: certificate required", EOF
	}
	return nil
}

// socketBuffer is the send and receive buffer of a client's unix socket
// to etcd. A unix socket's default (net.core.wmem_default, 208 KiB) never
// grows, and grpc-go since v1.82.1 can then wedge the connection for
// ever under many concurrent requests: each end stops reading while its
// writer waits on a full socket that the other end no longer reads
// (grpc/grpc-go#9330, TestManyRequestsOnTheUnixSocket). With room for a
// burst on the client's side, its writer does not block, so it keeps
// reading and the cycle cannot close. TCP sockets grow their own buffers
// (net.ipv4.tcp_wmem) and are left alone.
const socketBuffer = 8 << 20

// dialEtcd dials an etcd address as gRPC gives it to a custom dialer
// ("unix:///abs/path", "unix:rel/path" or "host:port") and, on a unix
// socket, sets socketBuffer: with SO_SNDBUFFORCE and SO_RCVBUFFORCE when
// the process may (root, CAP_NET_ADMIN: the controller), else as far as
// net.core.wmem_max and rmem_max allow.
func dialEtcd(ctx context.Context, addr string) (net.Conn, error) {
	network, address := "tcp", addr
	switch {
	case strings.HasPrefix(addr, "unix://"):
		network, address = "unix", strings.TrimPrefix(addr, "unix://")
	case strings.HasPrefix(addr, "unix:"):
		network, address = "unix", strings.TrimPrefix(addr, "unix:")
	}
	d := net.Dialer{KeepAlive: 30 * time.Second}
	c, err := d.DialContext(ctx, network, address)
	if err != nil {
		return nil, err
	}
	if uc, ok := c.(*net.UnixConn); ok {
		setSocketBuffers(uc, socketBuffer)
	}
	return c, nil
}
