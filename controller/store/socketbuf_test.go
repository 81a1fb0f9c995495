package store

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestManyRequestsOnTheUnixSocket: the controller talks to its embedded
// etcd over one gRPC connection on a unix socket. grpc-go since v1.82.1
// (its HTTP/2 Rapid Reset fix counts every stream's bookkeeping against
// the transport's throttle) can stop both ends of such a connection for
// ever under many concurrent requests: each side stops reading because
// its writer is blocked on a full socket, which the other side no longer
// reads (grpc/grpc-go#9330; a unix socket's default send buffer is 208
// KiB and never grows). A 100,000-host benchmark wedged so (session 15).
// Here 1,024 goroutines read and write at once, with a watch streaming
// every change back, for 8 s: requests must keep completing.
func TestManyRequestsOnTheUnixSocket(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: 8 s of load on an embedded etcd")
	}
	if b, err := os.ReadFile("/proc/sys/net/core/wmem_max"); os.Geteuid() != 0 && err == nil {
		if max, _ := strconv.Atoi(strings.TrimSpace(string(b))); max < socketBuffer/2 {
			t.Skipf("not root: the client cannot raise its socket buffer past net.core.wmem_max (%d bytes); run as root (CI does)", max)
		}
	}
	e, c := startEtcd(t)
	require.True(t, strings.HasPrefix(e.Endpoints()[0], "unix"), "endpoint %s: the test is about the unix socket", e.Endpoints()[0])
	ctx, cancel := context.WithCancel(testCtx(t))
	defer cancel()
	value := strings.Repeat("v", 2048)
	for i := range 500 {
		_, err := c.Put(ctx, fmt.Sprintf("/kiln/v1/test/%04d", i), value)
		require.NoError(t, err)
	}
	wch := c.Watch(ctx, "/kiln/v1/test/", clientv3.WithPrefix())
	var done atomic.Int64
	var wg sync.WaitGroup
	for g := range 1024 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ctx.Err() == nil; i++ {
				key := fmt.Sprintf("/kiln/v1/test/%04d", (g*7+i)%500)
				var err error
				if i%4 == 0 {
					_, err = c.Put(ctx, key, value)
				} else {
					_, err = c.Get(ctx, key)
				}
				if err == nil {
					done.Add(1)
				}
			}
		}()
	}
	go func() {
		for range wch {
		}
	}()
	last, stalled := int64(0), time.Duration(0)
	for start := time.Now(); time.Since(start) < 8*time.Second; {
		time.Sleep(500 * time.Millisecond)
		if n := done.Load(); n > last {
			last, stalled = n, 0
			continue
		}
		if stalled += 500 * time.Millisecond; stalled >= 5*time.Second {
			cancel()
			t.Fatalf("no etcd request completed for %s after %d: the connection to the embedded etcd is wedged", stalled, last)
		}
	}
	cancel()
	wg.Wait()
	t.Logf("%d requests completed", done.Load())
}
