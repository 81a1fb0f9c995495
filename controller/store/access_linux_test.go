package store

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kilnhq/kiln/internal/testenv"
)

// attackTargetsEnv carries the endpoints the attacker child tries, one per
// line; its presence makes TestEtcdAttackerChild act.
const attackTargetsEnv = "KILN_TEST_ETCD_ATTACK_TARGETS"

// TestEmbeddedEtcdRefusesOtherUsers is the attack of issue 12, hole 1: a
// process running as nobody looks for the embedded etcd (its client
// endpoint, and every TCP port this process listens on, as a scan of
// loopback would find them) and tries to list every key and to write a
// forged record. Neither may succeed. As root but without going through
// the controller's private socket, no TCP port of this process may answer
// as etcd either.
func TestEmbeddedEtcdRefusesOtherUsers(t *testing.T) {
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root to run the attacker as nobody")
	}
	nobody, err := user.Lookup("nobody")
	if err != nil {
		testenv.Skipf(t, "no user nobody: %v", err)
	}
	uid, _ := strconv.Atoi(nobody.Uid)
	gid, _ := strconv.Atoi(nobody.Gid)

	e, c := startEtcd(t)
	ctx := testCtx(t)
	_, err = c.Put(ctx, "/kiln/v1/hosts/rack1-01", "secret-ish")
	require.NoError(t, err)

	targets := append([]string(nil), e.Endpoints()...)
	listeners := ownTCPListeners(t)
	for _, l := range listeners {
		targets = append(targets, "http://"+l)
	}
	t.Logf("targets: %v", targets)

	// The test binary lives in a 0700 build directory: copy it where
	// nobody can run it.
	dir, err := os.MkdirTemp("", "kiln-attacker-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))
	self, err := os.Executable()
	require.NoError(t, err)
	bin := filepath.Join(dir, "attacker")
	copyFile(t, self, bin)

	run := func(cred *syscall.Credential, targets []string) string {
		cmd := exec.CommandContext(ctx, bin, "-test.run=^TestEtcdAttackerChild$", "-test.v")
		cmd.Dir = dir
		cmd.Env = []string{attackTargetsEnv + "=" + strings.Join(targets, "\n"), "PATH=/usr/bin:/bin"}
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "attacker child: %s", out)
		return string(out)
	}
	check := func(who, out string) {
		t.Logf("attacker as %s:\n%s", who, out)
		for _, line := range strings.Split(out, "\n") {
			if strings.Contains(line, "READ ") || strings.Contains(line, "WROTE ") {
				t.Errorf("as %s: %s", who, strings.TrimSpace(line))
			}
		}
	}
	// The attacker works: as root, through the socket the controller
	// itself uses, it reads and writes.
	if out := run(nil, e.Endpoints()); !strings.Contains(out, "READ ") || !strings.Contains(out, "WROTE ") {
		t.Fatalf("attacker as root through the controller's own socket could not read and write; the attack proves nothing:\n%s", out)
	}
	_, err = c.Delete(ctx, "/kiln/v1/enrollment/forged")
	require.NoError(t, err)

	check("nobody", run(&syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}, targets))

	var tcp []string
	for _, l := range listeners {
		tcp = append(tcp, "http://"+l)
	}
	if len(tcp) > 0 {
		check("root over TCP", run(nil, tcp))
	}

	// The forged record must not be there.
	resp, err := c.Get(ctx, "/kiln/v1/enrollment/forged")
	require.NoError(t, err)
	if len(resp.Kvs) != 0 {
		t.Errorf("forged key /kiln/v1/enrollment/forged exists: the attacker wrote to etcd")
	}
}

// TestEtcdAttackerChild is the attacker run by
// TestEmbeddedEtcdRefusesOtherUsers; on its own it does nothing.
func TestEtcdAttackerChild(t *testing.T) {
	targets := os.Getenv(attackTargetsEnv)
	if targets == "" {
		// Deliberate, not an environment gap: it only runs as that test's child.
		t.Skip("only run as the attacker child of TestEmbeddedEtcdRefusesOtherUsers")
	}
	fmt.Printf("attacker uid=%d\n", os.Geteuid())
	for _, target := range strings.Split(targets, "\n") {
		attack(target)
	}
}

