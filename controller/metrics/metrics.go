// Package metrics is the controller's Prometheus instrumentation: one
// registry per controller (never the global default), the histograms and
// counters the executors, the BMC layer, enrollment and the boot server
// report to through small observer interfaces declared where they are
// consumed, and a collector that reads the fleet from the store at scrape
// time (fleet.go). docs/observability.md lists every metric.
package metrics

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/promserve"
)

// Namespace prefixes every Kiln metric.
const Namespace = "kiln"

// Outcome labels: "success", or the errdefs class of the error
// ("unavailable", "deadline_exceeded", "permission_denied", ...; see
// errdefs.Class).
const OutcomeSuccess = "success"

// Outcome is the outcome label of err.
func Outcome(err error) string {
	if err == nil {
		return OutcomeSuccess
	}
	return errdefs.Class(err)
}

// Metrics holds a controller's registry and the metrics its parts update.
// Its methods are safe for concurrent use; a nil *Metrics records nothing.
type Metrics struct {
	reg *prometheus.Registry

	operations  *prometheus.HistogramVec
	bmcCalls    *prometheus.HistogramVec
	reconciles  *prometheus.HistogramVec
	queueDepth  *prometheus.GaugeVec
	etcd        *prometheus.HistogramVec
	enrollments *prometheus.CounterVec
	bootBytes   *prometheus.CounterVec
	bootActive  *prometheus.GaugeVec
}

// New returns Metrics on a fresh registry holding the Go runtime and
// process collectors.
func New() *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		operations: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: Namespace, Name: "operation_duration_seconds",
			Help:    "Duration of host lifecycle steps and cluster operations (CheckBMC, WaitBootAgent, LayImage, Prepare, KubeadmJoin, Drain, ...), by operation and outcome.",
			Buckets: prometheus.ExponentialBuckets(0.5, 2, 15), // 0.5 s to 2.3 h
		}, []string{"operation", "outcome"}),
		bmcCalls: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: Namespace, Subsystem: "bmc", Name: "request_duration_seconds",
			Help:    "Duration of BMC calls (retries included), by protocol, operation and outcome.",
			Buckets: prometheus.ExponentialBuckets(0.025, 2, 13), // 25 ms to 102 s
		}, []string{"protocol", "operation", "outcome"}),
		reconciles: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: Namespace, Subsystem: "reconcile", Name: "duration_seconds",
			Help:    "Duration of one reconcile of a host (controller=hosts) or a cluster (controller=clusters), by outcome.",
			Buckets: prometheus.ExponentialBuckets(0.005, 4, 11), // 5 ms to 1.5 h
		}, []string{"controller", "outcome"}),
		queueDepth: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: Namespace, Subsystem: "reconcile", Name: "queue_depth",
			Help: "Objects waiting for a reconcile worker, by controller (hosts, clusters); 0 on a replica that does not lead.",
		}, []string{"controller"}),
		etcd: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: Namespace, Subsystem: "etcd", Name: "request_duration_seconds",
			Help:    "Duration of the controller's unary etcd requests, by gRPC method (Range, Put, Txn, ...) and outcome.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14), // 0.5 ms to 4 s
		}, []string{"method", "outcome"}),
		enrollments: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "enrollments_total",
			Help: "Agent enrollment attempts, by outcome (success, permission_denied for a bad or spent token, invalid_argument, ...).",
		}, []string{"outcome"}),
		bootBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Subsystem: "boot", Name: "served_bytes_total",
			Help: "Bytes the boot server sent, by kind (ipxe, iso, media, image, other).",
		}, []string{"kind"}),
		bootActive: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: Namespace, Subsystem: "boot", Name: "active_transfers",
			Help: "Boot server responses being sent now, by kind.",
		}, []string{"kind"}),
	}
	m.reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.operations, m.bmcCalls, m.reconciles, m.queueDepth, m.etcd, m.enrollments, m.bootBytes, m.bootActive,
	)
	for _, c := range []string{"hosts", "clusters"} {
		m.queueDepth.WithLabelValues(c)
	}
	for _, k := range bootKinds {
		m.bootBytes.WithLabelValues(k)
		m.bootActive.WithLabelValues(k)
	}
	m.enrollments.WithLabelValues(OutcomeSuccess)
	m.enrollments.WithLabelValues("permission_denied")
	return m
}

// Registry is the registry every metric of this controller is on.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Register adds c to the registry (see prometheus.Registerer).
func (m *Metrics) Register(c prometheus.Collector) error { return m.reg.Register(c) }

// Leader registers kiln_leader, read from isLeader at scrape time.
func (m *Metrics) Leader(isLeader func() bool) error {
	return m.reg.Register(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: Namespace, Name: "leader",
		Help: "1 while this replica leads (runs the reconcilers and the lifecycle), else 0.",
	}, func() float64 {
		if isLeader() {
			return 1
		}
		return 0
	}))
}

