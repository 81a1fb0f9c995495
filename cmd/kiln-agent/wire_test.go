package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnhq/kiln/agent/agenttest"
	"github.com/kilnhq/kiln/agent/journal"
	"github.com/kilnhq/kiln/agent/metrics"
	"github.com/kilnhq/kiln/internal/promtest"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// TestServicesFileTargets: the agent as wired lays into the lab's disk
// file only with --file-targets; without it the call is refused as
// InvalidArgument before anything is fetched, and the file is untouched.
func TestServicesFileTargets(t *testing.T) {
	img := bytes.Repeat([]byte("kiln"), 256<<10)
	sum := sha256.Sum256(img)
	var fetched atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fetched.Add(1)
		http.ServeContent(w, r, "image.raw", time.Time{}, bytes.NewReader(img))
	}))
	t.Cleanup(srv.Close)

	for _, files := range []bool{false, true} {
		disk := filepath.Join(t.TempDir(), "disk.raw")
		require.NoError(t, os.WriteFile(disk, make([]byte, 2<<20), 0o600))
		j, err := journal.Open(t.TempDir(), nil)
		require.NoError(t, err)
		t.Cleanup(func() { j.Close() })
		met := metrics.New()
		a := agenttest.Start(t, services("/", files, j, met, slog.New(slog.DiscardHandler)))
		s, err := a.Controller(t).LayImage(context.Background(), &agentv1.LayImageRequest{
			OperationId: "lay-1", Url: srv.URL + "/image.raw", Sha256: hex.EncodeToString(sum[:]), Target: disk,
		})
		require.NoError(t, err)
		var last *agentv1.OperationEvent
		for {
			ev, err := s.Recv()
			if err != nil {
				if files {
					t.Fatalf("LayImage(%s) with --file-targets: %v", disk, err)
				}
				if status.Code(err) != codes.InvalidArgument {
					t.Errorf("LayImage(%s) without --file-targets = %v, want InvalidArgument", disk, err)
				}
				t.Logf("without --file-targets: %v", err)
				break
			}
			if last = ev; ev.GetState() != agentv1.OperationState_OPERATION_STATE_RUNNING {
				break
			}
		}
		got, err := os.ReadFile(disk)
		require.NoError(t, err)
		if files {
			if last.GetState() != agentv1.OperationState_OPERATION_STATE_SUCCEEDED || !bytes.Equal(got[:len(img)], img) {
				t.Errorf("LayImage(%s) with --file-targets ended %v; the file holds the image: %v", disk, last, bytes.Equal(got[:len(img)], img))
			}
			// The wired Layer reports to the agent's metrics.
			lis, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- met.Serve(ctx, lis, nil) }()
			sc := promtest.Get(t, "http://"+lis.Addr().String()+"/metrics")
			if got, _ := sc.Value("kiln_agent_lay_written_bytes_total"); got != float64(len(img)) {
				t.Errorf("kiln_agent_lay_written_bytes_total after the wired lay = %v, want %d", got, len(img))
			}
			cancel()
			require.NoError(t, <-done)
			continue
		}
		if !bytes.Equal(got, make([]byte, 2<<20)) || fetched.Load() != 0 {
			t.Errorf("LayImage(%s) refused, yet the file changed or %d requests were made", disk, fetched.Load())
		}
	}
}
