package controller_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/controller/election"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	"github.com/kilnhq/kiln/internal/kilnconfig"
	"github.com/kilnhq/kiln/internal/seal"
	"github.com/kilnhq/kiln/internal/testenv"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

// buildController builds cmd/kiln-controller into dir.
func buildController(t *testing.T, dir string) string {
	t.Helper()
	bin := filepath.Join(dir, "kiln-controller")
	cmd := exec.Command("go", "build", "-o", bin, "github.com/kilnhq/kiln/cmd/kiln-controller")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build kiln-controller: %s", out)
	return bin
}

// etcdMemberEnv, when set in the environment, makes the test binary run
// one embedded etcd member described by its JSON value instead of the
// tests (see TestMain), so the HA test can SIGKILL a member.
const etcdMemberEnv = "KILN_TEST_ETCD_MEMBER"

// runEtcdMember runs the member described by spec until the process is
// killed. It prints "ready" when the member serves.
func runEtcdMember(spec string) {
	var cfg store.EmbeddedConfig
	if err := json.Unmarshal([]byte(spec), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "etcd member:", err)
		os.Exit(2)
	}
	// Generous raft timing: two shared cores also build and run two
	// controllers.
	cfg.HeartbeatInterval = 200 * time.Millisecond
	cfg.ElectionTimeout = 2 * time.Second
	if _, err := store.StartEmbedded(context.Background(), cfg); err != nil {
		fmt.Fprintln(os.Stderr, "etcd member:", err)
		os.Exit(1)
	}
	fmt.Println("ready")
	select {}
}

// etcdCluster starts n etcd members on loopback, each in its own process
// (the test binary re-executed), and returns the processes.
func etcdCluster(ctx context.Context, t *testing.T, n int) (procs []*exec.Cmd, endpoints []string) {
	t.Helper()
	names := make([]string, n)
	peers := make([]string, n)
	clients := make([]string, n)
	for i := range n {
		var err error
		names[i] = fmt.Sprintf("m%d", i)
		peers[i], err = store.FreeLoopbackURL()
		require.NoError(t, err)
		clients[i], err = store.FreeLoopbackURL()
		require.NoError(t, err)
	}
	initial := store.InitialCluster(names, peers)
	dir := t.TempDir()
	ready := make(chan error, n)
	for i := range n {
		spec, err := json.Marshal(store.EmbeddedConfig{
			DataDir:        filepath.Join(dir, names[i]),
			Name:           names[i],
			ClientURL:      clients[i],
			PeerURL:        peers[i],
			InitialCluster: initial,
			ClusterToken:   "kiln-ha-test",
		})
		require.NoError(t, err)
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), etcdMemberEnv+"="+string(spec))
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		require.NoError(t, err)
		require.NoError(t, cmd.Start())
		t.Cleanup(func() {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		})
		go func() {
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				if sc.Text() == "ready" {
					ready <- nil
					return
				}
			}
			ready <- fmt.Errorf("etcd member %s exited before it was ready", names[i])
		}()
		procs = append(procs, cmd)
	}
	// Members of a new cluster start together: none is ready without a quorum.
	for range n {
		select {
		case err := <-ready:
			require.NoError(t, err)
		case <-ctx.Done():
			t.Fatalf("etcd cluster not ready: %v", ctx.Err())
		}
	}
	return procs, clients
}

// process is a kiln-controller child process.
type process struct {
	id      string
	cmd     *exec.Cmd
	addr    string
	caHash  string
	dataDir string
	stderr  string
}