// Handler serves the registry in the Prometheus exposition formats.
func (m *Metrics) Handler(log *slog.Logger) http.Handler {
	var el promhttp.Logger
	if log != nil {
		el = slog.NewLogLogger(log.Handler(), slog.LevelWarn)
	}
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{
		ErrorLog:            el,
		ErrorHandling:       promhttp.ContinueOnError,
		MaxRequestsInFlight: 4,
		Timeout:             30 * time.Second,
	})
}

// ObserveOperation records one finished operation (a host lifecycle step
// or a cluster operation) that took d.
func (m *Metrics) ObserveOperation(op string, err error, d time.Duration) {
	if m == nil {
		return
	}
	m.operations.WithLabelValues(op, Outcome(err)).Observe(d.Seconds())
}

// ObserveOperationOutcome records one finished operation whose outcome is
// already a label value ("success", "failure", "timeout").
func (m *Metrics) ObserveOperationOutcome(op, outcome string, d time.Duration) {
	if m == nil {
		return
	}
	m.operations.WithLabelValues(op, outcome).Observe(d.Seconds())
}

// ObserveBMCCall records one BMC call (bmc.CallObserver).
func (m *Metrics) ObserveBMCCall(protocol, op string, err error, d time.Duration) {
	if m == nil {
		return
	}
	m.bmcCalls.WithLabelValues(protocol, op, Outcome(err)).Observe(d.Seconds())
}

// ObserveReconcile records one reconcile by controller ("hosts",
// "clusters") and the queue depth after it.
func (m *Metrics) ObserveReconcile(controller string, err error, d time.Duration, queueDepth int) {
	if m == nil {
		return
	}
	m.reconciles.WithLabelValues(controller, Outcome(err)).Observe(d.Seconds())
	m.queueDepth.WithLabelValues(controller).Set(float64(queueDepth))
}

// SetQueueDepth sets the reconcile queue depth of controller.
func (m *Metrics) SetQueueDepth(controller string, n int) {
	if m == nil {
		return
	}
	m.queueDepth.WithLabelValues(controller).Set(float64(n))
}

// ObserveEnrollment records one enrollment attempt
// (enrollment.Observer).
func (m *Metrics) ObserveEnrollment(err error) {
	if m == nil {
		return
	}
	m.enrollments.WithLabelValues(Outcome(err)).Inc()
}

// EtcdInterceptor is a gRPC client interceptor for the etcd client
// (store.Dial) that times each unary request.
func (m *Metrics) EtcdInterceptor() grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		start := time.Now()
		err := invoker(ctx, method, req, reply, cc, opts...)
		outcome := OutcomeSuccess
		if err != nil {
			outcome = "error"
		}
		m.etcd.WithLabelValues(method[strings.LastIndexByte(method, '/')+1:], outcome).Observe(time.Since(start).Seconds())
		return err
	}
}

// Serve serves the metrics at /metrics on lis until ctx ends; it returns
// nil after ctx ends, or the error that stopped serving.
func (m *Metrics) Serve(ctx context.Context, lis net.Listener, log *slog.Logger) error {
	return promserve.Serve(ctx, lis, m.Handler(log), log)
}

// bootKinds are the kind label values of the boot server metrics.
var bootKinds = []string{"ipxe", "iso", "media", "image", "other"}

// bootKind classifies a boot server path.
func bootKind(path string) string {
	switch {
	case strings.HasPrefix(path, "/boot/ipxe/"):
		return "ipxe"
	case strings.HasPrefix(path, "/boot/iso/"):
		return "iso"
	case strings.HasPrefix(path, "/boot/files/"):
		return "media"
	case strings.HasPrefix(path, "/images/"):
		return "image"
	}
	return "other"
}

// BootHandler wraps the boot server's handler: it counts the bytes each
// response sends and the responses in flight, by kind of path.
func (m *Metrics) BootHandler(h http.Handler) http.Handler {
	if m == nil {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		kind := bootKind(r.URL.Path)
		active := m.bootActive.WithLabelValues(kind)
		active.Inc()
		defer active.Dec()
		h.ServeHTTP(&countingWriter{ResponseWriter: w, bytes: m.bootBytes.WithLabelValues(kind)}, r)
	})
}

// countingWriter counts the body bytes written through it.
type countingWriter struct {
	http.ResponseWriter
	bytes prometheus.Counter
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.ResponseWriter.Write(p)
	c.bytes.Add(float64(n))
	return n, err
}

// Unwrap lets http.ResponseController reach the underlying writer
// (Flush, deadlines).
func (c *countingWriter) Unwrap() http.ResponseWriter { return c.ResponseWriter }

// ReadFrom keeps the underlying writer's sendfile path (http.ServeContent
// copies files through it) while counting.
func (c *countingWriter) ReadFrom(r io.Reader) (int64, error) {
	var n int64
	var err error
	if rf, ok := c.ResponseWriter.(io.ReaderFrom); ok {
		n, err = rf.ReadFrom(r)
	} else {
		n, err = io.Copy(struct{ io.Writer }{c.ResponseWriter}, r)
	}
	c.bytes.Add(float64(n))
	return n, err
}
