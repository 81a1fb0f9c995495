package metrics

import (
	"context"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kilnhq/kiln/controller/store"
)

// DBStatuser reports etcd's database size (*store.Store).
type DBStatuser interface {
	DBStatus(ctx context.Context) (store.DBStatus, error)
}

var _ DBStatuser = (*store.Store)(nil)

// EtcdDB is a prometheus.Collector that asks etcd for its database size
// at every scrape: the file, the part in use, and the quota past which
// etcd refuses every write. A scrape whose question fails leaves the
// three gauges out.
type EtcdDB struct {
	st      DBStatuser
	timeout time.Duration
	log     *slog.Logger

	size, inUse, quota *prometheus.Desc
}

var _ prometheus.Collector = (*EtcdDB)(nil)

// NewEtcdDB returns an EtcdDB reading st, each scrape within timeout
// (DefaultFleetTimeout when <= 0).
func NewEtcdDB(st DBStatuser, timeout time.Duration, log *slog.Logger) *EtcdDB {
	if timeout <= 0 {
		timeout = DefaultFleetTimeout
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(Namespace, "etcd", name), help, nil, nil)
	}
	return &EtcdDB{
		st: st, timeout: timeout, log: log.With("component", "metrics"),
		size:  d("db_size_bytes", "Size of etcd's database file (the largest of the members the controller reaches), free pages included: what the quota counts."),
		inUse: d("db_size_in_use_bytes", "Part of kiln_etcd_db_size_bytes holding data; the rest was freed by compaction and is reused (defragmentation returns it to the file system)."),
		quota: d("db_quota_bytes", "Database size past which etcd refuses every write (alarm NOSPACE) until compacted, defragmented and disarmed."),
	}
}

// Describe implements prometheus.Collector.
func (e *EtcdDB) Describe(ch chan<- *prometheus.Desc) {
	ch <- e.size
	ch <- e.inUse
	ch <- e.quota
}

// Collect implements prometheus.Collector.
func (e *EtcdDB) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), e.timeout)
	defer cancel()
	st, err := e.st.DBStatus(ctx)
	if err != nil {
		e.log.Warn("metrics: etcd database status", "err", err)
		return
	}
	ch <- prometheus.MustNewConstMetric(e.size, prometheus.GaugeValue, float64(st.Size))
	ch <- prometheus.MustNewConstMetric(e.inUse, prometheus.GaugeValue, float64(st.InUse))
	ch <- prometheus.MustNewConstMetric(e.quota, prometheus.GaugeValue, float64(st.Quota))
}
