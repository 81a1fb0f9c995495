package api_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/api"
	"github.com/kilnhq/kiln/controller/resources"
	"github.com/kilnhq/kiln/controller/store"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// BenchmarkListHosts pages every Host (KILN_LIST_HOSTS, default 100,000)
// through the Resources API, a real gRPC server and client on loopback,
// in pages of 500 as `kilnctl get hosts` asks, from etcd (a replica
// without caches: every page an etcd range read) and from the watch
// cache (resources.Caches), in the same run and on the same embedded
// etcd. ns/op is one whole listing. Run with:
//
//	go test ./controller/api/ -run '^$' -bench ListHosts -benchtime 3x -timeout 30m
func BenchmarkListHosts(b *testing.B) {
	n := 100_000
	if v := os.Getenv("KILN_LIST_HOSTS"); v != "" {
		var err error
		n, err = strconv.Atoi(v)
		require.NoError(b, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e, err := store.StartEmbedded(ctx, store.EmbeddedConfig{DataDir: filepath.Join(b.TempDir(), "etcd"), Logger: slog.New(slog.DiscardHandler)})
	require.NoError(b, err)
	defer e.Close()
	client, err := store.Dial(e.Endpoints(), nil)
	require.NoError(b, err)
	defer client.Close()
	st := store.New(client)

	start := time.Now()
	createHosts(b, ctx, st, n)
	b.Logf("stored %d hosts in %s", n, time.Since(start).Round(time.Millisecond))

	caches := resources.NewCaches(st)
	cachesDone := make(chan struct{})
	go func() { defer close(cachesDone); caches.Run(ctx) }()
	defer func() { cancel(); <-cachesDone }()
	start = time.Now()
	_, err = caches.Kind("hosts").List(ctx)
	require.NoError(b, err)
	b.Logf("host cache filled in %s", time.Since(start).Round(time.Millisecond))

	per := map[string]time.Duration{}
	for _, source := range []string{"etcd", "cache"} {
		res := resources.New(st, nil, nil, slog.New(slog.DiscardHandler))
		if source == "cache" {
			res.UseCaches(caches)
		}
		rc := serve(b, ctx, res, st)
		b.Run("source="+source, func(b *testing.B) {
			b.ReportAllocs()
			start := time.Now()
			for range b.N {
				got := listAll(b, ctx, rc)
				require.Equal(b, n, got)
			}
			per[source] = time.Since(start) / time.Duration(b.N)
			b.ReportMetric(float64(n)*float64(b.N)/time.Since(start).Seconds(), "hosts/s")
		})
	}
	if per["cache"] > 0 {
		b.Logf("%d hosts paged in %s from etcd, %s from the cache: %.1fx", n, per["etcd"].Round(time.Millisecond), per["cache"].Round(time.Millisecond), float64(per["etcd"])/float64(per["cache"]))
	}
}

// serve runs the Resources API of res on a loopback port and returns a
// client of it.
func serve(b *testing.B, ctx context.Context, res *resources.Service, st *store.Store) controllerv1.ResourcesClient {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	srv := grpc.NewServer()
	api.Register(ctx, srv, res, nil, nil, st, nil, nil)
	go func() { _ = srv.Serve(lis) }()
	b.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(b, err)
	b.Cleanup(func() { conn.Close() })
	return controllerv1.NewResourcesClient(conn)
}

// listAll pages every host as kilnctl get hosts does and returns how many.
func listAll(b *testing.B, ctx context.Context, rc controllerv1.ResourcesClient) int {
	n, cont := 0, ""
	for {
		resp, err := rc.List(ctx, &controllerv1.ListRequest{Kind: "hosts", Limit: 500, Continue: cont})
		require.NoError(b, err)
		n += len(resp.GetItems())
		if cont = resp.GetContinue(); cont == "" {
			return n
		}
	}
}

// createHosts stores n provisioned hosts with an agent, labels and
// conditions (about 700 bytes each), 500 to a transaction.
func createHosts(b *testing.B, ctx context.Context, st *store.Store, n int) {
	now := timestamppb.Now()
	var ops []store.BatchOp
	flush := func() {
		if len(ops) == 0 {
			return
		}
		_, err := st.Batch(ctx, ops)
		require.NoError(b, err)
		ops = ops[:0]
	}
	for i := range n {
		name := fmt.Sprintf("host-%06d", i)
		ops = append(ops, store.BatchOp{Kind: "hosts", Name: name, Msg: &typesv1.Host{
			ApiVersion: resources.APIVersion, Kind: "Host",
			Metadata: &typesv1.ObjectMeta{Name: name, Generation: 1, Uid: fmt.Sprintf("00000000-0000-4000-8000-%012d", i), CreationTimestamp: now,
				Labels: map[string]string{"rack": fmt.Sprintf("r%04d", i/40), "region": "eu-1", "class": "worker"}},
			Spec: &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "redfish", Address: fmt.Sprintf("https://bmc-%06d.example:443", i)}, BootMac: fmt.Sprintf("52:54:00:%02x:%02x:%02x", i>>16&0xff, i>>8&0xff, i&0xff), Online: true},
			Status: &typesv1.HostStatus{
				State:   typesv1.HostState_HOST_STATE_PROVISIONED,
				Image:   "debian13-k8s1.34-20261201",
				Machine: fmt.Sprintf("cluster-%03d-md-%04d", i/500, i%500),
				Agent: &typesv1.AgentStatus{Address: fmt.Sprintf("10.%d.%d.%d:7444", i>>16&0xff, i>>8&0xff, i&0xff), Version: "v0.17.0", LastHeartbeat: now,
					CertificateSerial: fmt.Sprintf("%032x", i), Controller: "ctl-0"},
				Conditions: []*typesv1.Condition{
					{Type: "AgentReachable", Status: "True", Reason: "HeartbeatReceived", LastTransitionTime: now},
					{Type: "Provisioned", Status: "True", Reason: "ImageBooted", LastTransitionTime: now},
				},
			},
		}})
		if len(ops) == 500 {
			flush()
		}
	}
	flush()
}
