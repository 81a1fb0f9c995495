package provision

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/agent/agenttest"
	"github.com/kilnhq/kiln/agent/lay"
	"github.com/kilnhq/kiln/agent/server"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/resources"
	"github.com/kilnhq/kiln/controller/store"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestProgressThrottle feeds a lay's reports at given times and checks
// which the controller stores: the first, a new step, the one that
// completes, then one per interval or per 10 points (not within a
// second).
func TestProgressThrottle(t *testing.T) {
	t0 := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	rep := func(step string, done, total uint64) *agentv1.Progress {
		p := &agentv1.Progress{Step: step, DoneBytes: done, TotalBytes: total}
		if total > 0 {
			p.Percent = 100 * float64(done) / float64(total)
		}
		return p
	}
	type report struct {
		at   time.Duration
		p    *agentv1.Progress
		want bool
		why  string
	}
	tests := []struct {
		name    string
		reports []report
	}{
		{"steps and interval", []report{
			{0, rep("open", 0, 0), true, "first report"},
			{100 * time.Millisecond, rep("discard", 0, 0), true, "new step"},
			{200 * time.Millisecond, rep("fetch", 0, 1000), true, "new step"},
			{450 * time.Millisecond, rep("fetch", 10, 1000), false, "1% after 250ms"},
			{2 * time.Second, rep("fetch", 50, 1000), false, "5% after 1.8s"},
			{5 * time.Second, rep("fetch", 80, 1000), false, "8% and 4.8s since the last stored"},
			{5200 * time.Millisecond, rep("fetch", 90, 1000), true, "5s passed"},
			{5500 * time.Millisecond, rep("fetch", 300, 1000), false, "21 points but within a second"},
			{6300 * time.Millisecond, rep("fetch", 310, 1000), true, "22 points after 1.1s"},
			{6350 * time.Millisecond, rep("fetch: retrying after a reset connection", 310, 1000), false, "a note is no new step"},
			{6360 * time.Millisecond, rep("fetch", 320, 1000), false, "back from the note: the same step"},
			{6400 * time.Millisecond, rep("fetch", 1000, 1000), true, "every byte done"},
			{6500 * time.Millisecond, rep("fetch", 1000, 1000), false, "complete again, already stored"},
			{6600 * time.Millisecond, rep("verify", 1000, 1000), true, "new step"},
			{6700 * time.Millisecond, rep("done", 1000, 1000), true, "new step: done"},
		}},
		{"unknown total", []report{
			{0, rep("fetch", 0, 0), true, "first report"},
			{time.Second, rep("fetch", 1<<20, 0), false, "no percent, within the interval"},
			{4 * time.Second, rep("fetch", 4<<20, 0), false, "no percent, within the interval"},
			{5 * time.Second, rep("fetch", 5<<20, 0), true, "5s passed"},
			{5500 * time.Millisecond, rep("done", 6<<20, 0), true, "done completes"},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			th := newProgressThrottle(5*time.Second, 10)
			for i, r := range tt.reports {
				if got := th.admit(r.p, t0.Add(r.at)); got != r.want {
					t.Errorf("report %d (%s at %s, %.0f%%): admit = %t, want %t (%s)", i, r.p.GetStep(), r.at, r.p.GetPercent(), got, r.want, r.why)
				}
			}
		})
	}
}