// startProcess starts kiln-controller run as replica id on endpoints,
// with extra flags added, and waits until it serves. It is killed (by
// PID) at cleanup.
func startProcess(t *testing.T, bin, id, keyFile string, endpoints []string, extra ...string) *process {
	t.Helper()
	dataDir := t.TempDir()
	p := &process{id: id, dataDir: dataDir, stderr: filepath.Join(dataDir, "stderr.log")}
	errf, err := os.Create(p.stderr)
	require.NoError(t, err)
	defer errf.Close()
	p.cmd = exec.Command(bin, "run",
		"--data-dir", dataDir,
		"--listen", "127.0.0.1:0",
		"--etcd-endpoints", strings.Join(endpoints, ","),
		"--secret-key-file", keyFile,
		"--id", id,
		"--election-ttl", "2s",
	)
	p.cmd.Args = append(p.cmd.Args, extra...)
	p.cmd.Stderr = errf
	stdout, err := p.cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, p.cmd.Start())
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		_ = p.cmd.Wait()
		if t.Failed() {
			b, _ := os.ReadFile(p.stderr)
			t.Logf("controller %s stderr:\n%s", id, b)
		}
	})
	// The controller prints "kiln-controller VERSION serving on ADDR"
	// then "CA hash: sha256:...".
	addrc := make(chan [2]string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		var addr string
		for sc.Scan() {
			if a, ok := strings.CutPrefix(sc.Text(), "kiln-controller "); ok {
				if _, after, ok := strings.Cut(a, " serving on "); ok {
					addr = after
				}
			}
			if h, ok := strings.CutPrefix(sc.Text(), "CA hash: "); ok {
				addrc <- [2]string{addr, h}
			}
		}
	}()
	select {
	case got := <-addrc:
		p.addr, p.caHash = got[0], got[1]
	case <-time.After(90 * time.Second):
		b, _ := os.ReadFile(p.stderr)
		t.Fatalf("controller %s did not serve within 90s; stderr:\n%s", id, b)
	}
	return p
}

