package probe

import (
	"context"
	"slices"
	"testing"
	"time"

	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// BenchmarkProbe measures one Probe of a healthy control-plane node whose
// kubelet, containerd, API server and etcd answer on loopback (real HTTP,
// TLS with client certificates, gRPC), without the DNS check. It reports
// the p50 and p99 latency of a Probe.
//
//	go test ./agent/probe -run '^$' -bench Probe -benchtime 2000x
func BenchmarkProbe(b *testing.B) {
	n := newFakeNode(b, time.Now().Add(365*24*time.Hour))
	p := New(n.opts)
	defer p.Close()
	req := &agentv1.ProbeRequest{Cluster: cluster(), Skip: []string{ClusterDNSResolves}}
	var lat []time.Duration
	for b.Loop() {
		start := time.Now()
		resp, err := p.Probe(context.Background(), req)
		lat = append(lat, time.Since(start))
		if err != nil || !resp.GetHealthy() {
			b.Fatalf("Probe() = %v, %v", resp, err)
		}
	}
	slices.Sort(lat)
	q := func(f float64) float64 { return float64(lat[int(f*float64(len(lat)-1))].Microseconds()) / 1000 }
	b.ReportMetric(q(0.50), "p50-ms")
	b.ReportMetric(q(0.99), "p99-ms")
}
