package controller_test

import (
	"context"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/election"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/seal"
	"github.com/kilnhq/kiln/internal/testenv"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// fenceHosts is the size of TestPausedLeaderIsFenced's provisioning wave.
const fenceHosts = 24

// TestPausedLeaderIsFenced runs two kiln-controller processes on one etcd
// (a member in a process of its own), each with --simulate: the leader
// provisions a wave of simulated hosts and is frozen with SIGSTOP while
// hosts are mid-step (some laying their image). Its lease expires, the
// stand-by takes the lease and carries the wave on. Then the old leader
// is thawed with SIGCONT: it still believes it leads for a moment, and
// its next step-starting write (the host status it stores before acting)
// is refused by the fence on its election key, which its log says; it
// records nothing more. The new leader provisions every host, each laid
// exactly once by the store's count and events.
//
// The simulated hosts live inside each controller process, so the new
// leader cannot re-attach to a lay the old one started: those steps time
// out (short --step-timeout) and start again, as after a host that lost
// power. What the test checks is what fencing promises: the deposed
// process changes nothing once thawed.
func TestPausedLeaderIsFenced(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the controller and runs two of them on an etcd: skipped with -short")
	}
	if _, err := exec.LookPath("go"); err != nil {
		testenv.Skip(t, "go toolchain not on PATH: cannot build kiln-controller")
	}
	bin := buildController(t, t.TempDir())
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	_, endpoints := etcdCluster(ctx, t, 1)
	keyFile := filepath.Join(t.TempDir(), "secret.key")
	_, err := seal.LoadOrCreateKey(keyFile)
	require.NoError(t, err)
	start := time.Now()
	mark := func(format string, args ...any) {
		t.Logf("timeline: [%6.1fs] %s", time.Since(start).Seconds(), fmt.Sprintf(format, args...))
	}

	// The simulated steps are seconds long; a step whose simulated host
	// lived in the other process times out in 20 s and starts again.
	args := []string{"--simulate", fmt.Sprint(fenceHosts), "--election-ttl", "3s",
		"--step-timeout", "WaitBootAgent=20s", "--step-timeout", "LayImage=20s",
		"--step-timeout", "WriteIdentity=20s", "--step-timeout", "WaitInstalledAgent=20s"}
	old := startProcess(t, bin, "c1", keyFile, endpoints, args...)
	waitLog(ctx, t, old, 0, "leading: reconcilers started")
	mark("c1 (pid %d) leads and provisions %d simulated hosts", old.cmd.Process.Pid, fenceHosts)
	standby := startProcess(t, bin, "c2", keyFile, endpoints, args...)
	mark("c2 (pid %d) stands by", standby.cmd.Process.Pid)

	client, err := store.Dial(endpoints, nil)
	require.NoError(t, err)
	defer client.Close()
	st := store.New(client)
	observer := election.New(client, election.DefaultPrefix, "observer", 1, nil)
	leader, err := observer.Leader(ctx)
	require.NoError(t, err)
	require.Equal(t, "c1", leader, "leader before the pause")

	// Mid-wave: some host is laying its image, none is Provisioned yet.
	var laying string
	waitHosts(ctx, t, st, "a host laying its image", func(hs []*typesv1.Host) bool {
		for _, h := range hs {
			require.NotEqual(t, typesv1.HostState_HOST_STATE_PROVISIONED, h.GetStatus().GetState(), "host %s Provisioned before the pause: the wave went too fast to pause mid-way", h.GetMetadata().GetName())
			if h.GetStatus().GetProvisioningStep() == "LayImage" {
				laying = h.GetMetadata().GetName()
				return true
			}
		}
		return false
	})
	before := stepCounts(ctx, t, st)
	require.NoError(t, syscall.Kill(old.cmd.Process.Pid, syscall.SIGSTOP))
	stopped := time.Now()
	mark("SIGSTOP c1 while host %s lays its image; steps: %s", laying, before)

	// c2 takes the lease once c1's expires, and carries the wave on.
	waitLog(ctx, t, standby, 0, "leading: reconcilers started")
	mark("c2 leads, %.1fs after the SIGSTOP (election TTL 3s)", time.Since(stopped).Seconds())
	leader, err = observer.Leader(ctx)
	require.NoError(t, err)
	require.Equal(t, "c2", leader, "leader after the pause")
	rev := hostsRevision(ctx, t, client)
	waitHosts(ctx, t, st, "c2 writing hosts", func([]*typesv1.Host) bool { return hostsRevision(ctx, t, client) > rev })
	mark("c2 writes hosts; steps: %s", stepCounts(ctx, t, st))

	// Thaw c1: whatever it does next is refused.
	from := fileSize(t, old.stderr)
	require.NoError(t, syscall.Kill(old.cmd.Process.Pid, syscall.SIGCONT))
	mark("SIGCONT c1 after %.1fs stopped", time.Since(stopped).Seconds())
	waitLog(ctx, t, old, from, "reconcilers stopped")
	thawed := readFile(t, old.stderr)[from:]
	mark("c1 stopped its reconcilers (leadership lost)")
	var refused []string
	for _, l := range strings.Split(thawed, "\n") {
		if strings.Contains(l, "no longer the leader") {
			refused = append(refused, l)
		}
	}
	require.NotEmpty(t, refused, "c1's log after SIGCONT has no refused write:\n%s", thawed)
	t.Logf("c1's refused writes after SIGCONT (%d), first:\n%s", len(refused), refused[0])
	// A stored step is followed by its events in the log ("host
	// ImageLaid", "host Provisioned"...): none after the thaw.
	events := regexp.MustCompile(`msg="host [A-Z]`)
	require.False(t, events.MatchString(thawed), "c1 recorded host events after SIGCONT:\n%s", thawed)

	// c2 provisions every host; each is laid once.
	waitHosts(ctx, t, st, "every host Provisioned", func(hs []*typesv1.Host) bool {
		for _, h := range hs {
			if h.GetStatus().GetState() != typesv1.HostState_HOST_STATE_PROVISIONED {
				return false
			}
		}
		return len(hs) == fenceHosts
	})
	mark("c2 provisioned all %d hosts", fenceHosts)
	res := standby.resources(t)
	hs := listHosts(ctx, t, st)
	for _, h := range hs {
		name := h.GetMetadata().GetName()
		require.EqualValues(t, 1, h.GetStatus().GetImageLays(), "host %s: image lays", name)
		evs, err := res.ListEvents(ctx, &controllerv1.ListEventsRequest{ObjectKind: "Host", ObjectName: name})
		require.NoError(t, err)
		laid := 0
		for _, ev := range evs.GetEvents() {
			if ev.GetReason() == "ImageLaid" {
				laid++
			}
		}
		require.Equal(t, 1, laid, "host %s: ImageLaid events", name)
	}
	leader, err = observer.Leader(ctx)
	require.NoError(t, err)
	require.Equal(t, "c2", leader, "leader at the end")
}

