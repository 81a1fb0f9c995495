// Package metrics is the agent's Prometheus instrumentation: a registry of
// its own (never the global default) with the Go runtime and process
// collectors, the durations of the operations the journal runs, the bytes
// and throughput of image lays and the results and latency of health
// probes, served on a loopback address without TLS or on any address over
// mTLS to callers with a scraping role (see docs/observability.md and
// docs/agent.md).
package metrics

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
	"github.com/kilnhq/kiln/internal/promserve"
)

// Metrics holds the agent's registry and metrics. A nil *Metrics records
// nothing.
type Metrics struct {
	reg           *prometheus.Registry
	operations    *prometheus.HistogramVec
	layWritten    prometheus.Counter
	layFetched    prometheus.Counter
	layThroughput prometheus.Histogram
	probeChecks   *prometheus.CounterVec
	probeLatency  *prometheus.HistogramVec
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
	m.layWritten = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "kiln", Subsystem: "agent", Name: "lay_written_bytes_total",
		Help: "Bytes written to target disks by image lays that succeeded (all-zero blocks are skipped, not written).",
	})
	m.layFetched = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "kiln", Subsystem: "agent", Name: "lay_fetched_bytes_total",
		Help: "Bytes fetched from the image server by image lays that succeeded.",
	})
	m.layThroughput = prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: "kiln", Subsystem: "agent", Name: "lay_throughput_bytes_per_second",
		Help:    "Throughput of each image lay that succeeded: bytes fetched per second from its start to its verified end.",
		Buckets: prometheus.ExponentialBuckets(1<<20, 2, 13), // 1 MiB/s to 4 GiB/s
	})
	m.probeChecks = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "kiln", Subsystem: "agent", Name: "probe_checks_total",
		Help: "Health probe checks run, by check (KubeletHealthy, ContainerdHealthy, APIServerReady, NodeReady, ClusterDNSResolves, CertificatesValid, EtcdMemberHealthy, CloudProviderInitialized) and result (True, False, Unknown).",
	}, []string{"check", "result"})
	m.probeLatency = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: "kiln", Subsystem: "agent", Name: "probe_check_duration_seconds",
		Help:    "Latency of each health probe check (a DNS query, an API server request, ...), by check.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2.5, 10), // 1 ms to 3.8 s; a check times out at 5 s
	}, []string{"check"})
	m.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), m.operations,
		m.layWritten, m.layFetched, m.layThroughput, m.probeChecks, m.probeLatency)
	return m
}

// ObserveLay records an image lay that succeeded (lay.Observer).
func (m *Metrics) ObserveLay(written, fetched uint64, d time.Duration) {
	if m == nil {
		return
	}
	m.layWritten.Add(float64(written))
	m.layFetched.Add(float64(fetched))
	if s := d.Seconds(); s > 0 {
		m.layThroughput.Observe(float64(fetched) / s)
	}
}

// ObserveProbe records one health probe check (probe.Observer). A result
// other than True or False counts as Unknown, so the label stays bounded.
func (m *Metrics) ObserveProbe(check, result string, d time.Duration) {
	if m == nil {
		return
	}
	if result != "True" && result != "False" {
		result = "Unknown"
	}
	m.probeChecks.WithLabelValues(check, result).Inc()
	m.probeLatency.WithLabelValues(check).Observe(d.Seconds())
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
// the agent's plain-HTTP metrics are served without TLS, so only to the
// host itself (a node exporter's textfile, a local Prometheus agent, an
// SSH tunnel); ServeTLS is for any other address.
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
	return promserve.Serve(ctx, lis, m.handler(), log)
}

// ServeTLS serves /metrics over TLS on lis until ctx ends, with conf (the
// agent's server configuration: its certificate, the controller CA as the
// client CA) made to require a client certificate. A caller must present
// one issued by the controller CA with a scraping role (CanScrape: reader,
// operator, admin or controller); no certificate, or one of another CA,
// fails the handshake, and another role (an agent's) gets 403 Forbidden.
// It returns nil after ctx ends, or the error that stopped serving.
func (m *Metrics) ServeTLS(ctx context.Context, lis net.Listener, conf *tls.Config, log *slog.Logger) error {
	c := requireClientCert(conf)
	return promserve.Serve(ctx, tls.NewListener(lis, c), requireScraper(m.handler()), log)
}

// requireClientCert is conf requiring a verified client certificate,
// also in the configuration its GetConfigForClient returns per connection
// (the agent's, so that each handshake trusts the CAs of the moment).
func requireClientCert(conf *tls.Config) *tls.Config {
	c := conf.Clone()
	c.ClientAuth = tls.RequireAndVerifyClientCert
	if get := c.GetConfigForClient; get != nil {
		c.GetConfigForClient = func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
			cc, err := get(hello)
			if err != nil || cc == nil {
				return cc, err
			}
			cc = cc.Clone()
			cc.ClientAuth = tls.RequireAndVerifyClientCert
			return cc, nil
		}
	}
	return c
}

func (m *Metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError, MaxRequestsInFlight: 2, Timeout: 10 * time.Second})
}

// CanScrape reports whether a certificate of role may read the agent's
// metrics over mTLS: the operator roles (reader and above) and the
// controller. An agent may not read another agent's.
func CanScrape(role pki.Role) bool {
	switch role {
	case pki.RoleReader, pki.RoleOperator, pki.RoleAdmin, pki.RoleController:
		return true
	}
	return false
}

// requireScraper lets through requests whose verified client certificate
// has a scraping role.
func requireScraper(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.TLS == nil || len(r.TLS.VerifiedChains) == 0 || len(r.TLS.VerifiedChains[0]) == 0 {
			http.Error(w, "a client certificate issued by the controller CA is required", http.StatusUnauthorized)
			return
		}
		role, name, err := pki.Identity(r.TLS.VerifiedChains[0][0])
		if err != nil {
			http.Error(w, "client certificate: "+err.Error(), http.StatusForbidden)
			return
		}
		if !CanScrape(role) {
			http.Error(w, fmt.Sprintf("role %s (%s) may not read the agent's metrics; reader, operator, admin and controller may", role, name), http.StatusForbidden)
			return
		}
		h.ServeHTTP(w, r)
	})
}
