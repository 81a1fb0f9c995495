// Package metrics is the agent's Prometheus instrumentation: a registry of
// its own (never the global default) with the Go runtime and process
// collectors and the durations of the operations the journal runs, served
// on a loopback address only (see docs/observability.md and
// docs/agent.md).
package metrics

import (
	"context"
	"log/slog"
	"net"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/promserve"
)

// Metrics holds the agent's registry and metrics. A nil *Metrics records
// nothing.
type Metrics struct {
	reg        *prometheus.Registry
	operations *prometheus.HistogramVec
}

// New returns Metrics on a fresh registry.
func New() *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		operations: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "kiln", Subsystem: "agent", Name: "operation_duration_seconds",
			Help:    "Duration of the agent's journaled operations (LayImage, Wipe, Prepare, KubeadmInit, KubeadmJoin, KubeadmReset, ...), by operation and outcome (success, failure, interrupted).",
			Buckets: prometheus.ExponentialBuckets(0.5, 2, 15), // 0.5 s to 2.3 h
		}, []string{"operation", "outcome"}),
	}
	m.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), m.operations)
	return m
}

// ObserveOperation records an operation of kind that ran for d
// (journal.Observer).
func (m *Metrics) ObserveOperation(kind, outcome string, d time.Duration) {
	if m == nil {
		return
	}
	m.operations.WithLabelValues(kind, outcome).Observe(d.Seconds())
}

// CheckLoopback refuses an address that is not a loopback IP and port:
// the agent's metrics are served without TLS, so only to the host itself
// (a node exporter's textfile, a local Prometheus agent, an SSH tunnel).
func CheckLoopback(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return errdefs.InvalidArgument("--metrics-listen %q: %v", addr, err)
	}
	if host == "localhost" {
		return nil
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return errdefs.InvalidArgument("--metrics-listen %q: the agent serves metrics without TLS, on a loopback address only (127.0.0.1:PORT or [::1]:PORT)", addr)
	}
	return nil
}

// Serve serves /metrics on lis until ctx ends; it returns nil after ctx
// ends, or the error that stopped serving.
func (m *Metrics) Serve(ctx context.Context, lis net.Listener, log *slog.Logger) error {
	return promserve.Serve(ctx, lis, promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError, MaxRequestsInFlight: 2, Timeout: 10 * time.Second}), log)
}
