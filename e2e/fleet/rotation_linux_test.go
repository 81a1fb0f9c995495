package fleet

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/kilnconfig"
	"github.com/kilnhq/kiln/internal/pki"
	"github.com/kilnhq/kiln/internal/testenv"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// rotationLab is a kiln-controller process on a lab bridge and agents
// enrolled from network namespaces behind it, each a kiln-agent process
// as a BYOH host runs it.
type rotationLab struct {
	t        *testing.T
	bin      string
	dir      string
	addr     string
	hosts    []string
	agentNS  map[string]string
	agentPID map[string]int
}

func (l *rotationLab) data() string             { return filepath.Join(l.dir, "controller") }
func (l *rotationLab) admin() string            { return filepath.Join(l.data(), "kilnconfig-admin.yaml") }
func (l *rotationLab) agentDir(h string) string { return filepath.Join(l.dir, "agent-"+h) }

// start runs name (a binary of l.bin, or ip netns exec NS name when ns is
// set) in the background with its output in dir/log, killed at the end.
func (l *rotationLab) start(ctx context.Context, ns, log, name string, args ...string) int {
	t := l.t
	t.Helper()
	argv := append([]string{filepath.Join(l.bin, name)}, args...)
	if ns != "" {
		argv = append([]string{"ip", "netns", "exec", ns}, argv...)
	}
	f, err := os.OpenFile(filepath.Join(l.dir, log), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	require.NoError(t, err)
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	require.NoError(t, cmd.Start(), "start %s", strings.Join(argv, " "))
	f.Close()
	pid := cmd.Process.Pid
	go func() { _ = cmd.Wait() }()
	t.Cleanup(func() {
		// Our own process group, by PID.
		_ = syscall.Kill(-pid, syscall.SIGTERM)
		time.Sleep(200 * time.Millisecond)
		_ = syscall.Kill(-pid, syscall.SIGKILL)
	})
	return pid
}

// cmd runs a binary of l.bin to its end.
func (l *rotationLab) cmd(ctx context.Context, name string, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, filepath.Join(l.bin, name), args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// hosts reads every Host with a fresh admin kilnconfig.
func (l *rotationLab) list(ctx context.Context) map[string]*typesv1.Host {
	t := l.t
	t.Helper()
	cfg, err := kilnconfig.Load(l.admin())
	require.NoError(t, err)
	conn, err := kilnconfig.Dial(ctx, cfg)
	require.NoError(t, err)
	defer conn.Close()
	resp, err := controllerv1.NewResourcesClient(conn).List(ctx, &controllerv1.ListRequest{Kind: "hosts"})
	require.NoError(t, err)
	out := map[string]*typesv1.Host{}
	for _, r := range resp.GetItems() {
		out[r.GetHost().GetMetadata().GetName()] = r.GetHost()
	}
	return out
}

// waitHeartbeats waits until every agent has sent a heartbeat after since
// (and is reachable), and returns how long that took.
func (l *rotationLab) waitHeartbeats(ctx context.Context, since time.Time, what string) time.Duration {
	t := l.t
	t.Helper()
	start := time.Now()
	var last string
	for time.Since(start) < 60*time.Second {
		hosts := l.list(ctx)
		var late []string
		for _, h := range l.hosts {
			st := hosts[h].GetStatus()
			if !st.GetAgent().GetLastHeartbeat().AsTime().After(since) || !conditions.IsTrue(st.GetConditions(), "AgentReachable") {
				late = append(late, h)
			}
		}
		if len(late) == 0 {
			return time.Since(start)
		}
		last = strings.Join(late, ", ")
		time.Sleep(250 * time.Millisecond)
	}
	t.Fatalf("%s: no heartbeat within 60s from %s; agent logs:\n%s", what, last, l.agentLogs())
	return 0
}

func (l *rotationLab) agentLogs() string {
	var b strings.Builder
	for _, h := range l.hosts {
		out, _ := os.ReadFile(filepath.Join(l.dir, "agent-"+h+".log"))
		fmt.Fprintf(&b, "--- %s\n%s\n", h, tail(string(out), 15))
	}
	return b.String()
}

// onCA counts the hosts whose current certificate is from the CA of key
// id and in use.
func onCA(hosts map[string]*typesv1.Host, keyID string) int {
	n := 0
	for _, h := range hosts {
		a := h.GetStatus().GetAgent()
		if a.GetCertificateIssuer() == keyID && a.GetPreviousCertificateSerial() == "" {
			n++
		}
	}
	return n
}

// rotationRow is one line of the timeline.
type rotationRow struct {
	phase      string
	at         time.Time
	took       time.Duration
	heartbeats time.Duration
	renewed    string
	kilnctl    string
}

// TestRotateSecretKeyAndCAOnARunningLab rotates the secret-sealing key and
// the controller CA on a running controller with three enrolled agents in
// network namespaces, without reimaging a host or restarting an agent:
// after each phase every agent heartbeats, the hosts' image lay counters
// and the agents' processes are unchanged, and kilnctl works with the
// kilnconfig it had before the rotation until the old CA is retired;
// after that, a certificate of the old CA is refused. It logs the
// timeline of each rotation (and writes it to $KILN_ROTATION_TIMELINE
// when set).
func TestRotateSecretKeyAndCAOnARunningLab(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller and three agents in network namespaces (a minute)")
	}
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root: network namespaces and a bridge")
	}
	for _, tool := range []string{"ip", "nft"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "needs %s (hack/deps.sh installs it)", tool)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	bin := t.TempDir()
	for _, b := range []string{"kiln-agent", "kiln-controller", "kilnctl"} {
		cmd := exec.CommandContext(ctx, filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-trimpath", "-o", filepath.Join(bin, b), "github.com/kilnhq/kiln/cmd/"+b)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "go build %s: %s", b, out)
	}
	net := newLabNet(t, ctx)
	l := &rotationLab{t: t, bin: bin, dir: t.TempDir(), addr: net.addr(1) + ":7443", agentNS: map[string]string{}, agentPID: map[string]int{}}
	l.start(ctx, "", "controller.log", "kiln-controller", "run", "--data-dir", l.data(), "--listen", l.addr,
		"--server-name", net.addr(1), "--lifecycle=false", "--heartbeat-interval", "1s", "--agent-silence", "5s")
	require.Eventually(t, func() bool {
		_, err := l.cmd(ctx, "kilnctl", "--kilnconfig", l.admin(), "get", "hosts")
		return err == nil
	}, 2*time.Minute, 300*time.Millisecond, "controller API")
	// kilnctl's kilnconfig as it was before any rotation.
	oldCfg := filepath.Join(l.dir, "kilnconfig-before.yaml")
	b, err := os.ReadFile(l.admin())
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(oldCfg, b, 0o600))
	oldKC, err := kilnconfig.Load(oldCfg)
	require.NoError(t, err)
	kilnctlOld := func() string {
		if out, err := l.cmd(ctx, "kilnctl", "--kilnconfig", oldCfg, "get", "hosts"); err != nil {
			return "fails: " + strings.TrimSpace(out)
		}
		return "works"
	}
	// A host with a sealed BMC password, so the key rotation has a secret
	// besides the CA keys (the lifecycle is off: nothing dials the BMC).
	_, err = l.cmd(ctx, "kilnctl", "--kilnconfig", l.admin(), "apply", "-f", writeFile(t, l.dir, "bmc.yaml", `apiVersion: kiln.dev/v1
kind: Host
metadata:
  name: bmc-01
spec:
  bootMac: "52:54:00:00:00:99"
  bmc:
    protocol: redfish
    address: http://127.0.0.1:1
    username: admin
    password: s3cret-rotation
`))
	require.NoError(t, err)

	id := os.Getpid() % 100000
	for i := 1; i <= 3; i++ {
		h := fmt.Sprintf("rot-%02d", i)
		ns := fmt.Sprintf("krot%d-%d", id, i)
		veth := fmt.Sprintf("kr%d-%d", id, i)
		run(t, ctx, "ip", "netns", "add", ns)
		t.Cleanup(func() { runCleanup(t, "ip", "netns", "del", ns) })
		run(t, ctx, "ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
		run(t, ctx, "ip", "link", "set", veth, "master", net.bridge, "up")
		run(t, ctx, "ip", "-n", ns, "addr", "add", net.addr(10+i)+"/24", "dev", "eth0")
		run(t, ctx, "ip", "-n", ns, "link", "set", "eth0", "up")
		run(t, ctx, "ip", "-n", ns, "link", "set", "lo", "up")
		out, err := l.cmd(ctx, "kilnctl", "--kilnconfig", l.admin(), "token", "create", "--host", h, "--ttl", "10m")
		require.NoError(t, err)
		var tok, hash string
		for _, line := range strings.Split(out, "\n") {
			if v, ok := strings.CutPrefix(line, "Token: "); ok {
				tok = v
			}
			if v, ok := strings.CutPrefix(line, "CA hash: "); ok {
				hash = v
			}
		}
		require.NotEmpty(t, tok, "token create: %s", out)
		enroll := exec.CommandContext(ctx, "ip", "netns", "exec", ns, filepath.Join(bin, "kiln-agent"), "--data-dir", l.agentDir(h),
			"enroll", "--controller", l.addr, "--token", tok, "--ca-hash", hash, "--host", h)
		eo, err := enroll.CombinedOutput()
		require.NoError(t, err, "kiln-agent enroll %s: %s", h, eo)
		l.agentNS[h] = ns
		l.agentPID[h] = l.start(ctx, ns, "agent-"+h+".log", "kiln-agent", "--data-dir", l.agentDir(h),
			"run", "--listen", net.addr(10+i)+":7444", "--heartbeat-interval", "1s", "--memory-trim-interval", "0")
		l.hosts = append(l.hosts, h)
	}
	l.waitHeartbeats(ctx, time.Now(), "after enrollment")
	before := l.list(ctx)
	lays := map[string]int64{}
	for _, h := range l.hosts {
		lays[h] = before[h].GetStatus().GetImageLays()
	}
	oldCA := before["rot-01"].GetStatus().GetAgent().GetCertificateIssuer()
	require.NotEmpty(t, oldCA, "issuer recorded at enrollment")

	var rows []rotationRow
	phase := func(name string, args ...string) (rotationRow, string) {
		start := time.Now()
		out, err := l.cmd(ctx, "kiln-controller", args...)
		require.NoError(t, err, "%s", name)
		r := rotationRow{phase: name, at: start, took: time.Since(start)}
		r.heartbeats = l.waitHeartbeats(ctx, time.Now(), "after "+name)
		for _, h := range l.hosts {
			if !processAlive(l.agentPID[h]) {
				t.Fatalf("after %s: the agent of %s (PID %d) is gone; log:\n%s", name, h, l.agentPID[h], l.agentLogs())
			}
		}
		r.kilnctl = kilnctlOld()
		t.Logf("%s (%s): %s", name, r.took.Round(time.Millisecond), strings.TrimSpace(out))
		return r, out
	}

	// 1. The secret-sealing key, in one run on the running controller.
	r, out := phase("rotate-secret-key", "rotate-secret-key", "--data-dir", l.data())
	require.Contains(t, out, "rotated the secret key")
	r.renewed = "-"
	rows = append(rows, r)
	require.Equal(t, "works", r.kilnctl, "kilnctl with its old kilnconfig after the key rotation")

	// 2. The CA: prepare, switch, wait for the agents to renew, retire.
	r, out = phase("rotate-ca prepare", "rotate-ca", "--phase", "prepare", "--data-dir", l.data())
	require.Contains(t, out, "prepared: new CA")
	hosts := l.list(ctx)
	r.renewed = fmt.Sprintf("%d/3 on the old CA", onCA(hosts, oldCA))
	rows = append(rows, r)
	require.Equal(t, "works", r.kilnctl)
	var newCA string
	for _, f := range strings.Fields(out) {
		if len(f) == 40 && f != oldCA {
			newCA = f
			break
		}
	}
	require.NotEmpty(t, newCA, "new CA id in: %s", out)
	// Every agent takes both CAs from its heartbeats.
	require.Eventually(t, func() bool {
		for _, h := range l.hosts {
			b, err := os.ReadFile(filepath.Join(l.agentDir(h), "ca.crt"))
			if err != nil || strings.Count(string(b), "BEGIN CERTIFICATE") != 2 {
				return false
			}
		}
		return true
	}, 30*time.Second, 250*time.Millisecond, "agents trust both CAs after prepare; logs:\n%s", l.agentLogs())

	r, _ = phase("rotate-ca switch", "rotate-ca", "--phase", "switch", "--data-dir", l.data())
	require.Equal(t, "works", r.kilnctl, "kilnctl with its old kilnconfig during the overlap")
	switched := time.Now()
	var renewedIn time.Duration
	require.Eventually(t, func() bool {
		if onCA(l.list(ctx), newCA) == len(l.hosts) {
			renewedIn = time.Since(switched)
			return true
		}
		return false
	}, 60*time.Second, 250*time.Millisecond, "agents renewed onto the new CA; logs:\n%s", l.agentLogs())
	r.renewed = fmt.Sprintf("3/3 on the new CA %s after the switch", renewedIn.Round(100*time.Millisecond))
	rows = append(rows, r)
	// The operator renews the existing way: a new kilnconfig.
	newCfg := filepath.Join(l.dir, "kilnconfig-renewed.yaml")
	_, err = l.cmd(ctx, "kiln-controller", "operator-cert", "--data-dir", l.data(), "--role", "admin", "--name", "ops", "-o", newCfg, "--server", l.addr)
	require.NoError(t, err)
	require.Equal(t, "works", kilnctlOld(), "kilnctl with its old kilnconfig after the agents renewed")

	r, out = phase("rotate-ca retire", "rotate-ca", "--phase", "retire", "--data-dir", l.data())
	require.Contains(t, out, "retired CA "+oldCA)
	r.renewed = fmt.Sprintf("%d/3 on the new CA", onCA(l.list(ctx), newCA))
	rows = append(rows, r)
	require.True(t, strings.HasPrefix(r.kilnctl, "fails"), "kilnctl with a kilnconfig of the old CA after retire: %s", r.kilnctl)
	_, err = l.cmd(ctx, "kilnctl", "--kilnconfig", newCfg, "get", "hosts")
	require.NoError(t, err, "kilnctl with the renewed kilnconfig after retire")
	// A certificate of the old CA is refused even by a client that trusts
	// the new CA.
	newKC, err := kilnconfig.Load(newCfg)
	require.NoError(t, err)
	pool := x509.NewCertPool()
	require.True(t, pool.AppendCertsFromPEM([]byte(newKC.CA)))
	pair, err := tls.X509KeyPair([]byte(oldKC.Cert), []byte(oldKC.Key))
	require.NoError(t, err)
	conn, err := grpc.NewClient(l.addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{MinVersion: tls.VersionTLS13, RootCAs: pool, Certificates: []tls.Certificate{pair}})))
	require.NoError(t, err)
	defer conn.Close()
	_, err = controllerv1.NewResourcesClient(conn).List(ctx, &controllerv1.ListRequest{Kind: "hosts"})
	require.Equal(t, codes.PermissionDenied, status.Code(err), "old-CA admin certificate after retire: %v", err)
	t.Logf("old-CA admin certificate after retire: %v", err)

	// Every agent trusts only the new CA now, and the same processes run.
	l.waitHeartbeats(ctx, time.Now(), "at the end")
	require.Eventually(t, func() bool {
		for _, h := range l.hosts {
			b, err := os.ReadFile(filepath.Join(l.agentDir(h), "ca.crt"))
			if err != nil {
				return false
			}
			certs, err := pki.ParseCertificatesPEM(b)
			if err != nil || len(certs) != 1 || fmt.Sprintf("%x", certs[0].SubjectKeyId) != newCA {
				return false
			}
		}
		return true
	}, 30*time.Second, 250*time.Millisecond, "agents trust only the new CA after retire")
	after := l.list(ctx)
	for _, h := range l.hosts {
		require.Equal(t, lays[h], after[h].GetStatus().GetImageLays(), "image lays of %s", h)
		require.True(t, processAlive(l.agentPID[h]), "agent of %s restarted", h)
	}

	var tl strings.Builder
	tw := tabwriter.NewWriter(&tl, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "PHASE\tAT (UTC)\tTOOK\tALL AGENTS HEARTBEAT WITHIN\tAGENTS\tKILNCTL, OLD KILNCONFIG")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", r.phase, r.at.UTC().Format("15:04:05.000"), r.took.Round(time.Millisecond), r.heartbeats.Round(10*time.Millisecond), r.renewed, firstLine(r.kilnctl))
	}
	tw.Flush()
	fmt.Fprintf(&tl, "image lays before and after: %v; agent processes: unchanged (%d)\n", lays, len(l.hosts))
	t.Logf("rotation timeline:\n%s", tl.String())
	if p := os.Getenv("KILN_ROTATION_TIMELINE"); p != "" {
		require.NoError(t, os.WriteFile(p, []byte(tl.String()), 0o644))
	}
}

func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
	return p
}

func processAlive(pid int) bool { return syscall.Kill(pid, 0) == nil }

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	if len(s) > 140 {
		s = s[:140] + "..."
	}
	return s
}