// TestLayProgressStored lays an image with a real agent (the agent API
// over mTLS on loopback, agent/lay writing a file target) through the
// executor's LayImage action against a real etcd, and checks what a
// client of the API reads: the host's last operation ends at 100% with
// every byte done, the rate known, and the executor wrote far fewer
// progress updates than the agent reported.
func TestLayProgressStored(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	emb, err := store.StartEmbedded(ctx, store.EmbeddedConfig{DataDir: filepath.Join(t.TempDir(), "etcd")})
	require.NoError(t, err)
	t.Cleanup(emb.Close)
	c, err := store.Dial(emb.Endpoints(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	st := store.New(c)

	img := make([]byte, 8<<20)
	_, err = rand.Read(img)
	require.NoError(t, err)
	sum := sha256.Sum256(img)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.ServeContent(w, r, "image.raw", time.Time{}, bytes.NewReader(img))
	}))
	t.Cleanup(srv.Close)

	layer := lay.New(slog.New(slog.DiscardHandler), lay.WithFileTargets(true), lay.WithProgressInterval(time.Nanosecond), lay.WithBufferSize(64<<10))
	agent := agenttest.Start(t, server.Options{ImageLayer: lay.Service{Layer: layer}})
	client := agent.Controller(t)

	const name, opID = "rack1-01", "rack1-01-LayImage-0"
	started := time.Now()
	h := &typesv1.Host{
		Metadata: &typesv1.ObjectMeta{Name: name},
		Status: &typesv1.HostStatus{
			State:            typesv1.HostState_HOST_STATE_PROVISIONING,
			ProvisioningStep: string(hostlife.StepLayImage),
			LastOperation:    &typesv1.OperationStatus{Id: opID, Kind: string(hostlife.StepLayImage), State: hostlife.OpRunning, Started: timestamppb.New(started)},
		},
	}
	rev, err := st.Create(ctx, HostsKind, name, h)
	require.NoError(t, err)
	watch := st.Watch(ctx, HostsKind, rev+1)

	e := New(Deps{Store: st, Agents: func(context.Context, *typesv1.Host) (agentv1.AgentClient, error) { return client, nil }}, Config{}, nil)
	target := filepath.Join(t.TempDir(), "disk.img")
	err = e.do(ctx, h, hostlife.Action{Kind: hostlife.ActLayImage, OperationID: opID, Target: target,
		Image: &typesv1.ImageSpec{Url: srv.URL + "/image.raw", Sha256: hex.EncodeToString(sum[:]), Format: "raw", Size: uint64(len(img)), RawSize: uint64(len(img))}})
	require.NoError(t, err, "LayImage through the executor")

	// Read as the API's Get does (controller/resources, behind the
	// Resources gRPC service that kilnctl and the dashboard call).
	r, err := resources.New(st, nil, nil, slog.New(slog.DiscardHandler)).Get(ctx, "Host", name)
	require.NoError(t, err)
	op := r.GetHost().GetStatus().GetLastOperation()
	p := op.GetProgress()
	t.Logf("stored progress: %v (operation percent %.1f)", p, op.GetPercent())
	require.NotNil(t, p, "host status.lastOperation.progress after the lay")
	if p.GetStep() != lay.StepDone || p.GetPercent() != 100 || op.GetPercent() != 100 {
		t.Errorf("stored progress = step %q, %.1f%% (operation %.1f%%), want step %q at 100%%", p.GetStep(), p.GetPercent(), op.GetPercent(), lay.StepDone)
	}
	if p.GetTotalBytes() != uint64(len(img)) || p.GetDoneBytes() != uint64(len(img)) {
		t.Errorf("stored progress bytes = %d of %d, want %d of %d", p.GetDoneBytes(), p.GetTotalBytes(), len(img), len(img))
	}
	if p.GetUpdated() == nil {
		t.Errorf("stored progress has no updated time")
	}

	// How many reports did the agent send, and how many writes reached
	// etcd? Operation replays the journal's events.
	stream, err := client.Operation(ctx, &agentv1.OperationRequest{OperationId: opID})
	require.NoError(t, err)
	reports, sawRate := 0, false
	for {
		ev, err := stream.Recv()
		if err != nil {
			break
		}
		if ev.GetProgress() != nil {
			reports++
		}
		if ev.GetProgress().GetStep() == lay.StepFetch && ev.GetProgress().GetBytesPerSecond() > 0 {
			sawRate = true
		}
	}
	require.True(t, sawRate, "the agent reported no fetch rate")
	writes := 0
	for done := false; !done; {
		select {
		case ev := <-watch:
			require.NoError(t, ev.Err)
			writes++
			done = ev.Rev >= mustRev(t, st, name)
		case <-ctx.Done():
			t.Fatal("watch ended before the last write")
		}
	}
	t.Logf("agent progress reports: %d, progress writes to etcd: %d", reports, writes)
	// One per step (open, discard, fetch, verify, sync, done), the one at
	// 100% of fetch, and one per second or per 10 points at most.
	if limit := 7 + 10 + int(time.Since(started)/time.Second); writes > limit || writes >= reports {
		t.Errorf("progress writes = %d for %d agent reports, want at most %d", writes, reports, limit)
	}
}

func mustRev(t *testing.T, st *store.Store, name string) int64 {
	t.Helper()
	rev, err := st.Get(context.Background(), HostsKind, name, &typesv1.Host{})
	require.NoError(t, err)
	return rev
}
