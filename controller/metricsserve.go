package controller

import (
	"context"
	"fmt"
	"net"

	"google.golang.org/grpc"

	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/metrics"
	"github.com/kilnhq/kiln/controller/store"
)

// serveMetrics serves Config.MetricsListenAddr when it is set: the
// fleet read from st at scrape time, leadership, and what the executors,
// BMCs, enrollment and boot server record. It returns a function that
// stops serving.
func (c *Controller) serveMetrics(ctx context.Context, st *store.Store) (func(), error) {
	if c.metrics == nil {
		return func() {}, nil
	}
	if err := c.metrics.Register(metrics.NewFleet(st, 0, c.log)); err != nil {
		return nil, fmt.Errorf("controller: metrics: %w", err)
	}
	if err := c.metrics.Register(metrics.NewEtcdDB(st, 0, c.log)); err != nil {
		return nil, fmt.Errorf("controller: metrics: %w", err)
	}
	if err := c.metrics.Leader(c.IsLeader); err != nil {
		return nil, fmt.Errorf("controller: metrics: %w", err)
	}
	lis, err := net.Listen("tcp", c.cfg.MetricsListenAddr)
	if err != nil {
		return nil, fmt.Errorf("controller: metrics: listen on %s: %w", c.cfg.MetricsListenAddr, err)
	}
	c.mu.Lock()
	c.metricsAddr = lis.Addr().String()
	c.mu.Unlock()
	c.log.Info("metrics serving", "addr", lis.Addr().String(), "path", "/metrics")
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := c.metrics.Serve(sctx, lis, c.log); err != nil {
			c.log.Warn("metrics server stopped", "err", err)
		}
	}()
	return func() { cancel(); <-done }, nil
}

// etcdDialOptions time the etcd client's requests when metrics are on.
func (c *Controller) etcdDialOptions() []grpc.DialOption {
	if c.metrics == nil {
		return nil
	}
	return []grpc.DialOption{grpc.WithChainUnaryInterceptor(c.metrics.EtcdInterceptor())}
}

// enrollObserver is the enrollment observer, nil when metrics are off.
func (c *Controller) enrollObserver() enrollment.Observer {
	if c.metrics == nil {
		return nil
	}
	return c.metrics
}
