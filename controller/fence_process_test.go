package controller_test

import (
	"context"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/election"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/seal"
	"github.com/kilnhq/kiln/internal/testenv"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestPausedLeaderIsFenced's provisioning wave and election lease: the
// leader's etcd client renews the lease every third of it, so a leader
// paused just after a renewal believes it leads for about 10 s after it
// is thawed, longer than a simulated boot and lay (3 + 6 s): without the
// fence it would lay hosts the new leader lays too.
const (
	fenceHosts = 24
	fenceTTL   = 30 * time.Second
)

// TestPausedLeaderIsFenced runs two kiln-controller processes on one etcd
// (a member in a process of its own), each with --simulate: the leader
// provisions a wave of simulated hosts and is frozen with SIGSTOP while
// hosts are mid-step (booting the agent they lay the image with). While it
// is frozen its election key is deleted on the etcd side, as etcd deletes
// it when the key's lease runs out, and the stand-by takes over and
// carries the wave on. The old leader is thawed with SIGCONT still holding
// a live lease: it cannot learn from a keep-alive that it lost, so it
// believes it leads and goes on with the wave, and its step-starting
// writes (the host status it stores before acting) are refused by the
// fence on its election key, which its log says; it records nothing. Only
// then does the test revoke its lease, and the old leader stops its
// reconcilers. The new leader provisions every host, each laid exactly
// once by the store's count and events.
//
// Deleting the key instead of revoking the lease holds open, for as long
// as the test needs, the window a real deposed leader has between the end
// of its lease and its next keep-alive (a third of the TTL at most):
// revoked while the old leader was frozen, the lease's end could reach it
// first (a keep-alive due at the thaw) and the fence would not be
// exercised; CI saw that twice. (Paused for longer than the TTL, a real
// leader's etcd client finds its lease deadline passed the moment it is
// thawed and stops before anything writes: the fence is for the window.)
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
	// The simulated hosts exist before the controllers (the leader's
	// --simulate keeps them) and stay unbound, so the wave starts only
	// once the test binds them, with both controllers up.
	client, err := store.Dial(endpoints, nil)
	require.NoError(t, err)
	defer client.Close()
	st := store.New(client)
	names, err := sim.Populate(ctx, st, fenceHosts, "sim")
	require.NoError(t, err)
	for _, n := range names {
		bindHost(ctx, t, st, n, "")
	}
	args := []string{"--simulate", fmt.Sprint(fenceHosts), "--election-ttl", fenceTTL.String(),
		"--step-timeout", "WaitBootAgent=20s", "--step-timeout", "LayImage=20s",
		"--step-timeout", "WriteIdentity=20s", "--step-timeout", "WaitInstalledAgent=20s"}
	old := startProcess(t, bin, "c1", keyFile, endpoints, args...)
	waitLog(ctx, t, old, 0, "leading: reconcilers started")
	mark("c1 (pid %d) leads", old.cmd.Process.Pid)
	standby := startProcess(t, bin, "c2", keyFile, endpoints, args...)
	mark("c2 (pid %d) stands by", standby.cmd.Process.Pid)

	observer := election.New(client, election.DefaultPrefix, "observer", 1, nil)
	leader, err := observer.Leader(ctx)
	require.NoError(t, err)
	require.Equal(t, "c1", leader, "leader before the pause")

	// Inspected, then bound to their machines: the wave starts.
	waitHosts(ctx, t, st, "every host Available", func(hs []*typesv1.Host) bool {
		for _, h := range hs {
			if h.GetStatus().GetState() != typesv1.HostState_HOST_STATE_AVAILABLE {
				return false
			}
		}
		return len(hs) == fenceHosts
	})
	lease := leaderLease(ctx, t, client, "c1")
	for _, n := range names {
		bindHost(ctx, t, st, n, "m-"+n)
	}
	mark("%d hosts Available, bound to their machines: the wave starts", fenceHosts)
	waitHosts(ctx, t, st, "hosts booting the agent", func(hs []*typesv1.Host) bool {
		for _, h := range hs {
			if h.GetStatus().GetProvisioningStep() == "WaitBootAgent" {
				return true
			}
		}
		return false
	})
	before := stepCounts(ctx, t, st)
	require.NoError(t, syscall.Kill(old.cmd.Process.Pid, syscall.SIGSTOP))
	stopped := time.Now()
	mark("SIGSTOP c1 mid-wave; steps: %s", before)
	key := leaderKey(ctx, t, client, "c1")
	_, err = client.Delete(ctx, key)
	require.NoError(t, err)
	mark("c1's election key %s deleted on the etcd side while c1 is stopped (its lease %x lives on)", key, lease)

	// c2 takes over and carries the wave on.
	waitLog(ctx, t, standby, 0, "leading: reconcilers started")
	mark("c2 leads, %.1fs after the SIGSTOP", time.Since(stopped).Seconds())
	leader, err = observer.Leader(ctx)
	require.NoError(t, err)
	require.Equal(t, "c2", leader, "leader after the pause")
	rev := hostsRevision(ctx, t, client)
	waitHosts(ctx, t, st, "c2 writing hosts", func([]*typesv1.Host) bool { return hostsRevision(ctx, t, client) > rev })
	mark("c2 writes hosts; steps: %s", stepCounts(ctx, t, st))

	// Keep c1 frozen past a simulated boot (3 s), so that its simulated
	// agents' check-ins are due the moment it thaws.
	if d := 4*time.Second - time.Since(stopped); d > 0 {
		time.Sleep(d)
	}
	// Thaw c1: whatever it stores next is refused. Once its log shows a
	// refusal, its lease ends too, and it stops.
	from := fileSize(t, old.stderr)
	require.NoError(t, syscall.Kill(old.cmd.Process.Pid, syscall.SIGCONT))
	mark("SIGCONT c1 after %.1fs stopped", time.Since(stopped).Seconds())
	waitLog(ctx, t, old, from, "no longer the leader")
	mark("c1's first write after the thaw is refused by the fence")
	_, err = client.Revoke(ctx, lease)
	require.NoError(t, err)
	mark("c1's lease %x revoked", lease)
	waitLog(ctx, t, old, from, "reconcilers stopped")
	thawed := readFile(t, old.stderr)[from:]
	var refused []string
	lost := -1
	for _, l := range strings.Split(thawed, "\n") {
		if strings.Contains(l, "no longer the leader") {
			refused = append(refused, l)
		}
		if lost < 0 && strings.Contains(l, "leadership lost") {
			lost = len(refused)
		}
	}
	// Checked without stopping the test, so that the store's account
	// below shows too what an unfenced leader did.
	switch {
	case len(refused) == 0:
		t.Errorf("c1's log after SIGCONT has no refused write:\n%s", thawed)
	case lost <= 0:
		t.Errorf("c1 learnt it lost the lease before any write was refused: the fence was not what stopped it:\n%s", thawed)
	default:
		writes := 0
		for _, l := range refused {
			if strings.Contains(l, "store status") {
				writes++
			}
		}
		mark("c1 thawed: %d refusals by the fence (%d host status writes, %d fenced checks before a BMC or agent action) before it learnt it lost the lease, then it stopped its reconcilers",
			lost, writes, len(refused)-writes)
		t.Logf("c1's first refused write after SIGCONT:\n%s", refused[0])
	}
	// (c1 may still log, after the thaw, the event of a status it stored
	// just before the pause: what it stores after the thaw is refused.)

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
		assert.EqualValues(t, 1, h.GetStatus().GetImageLays(), "host %s: image lays", name)
		evs, err := res.ListEvents(ctx, &controllerv1.ListEventsRequest{ObjectKind: "Host", ObjectName: name})
		require.NoError(t, err)
		laid := 0
		for _, ev := range evs.GetEvents() {
			if ev.GetReason() == "ImageLaid" {
				laid++
			}
		}
		assert.Equal(t, 1, laid, "host %s: ImageLaid events", name)
	}
	leader, err = observer.Leader(ctx)
	require.NoError(t, err)
	require.Equal(t, "c2", leader, "leader at the end")
}