// waitLog waits until the process's log, from byte offset from on,
// contains s.
func waitLog(ctx context.Context, t *testing.T, p *process, from int, s string) {
	t.Helper()
	for !strings.Contains(readFile(t, p.stderr)[from:], s) {
		if ctx.Err() != nil {
			t.Fatalf("controller %s never logged %q; its log:\n%s", p.id, s, readFile(t, p.stderr)[from:])
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// waitHosts polls the hosts until done says so.
func waitHosts(ctx context.Context, t *testing.T, st *store.Store, what string, done func([]*typesv1.Host) bool) {
	t.Helper()
	for !done(listHosts(ctx, t, st)) {
		if ctx.Err() != nil {
			t.Fatalf("waiting for %s: %v; steps: %s", what, ctx.Err(), stepCounts(context.Background(), t, st))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func listHosts(ctx context.Context, t *testing.T, st *store.Store) []*typesv1.Host {
	t.Helper()
	items, _, err := st.List(ctx, "hosts", func() proto.Message { return &typesv1.Host{} }, store.ListOptions{})
	require.NoError(t, err)
	out := make([]*typesv1.Host, 0, len(items))
	for _, it := range items {
		out = append(out, it.Msg.(*typesv1.Host))
	}
	return out
}

// stepCounts is how many hosts are at each state/step.
func stepCounts(ctx context.Context, t *testing.T, st *store.Store) string {
	n := map[string]int{}
	for _, h := range listHosts(ctx, t, st) {
		k := strings.TrimPrefix(h.GetStatus().GetState().String(), "HOST_STATE_")
		if s := h.GetStatus().GetProvisioningStep(); s != "" {
			k += "/" + s
		}
		n[k]++
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(n)) {
		parts = append(parts, fmt.Sprintf("%s %d", k, n[k]))
	}
	return strings.Join(parts, ", ")
}

// hostsRevision is the newest mod revision of the hosts' keys: it moves
// whenever a controller stores a host.
func hostsRevision(ctx context.Context, t *testing.T, client *clientv3.Client) int64 {
	t.Helper()
	resp, err := client.Get(ctx, store.Prefix+"hosts/", clientv3.WithPrefix(), clientv3.WithKeysOnly())
	require.NoError(t, err)
	var rev int64
	for _, kv := range resp.Kvs {
		rev = max(rev, kv.ModRevision)
	}
	return rev
}

func fileSize(t *testing.T, path string) int {
	t.Helper()
	fi, err := os.Stat(path)
	require.NoError(t, err)
	return int(fi.Size())
}
