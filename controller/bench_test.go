package controller_test

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kilnhq/kiln/controller/controllertest"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// BenchmarkApplyList10kHosts applies 10,000 Hosts (each with a BMC
// password, so each also writes a sealed secret) through the gRPC API in
// requests of 100, applies them again (all unchanged), and lists them in
// pages of 500, against a real controller with embedded etcd. Run with
// -benchtime=1x; see docs/bench/controller.md.
func BenchmarkApplyList10kHosts(b *testing.B) {
	const (
		hosts = 10000
		batch = 100
		page  = 500
	)
	ctx := context.Background()
	env := controllertest.Start(b)
	conn := env.Dial(b, env.AdminConfigPath)
	rc := controllerv1.NewResourcesClient(conn)

	var apply, reapply, list time.Duration
	for i := 0; b.Loop(); i++ {
		label := strconv.Itoa(i)
		applyAll := func(want string) time.Duration {
			start := time.Now()
			for n := 0; n < hosts; n += batch {
				req := &controllerv1.ApplyRequest{}
				for j := n; j < n+batch; j++ {
					h := host(fmt.Sprintf("b%d-h%05d", i, j), fmt.Sprintf("pw-%05d", j))
					h.GetHost().Metadata.Labels = map[string]string{"bench": label, "rack": fmt.Sprintf("r%02d", j%40)}
					req.Resources = append(req.Resources, h)
				}
				resp, err := rc.Apply(ctx, req)
				if err != nil {
					b.Fatalf("Apply: %v", err)
				}
				for _, r := range resp.GetResults() {
					if r.GetAction() != want {
						b.Fatalf("Apply %s: action %q, want %q", r.GetName(), r.GetAction(), want)
					}
				}
			}
			return time.Since(start)
		}
		apply += applyAll("created")
		reapply += applyAll("unchanged")

		start := time.Now()
		got, cont := 0, ""
		for {
			resp, err := rc.List(ctx, &controllerv1.ListRequest{Kind: "hosts", LabelSelector: map[string]string{"bench": label}, Limit: page, Continue: cont})
			if err != nil {
				b.Fatalf("List: %v", err)
			}
			got += len(resp.GetItems())
			if cont = resp.GetContinue(); cont == "" {
				break
			}
		}
		list += time.Since(start)
		if got != hosts {
			b.Fatalf("List = %d hosts, want %d", got, hosts)
		}
	}
	n := float64(b.N)
	b.ReportMetric(apply.Seconds()/n, "apply-s")
	b.ReportMetric(hosts*n/apply.Seconds(), "applied-hosts/s")
	b.ReportMetric(reapply.Seconds()/n, "reapply-unchanged-s")
	b.ReportMetric(list.Seconds()/n, "list-s")
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	b.ReportMetric(float64(ms.HeapInuse)/(1<<20), "heap-inuse-MiB")
	b.ReportMetric(rssMiB(), "rss-MiB")
}

// rssMiB is the process's resident set (controller, embedded etcd and the
// benchmark's client together) from /proc/self/status; 0 off Linux.
func rssMiB() float64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 64)
			return kb / 1024
		}
	}
	return 0
}

// BenchmarkHeartbeat sends agent heartbeats (with facts) through the gRPC
// API from 8 concurrent agents; each heartbeat rewrites its Host in etcd.
// hb/s bounds the fleet size: hosts = hb/s × heartbeat interval.
func BenchmarkHeartbeat(b *testing.B) {
	const agents = 8
	ctx := context.Background()
	env := controllertest.Start(b)
	clients := make([]controllerv1.AgentsClient, agents)
	for i := range agents {
		name := fmt.Sprintf("hb-%02d", i)
		a, err := enroll(ctx, b, env, env.Token(b, name, time.Hour), name)
		if err != nil {
			b.Fatalf("enroll: %v", err)
		}
		clients[i] = controllerv1.NewAgentsClient(env.DialCert(b, a.certPEM, a.keyPEM))
	}
	facts := &typesv1.Facts{
		Hostname: "hb", OsId: "debian", OsVersion: "12", Kernel: "6.1.0-28-amd64", CpuCount: 32, MemoryBytes: 128 << 30,
		Disks: []*typesv1.Disk{{Name: "sda", Path: "/dev/sda", SizeBytes: 960 << 30}, {Name: "sdb", Path: "/dev/sdb", SizeBytes: 960 << 30}},
		Nics:  []*typesv1.NIC{{Name: "eno1", Mac: "52:54:00:12:34:56", Mtu: 9000, Up: true, Addresses: []string{"10.0.0.5/24"}}},
	}
	var next atomic.Int64
	b.SetParallelism(agents / 2) // GOMAXPROCS 2 → 8 goroutines
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		c := clients[int(next.Add(1)-1)%agents]
		for pb.Next() {
			if _, err := c.Heartbeat(ctx, &controllerv1.HeartbeatRequest{AgentAddress: "127.0.0.1:7444", Facts: facts, Version: "bench"}); err != nil {
				b.Errorf("Heartbeat: %v", err)
				return
			}
		}
	})
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "hb/s")
}