// leaderKey is the election key of replica id.
func leaderKey(ctx context.Context, t *testing.T, client *clientv3.Client, id string) string {
	t.Helper()
	resp, err := client.Get(ctx, election.DefaultPrefix+"/", clientv3.WithPrefix())
	require.NoError(t, err)
	for _, kv := range resp.Kvs {
		if string(kv.Value) == id {
			return string(kv.Key)
		}
	}
	t.Fatalf("no election key of %s", id)
	return ""
}

// leaderLease is the lease of the election key of replica id.
func leaderLease(ctx context.Context, t *testing.T, client *clientv3.Client, id string) clientv3.LeaseID {
	t.Helper()
	resp, err := client.Get(ctx, election.DefaultPrefix+"/", clientv3.WithPrefix())
	require.NoError(t, err)
	for _, kv := range resp.Kvs {
		if string(kv.Value) == id {
			return clientv3.LeaseID(kv.Lease)
		}
	}
	t.Fatalf("no election key of %s", id)
	return 0
}

// bindHost sets host's status.machine to machine, again on a conflict
// (the leader writes hosts too).
func bindHost(ctx context.Context, t *testing.T, st *store.Store, host, machine string) {
	t.Helper()
	for {
		h := &typesv1.Host{}
		rev, err := st.Get(ctx, "hosts", host, h)
		require.NoError(t, err)
		if h.Status == nil {
			h.Status = &typesv1.HostStatus{}
		}
		h.Status.Machine = machine
		if _, err = st.Update(ctx, "hosts", host, h, rev); !errdefs.IsConflict(err) {
			require.NoError(t, err, "bind host %s to %q", host, machine)
			return
		}
	}
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