// resources dials the process's API with its own admin kilnconfig.
func (p *process) resources(t *testing.T) controllerv1.ResourcesClient {
	t.Helper()
	cfg, err := kilnconfig.Load(filepath.Join(p.dataDir, "kilnconfig-admin.yaml"))
	require.NoError(t, err)
	tc, err := cfg.TLS()
	require.NoError(t, err)
	conn, err := grpc.NewClient(p.addr, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return controllerv1.NewResourcesClient(conn)
}

// eventually retries op while it fails with Unavailable (etcd electing a
// new leader), until ctx ends. No timing assertion: ctx bounds it.
func eventually(ctx context.Context, t *testing.T, what string, op func(ctx context.Context) error) {
	t.Helper()
	for attempt := 1; ; attempt++ {
		octx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := errgrpc.FromGRPC(op(octx))
		cancel()
		if err == nil {
			return
		}
		if ctx.Err() != nil || !(errdefs.IsUnavailable(err) || errdefs.IsNotFound(err) || strings.Contains(err.Error(), "deadline")) {
			t.Fatalf("%s: %v (attempt %d)", what, err, attempt)
		}
		t.Logf("%s: attempt %d: %v; retrying", what, attempt, err)
		time.Sleep(200 * time.Millisecond)
	}
}

func TestMain(m *testing.M) {
	if spec := os.Getenv(etcdMemberEnv); spec != "" {
		runEtcdMember(spec)
		return
	}
	os.Exit(m.Run())
}

// TestHAFailover runs a three-member etcd and two kiln-controller
// processes on it, kills the leading controller with SIGKILL, and checks
// that the other takes over and the API keeps serving; then it stops one
// etcd member and checks the controller still serves reads and writes.
func TestHAFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("HA failover builds the controller and runs a three-member etcd: skipped with -short")
	}
	if _, err := exec.LookPath("go"); err != nil {
		testenv.Skip(t, "go toolchain not on PATH: cannot build kiln-controller")
	}
	// The deadline starts after the build: a cold build cache (make
	// fresh-check) or a loaded machine takes minutes of its own.
	bin := buildController(t, t.TempDir())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	members, endpoints := etcdCluster(ctx, t, 3)
	keyFile := filepath.Join(t.TempDir(), "secret.key")
	_, err := seal.LoadOrCreateKey(keyFile)
	require.NoError(t, err)

	procs := map[string]*process{}
	var wg sync.WaitGroup
	var mu sync.Mutex
	for _, id := range []string{"c1", "c2"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := startProcess(t, bin, id, keyFile, endpoints)
			mu.Lock()
			procs[id] = p
			mu.Unlock()
		}()
	}
	wg.Wait()
	require.Len(t, procs, 2)
	if procs["c1"].caHash != procs["c2"].caHash || !strings.HasPrefix(procs["c1"].caHash, "sha256:") {
		t.Errorf("replicas started together print CA hashes %q and %q, want one CA", procs["c1"].caHash, procs["c2"].caHash)
	}

	client, err := store.Dial(endpoints, nil)
	require.NoError(t, err)
	defer client.Close()
	observer := election.New(client, election.DefaultPrefix, "observer", 1, nil)
	var leaderID string
	eventually(ctx, t, "find leader", func(ctx context.Context) error {
		leaderID, err = observer.Leader(ctx)
		return err
	})
	require.Contains(t, procs, leaderID)
	leader := procs[leaderID]
	var standby *process
	for id, p := range procs {
		if id != leaderID {
			standby = p
		}
	}
	t.Logf("leader %s (pid %d), stand-by %s", leaderID, leader.cmd.Process.Pid, standby.id)

	// Both replicas serve the API and share one CA and one store.
	_, err = leader.resources(t).Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("ha-01", "pw-ha-01")}})
	require.NoError(t, err)
	sb := standby.resources(t)
	got, err := sb.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "ha-01"})
	require.NoError(t, err)
	require.Equal(t, "ha-01", got.GetHost().GetMetadata().GetName())

	// kill -9 the leader: no resignation, its lease must expire.
	killed := time.Now()
	require.NoError(t, leader.cmd.Process.Signal(syscall.SIGKILL))
	_ = leader.cmd.Wait()
	// The stand-by leads once its campaign returns and it logs so.
	for !strings.Contains(readFile(t, standby.stderr), "leading: reconcilers started") {
		require.NoError(t, ctx.Err(), "stand-by %s never started its reconcilers", standby.id)
		time.Sleep(20 * time.Millisecond)
	}
	takeover := time.Since(killed)
	t.Logf("takeover after SIGKILL of the leader: %v (election TTL 2s)", takeover.Round(time.Millisecond))
	id, err := observer.Leader(ctx)
	require.NoError(t, err)
	if id != standby.id {
		t.Errorf("election leader after failover = %q, want %q", id, standby.id)
	}

	_, err = sb.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("ha-02", "")}})
	require.NoError(t, err, "Apply through the surviving controller")
	list, err := sb.List(ctx, &controllerv1.ListRequest{Kind: "hosts"})
	require.NoError(t, err)
	if len(list.GetItems()) != 2 {
		t.Errorf("List after failover = %d hosts, want 2", len(list.GetItems()))
	}

	// kill -9 one of three etcd members, the raft leader (the hard case:
	// the others must notice and elect a new one): quorum stays, the
	// controller serves.
	lead := etcdLeader(ctx, t, client, endpoints)
	t.Logf("killing etcd member %d (raft leader, pid %d)", lead, members[lead].Process.Pid)
	lost := time.Now()
	require.NoError(t, members[lead].Process.Signal(syscall.SIGKILL))
	_ = members[lead].Wait()
	eventually(ctx, t, "apply with one etcd member down", func(ctx context.Context) error {
		_, err := sb.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("ha-03", "")}})
		return err
	})
	eventually(ctx, t, "list with one etcd member down", func(ctx context.Context) error {
		list, err = sb.List(ctx, &controllerv1.ListRequest{Kind: "hosts"})
		return err
	})
	t.Logf("apply and list served %v after losing the etcd raft leader", time.Since(lost).Round(time.Millisecond))
	if len(list.GetItems()) != 3 {
		t.Errorf("List with one etcd member down = %d hosts, want 3", len(list.GetItems()))
	}
	eventually(ctx, t, "leader with one etcd member down", func(ctx context.Context) error {
		id, err := observer.Leader(ctx)
		if err == nil && id != standby.id {
			return fmt.Errorf("leader is %q, want %q", id, standby.id)
		}
		return err
	})
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return string(b)
}

// etcdLeader returns the index of the endpoint whose member leads raft.
func etcdLeader(ctx context.Context, t *testing.T, client *clientv3.Client, endpoints []string) int {
	t.Helper()
	for i, ep := range endpoints {
		st, err := client.Status(ctx, ep)
		require.NoError(t, err)
		if st.Header.MemberId == st.Leader {
			return i
		}
	}
	t.Fatalf("no etcd member reports itself leader")
	return -1
}