// attack prints what it could do against one endpoint: "READ " when it
// listed keys, "WROTE " when a write went through.
func attack(target string) {
	// 1. The probe an attacker scans with: GET /version.
	hc := &http.Client{Timeout: 2 * time.Second}
	base := target
	if path, ok := strings.CutPrefix(target, "unix://"); ok {
		hc.Transport = &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		}}
		base = "http://etcd"
	}
	if resp, err := hc.Get(base + "/version"); err != nil {
		fmt.Printf("%s: GET /version: refused: %v\n", target, err)
	} else {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 200))
		resp.Body.Close()
		fmt.Printf("%s: GET /version: %s %q\n", target, resp.Status, b)
	}
	// 2. The JSON gateway: list every key.
	if resp, err := hc.Post(base+"/v3/kv/range", "application/json", strings.NewReader(`{"key":"AA==","range_end":"AA=="}`)); err == nil {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 400))
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK && strings.Contains(string(b), `"kvs"`) {
			fmt.Printf("READ %s: /v3/kv/range listed keys: %s\n", target, b)
		} else {
			fmt.Printf("%s: /v3/kv/range: %s\n", target, resp.Status)
		}
	}
	// 3. A real etcd client: list and write.
	c, err := clientv3.New(clientv3.Config{Endpoints: []string{target}, DialTimeout: 2 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		fmt.Printf("%s: client: %v\n", target, err)
		return
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if resp, err := c.Get(ctx, "", clientv3.WithPrefix(), clientv3.WithKeysOnly()); err != nil {
		fmt.Printf("%s: etcd Get: refused: %v\n", target, err)
	} else {
		fmt.Printf("READ %s: etcd Get listed %d keys\n", target, len(resp.Kvs))
	}
	if _, err := c.Put(ctx, "/kiln/v1/enrollment/forged", "forged"); err != nil {
		fmt.Printf("%s: etcd Put: refused: %v\n", target, err)
	} else {
		fmt.Printf("WROTE %s: etcd Put of a forged record succeeded\n", target)
	}
}

// ownTCPListeners returns the addresses of the TCP sockets this process
// listens on, from /proc/net/tcp{,6} and the socket inodes in
// /proc/self/fd.
func ownTCPListeners(t *testing.T) []string {
	t.Helper()
	inodes := map[string]bool{}
	fds, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	for _, fd := range fds {
		link, err := os.Readlink(filepath.Join("/proc/self/fd", fd.Name()))
		if err == nil && strings.HasPrefix(link, "socket:[") {
			inodes[strings.TrimSuffix(strings.TrimPrefix(link, "socket:["), "]")] = true
		}
	}
	var addrs []string
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		fh, err := os.Open(f)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(fh)
		sc.Scan() // header
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			// sl local rem st tx:rx tr:when retrnsmt uid timeout inode
			if len(fields) < 10 || fields[3] != "0A" || !inodes[fields[9]] {
				continue
			}
			addrs = append(addrs, procAddr(t, fields[1]))
		}
		fh.Close()
	}
	return addrs
}

// procAddr turns /proc/net/tcp's "0100007F:1F90" into "127.0.0.1:8080".
func procAddr(t *testing.T, s string) string {
	hexIP, hexPort, _ := strings.Cut(s, ":")
	port, err := strconv.ParseUint(hexPort, 16, 16)
	require.NoError(t, err)
	raw := make([]byte, len(hexIP)/2)
	for i := range raw {
		b, err := strconv.ParseUint(hexIP[2*i:2*i+2], 16, 8)
		require.NoError(t, err)
		raw[i] = byte(b)
	}
	// The kernel prints each 32-bit word in host (little-endian) order.
	for i := 0; i+4 <= len(raw); i += 4 {
		raw[i], raw[i+1], raw[i+2], raw[i+3] = raw[i+3], raw[i+2], raw[i+1], raw[i]
	}
	ip := net.IP(raw)
	if ip.IsUnspecified() {
		if len(raw) == 4 {
			ip = net.IPv4(127, 0, 0, 1)
		} else {
			ip = net.IPv6loopback
		}
	}
	return net.JoinHostPort(ip.String(), strconv.Itoa(int(port)))
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	src, err := os.Open(from)
	require.NoError(t, err)
	defer src.Close()
	dst, err := os.OpenFile(to, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	require.NoError(t, err)
	_, err = io.Copy(dst, src)
	require.NoError(t, err)
	require.NoError(t, dst.Close())
}

// TestEmbeddedLongDataDir starts a member in a data directory whose path
// is too long for a unix socket: its client socket goes to a private
// directory instead, removed when the member stops.
func TestEmbeddedLongDataDir(t *testing.T) {
	ctx := testCtx(t)
	dir := filepath.Join(t.TempDir(), strings.Repeat("d", 100), "etcd")
	e, err := StartEmbedded(ctx, EmbeddedConfig{DataDir: dir, Logger: testLogger(t)})
	require.NoError(t, err)
	sock := strings.TrimPrefix(e.Endpoints()[0], "unix://")
	if len(sock) > maxSocketPath || strings.HasPrefix(sock, dir) {
		t.Fatalf("Endpoints() = %v, want a short socket path outside %s", e.Endpoints(), dir)
	}
	st, err := os.Stat(filepath.Dir(sock))
	require.NoError(t, err)
	if st.Mode().Perm() != 0o700 {
		t.Errorf("socket directory mode = %v, want 0700", st.Mode().Perm())
	}
	c, err := Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	_, err = c.Put(ctx, "k", "v")
	require.NoError(t, err)
	c.Close()
	e.Close()
	if _, err := os.Stat(filepath.Dir(sock)); !os.IsNotExist(err) {
		t.Errorf("socket directory %s still there after Close (err %v)", filepath.Dir(sock), err)
	}
}
