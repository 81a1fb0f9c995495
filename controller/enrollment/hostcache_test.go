package enrollment_test

import (
	"context"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/store/storetest"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

type nopRecorder struct{}

func (nopRecorder) Record(context.Context, string, string, string, string, string) {}

func (nopRecorder) Prepare(context.Context, string, string, []events.Event) (*events.Batch, error) {
	return &events.Batch{}, nil
}

// setSerial does what a re-enrollment does to the Host's serials.
func setSerial(t *testing.T, ctx context.Context, st *store.Store, host, serial string) {
	t.Helper()
	h := &typesv1.Host{}
	rev, err := st.Get(ctx, "hosts", host, h)
	require.NoError(t, err)
	h.Status.Agent.CertificateSerial = serial
	h.Status.Agent.PreviousCertificateSerial = ""
	_, err = st.Update(ctx, "hosts", host, h, rev)
	require.NoError(t, err)
}

// Idle heartbeats are answered from the host cache, without reading etcd;
// an attacker holding a certificate whose serial was replaced (the host
// enrolled again) is refused within MaxHostCacheLag of the change and
// from then on; a new serial is accepted at once, a moved fleet's agent
// is told where it went, and a deleted host's agent is told to enroll.
func TestHeartbeatFromHostCache(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	st := storetest.New(t)
	cs := &storetest.ReadCounter{Store: st}
	_, err := st.Create(ctx, "hosts", "h-1", &typesv1.Host{
		Metadata: &typesv1.ObjectMeta{Name: "h-1"},
		Spec:     &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "none"}},
		Status:   &typesv1.HostStatus{Agent: &typesv1.AgentStatus{CertificateSerial: "a1"}},
	})
	require.NoError(t, err)
	ca, err := pki.NewCA("test", time.Now())
	require.NoError(t, err)
	var skew atomic.Int64 // added to the service's clock
	clock := func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }
	svc := enrollment.New(cs, ca, nopRecorder{}, enrollment.Config{Replica: "r1", Clock: clock}, slog.New(slog.DiscardHandler))
	hosts := store.NewCache(st, "hosts", func() proto.Message { return &typesv1.Host{} })
	svc.UseHostCache(hosts, st)
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); hosts.Run(rctx) }()
	t.Cleanup(func() { stop(); <-done })
	runCheck := func() (stop func()) {
		cctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); svc.RunHostCache(cctx) }()
		return func() { cancel(); <-done }
	}
	stopCheck := runCheck()

	req := enrollment.HeartbeatRequest{AgentAddress: "127.0.0.1:7444", Version: "v1"}
	beat := func(serial string) (enrollment.HeartbeatResult, error) {
		return svc.Heartbeat(ctx, "h-1", serial, req)
	}
	_, err = beat("a1") // the first one writes
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		n := cs.Reads.Load()
		_, err := beat("a1")
		return err == nil && cs.Reads.Load() == n
	}, 10*time.Second, 20*time.Millisecond, "an idle heartbeat answered without an etcd read")
	n := cs.Reads.Load()
	before, _ := svc.Tracker().LastSeen("h-1")
	for range 20 {
		res, err := beat("a1")
		require.NoError(t, err)
		require.Equal(t, enrollment.DefaultHeartbeatInterval, res.Interval)
	}
	require.Equal(t, n, cs.Reads.Load(), "etcd reads of 20 idle heartbeats")
	after, ok := svc.Tracker().LastSeen("h-1")
	require.True(t, ok)
	require.False(t, after.Before(before), "the heartbeats marked the agent seen")

	// Without a confirmation that the cache is current for longer than
	// MaxHostCacheLag, heartbeats read etcd again.
	stopCheck()
	skew.Store(int64(enrollment.MaxHostCacheLag + time.Second))
	_, err = beat("a1")
	require.NoError(t, err)
	require.Equal(t, n+1, cs.Reads.Load(), "etcd reads of a heartbeat when the cache was last confirmed current %v ago", enrollment.MaxHostCacheLag+time.Second)
	stopCheck = runCheck()
	defer func() { stopCheck() }()

	// The attack: the host enrolled again (serial b2); the old certificate
	// (a1) keeps heartbeating.
	setSerial(t, ctx, st, "h-1", "b2")
	changed := time.Now()
	for {
		_, err := beat("a1")
		if err != nil {
			require.True(t, errdefs.IsPermissionDenied(err), "heartbeat with the replaced serial: %v", err)
			break
		}
		require.Less(t, time.Since(changed), enrollment.MaxHostCacheLag+2*time.Second, "the replaced serial is still accepted")
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("replaced serial refused %v after the change", time.Since(changed).Round(time.Millisecond))
	for range 10 {
		_, err := beat("a1")
		require.True(t, errdefs.IsPermissionDenied(err), "heartbeat with the replaced serial after a refusal: %v", err)
	}
	// The agent's new certificate is accepted at once: a refusal by the
	// cache is checked against etcd.
	setSerial(t, ctx, st, "h-1", "c3")
	_, err = beat("c3")
	require.NoError(t, err, "the new serial, right after it was recorded")

	// A pause through this replica's store takes effect at once: the
	// heartbeat is refused while moving, and told where the fleet went
	// once moved.
	_, err = st.Pause(ctx, store.Pause{MovedTo: "127.0.0.1:1", By: "test", Since: time.Now()})
	require.NoError(t, err)
	_, err = beat("c3")
	require.ErrorIs(t, err, store.ErrPaused, "heartbeat right after the pause")
	_, err = st.MarkMoved(ctx)
	require.NoError(t, err)
	res, err := beat("c3")
	require.NoError(t, err)
	require.Equal(t, "127.0.0.1:1", res.MovedTo, "heartbeat right after the move")
	require.NoError(t, st.Resume(ctx))

	// A deleted host.
	require.NoError(t, st.Delete(ctx, "hosts", "h-1", 0))
	require.Eventually(t, func() bool {
		_, err := beat("c3")
		return errdefs.IsNotFound(err)
	}, enrollment.MaxHostCacheLag+2*time.Second, 20*time.Millisecond, "heartbeat of a deleted host")
}
