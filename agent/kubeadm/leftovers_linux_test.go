package kubeadm

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kilnhq/kiln/host/ports"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// listenerEnv makes the test binary, run as a child, a process that
// listens on a loopback port, prints it, and waits to be stopped; with
// the value "ignore-term" it ignores SIGTERM (as a component stuck in
// shutdown does), with "undumpable" it makes itself non-dumpable, so that
// only CAP_SYS_PTRACE reads its /proc/PID/fd (as the agent, whose unit
// drops it, cannot read the fds of the kubelet or a container).
const listenerEnv = "KILN_TEST_LEFTOVER_LISTENER"

func TestHelperLeftoverListener(t *testing.T) {
	mode := os.Getenv(listenerEnv)
	if mode == "" {
		t.Skip("helper process: runs only as a child of TestResetStopsLeftovers")
	}
	switch mode {
	case "ignore-term":
		signal.Ignore(syscall.SIGTERM)
	case "undumpable":
		if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
			fmt.Println("prctl:", err)
			os.Exit(1)
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Println("listen:", err)
		os.Exit(1)
	}
	fmt.Println(l.Addr().(*net.TCPAddr).Port)
	select {}
}

// leftover is a child process listening on a port, named comm.
type leftover struct {
	cmd  *exec.Cmd
	port int
	done chan struct{} // closed once it has exited (and been reaped)
}

// startLeftover runs the test binary under the name comm (a symbolic
// link: the kernel names a process after the file it executes) as a
// listener, and returns once it listens.
func startLeftover(t *testing.T, comm, mode string) *leftover {
	t.Helper()
	self, err := os.Executable()
	require.NoError(t, err)
	bin := filepath.Join(t.TempDir(), comm)
	require.NoError(t, os.Symlink(self, bin))
	cmd := exec.Command(bin, "-test.run=^TestHelperLeftoverListener$")
	if mode == "" {
		mode = "listen"
	}
	cmd.Env = append(os.Environ(), listenerEnv+"="+mode)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	l := &leftover{cmd: cmd, done: make(chan struct{})}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-l.done
	})
	sc := bufio.NewScanner(out)
	require.True(t, sc.Scan(), "the listener printed no port")
	l.port, err = strconv.Atoi(strings.TrimSpace(sc.Text()))
	require.NoError(t, err, "listener printed %q", sc.Text())
	go func() {
		_ = cmd.Wait()
		close(l.done)
	}()
	return l
}

func (l *leftover) exited() bool {
	select {
	case <-l.done:
		return true
	default:
		return false
	}
}

// TestResetStopsLeftovers: a Kubernetes component still listening on a
// control plane port after `kubeadm reset` (as the controller manager and
// scheduler did under TCG, so every retried init was refused with "ports
// in use: 10257, 10259") is stopped, with SIGKILL when it ignores SIGTERM,
// and the port is free afterwards; a process that is not a component is
// left running and the reset's progress names the port, the process and
// its PID (the undo of a failed init fails on it: TestInitFailureFreesPorts).
func TestResetStopsLeftovers(t *testing.T) {
	for _, tc := range []struct {
		name, comm string
		// mode of the listener (listenerEnv)
		mode     string
		wantStop bool
	}{
		{name: "component exits on SIGTERM", comm: "kube-scheduler", wantStop: true},
		// The kernel keeps 15 bytes: "kube-controller".
		{name: "component ignores SIGTERM", comm: "kube-controller-manager", mode: "ignore-term", wantStop: true},
		// Its fds cannot be read: found by its name among the processes
		// of this network namespace.
		{name: "component whose fds the agent cannot read", comm: "kube-scheduler", mode: "undumpable", wantStop: true},
		{name: "not a component", comm: "haproxy"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newFakeHost(t, "v1.34.4", "v1.34.4")
			l := startLeftover(t, tc.comm, tc.mode)
			// The port belongs to the component the test names (as 10259
			// to kube-scheduler).
			owner := tc.comm
			if !tc.wantStop {
				owner = "kube-apiserver"
			}
			k := New(Options{Root: h.root, Kubeadm: h.kubeadm, Kubelet: h.kubelet, Ports: map[int]string{l.port: owner}, StopGrace: time.Second})
			var evs events
			start := time.Now()
			var err error
			if tc.mode == "undumpable" {
				err = withoutPtrace(t, l.cmd.Process.Pid, func() error {
					return k.Reset(context.Background(), &agentv1.KubeadmResetRequest{}, evs.emit)
				})
			} else {
				err = k.Reset(context.Background(), &agentv1.KubeadmResetRequest{}, evs.emit)
			}
			t.Logf("Reset() took %s: %v\n%s", time.Since(start).Round(time.Millisecond), err, evs.text())
			comm := tc.comm[:min(15, len(tc.comm))]
			if tc.wantStop {
				require.NoError(t, err, "Reset() with %s left on port %d", tc.comm, l.port)
				// Dead, as Reset saw; reaped by the test's goroutine soon.
				require.Eventually(t, l.exited, 5*time.Second, 10*time.Millisecond, "Reset() returned nil but %s (pid %d) still runs", comm, l.cmd.Process.Pid)
				busy, err := ports.Busy([]int{l.port})
				require.NoError(t, err)
				if len(busy) != 0 {
					t.Errorf("after Reset(), ports.Busy(%d) = %v, want none", l.port, busy)
				}
				want := fmt.Sprintf("port %d still in use after kubeadm reset by %s (pid %d): stopping it", l.port, comm, l.cmd.Process.Pid)
				if tc.mode == "undumpable" {
					want = fmt.Sprintf("port %d still in use after kubeadm reset, and %s (pid %d) still runs in this host's network: stopping it", l.port, comm, l.cmd.Process.Pid)
				}
				if !strings.Contains(evs.text(), want) {
					t.Errorf("Reset() progress lacks %q:\n%s", want, evs.text())
				}
				if tc.mode == "ignore-term" && !strings.Contains(evs.text(), "SIGKILL") {
					t.Errorf("Reset() progress does not say it sent SIGKILL to a process ignoring SIGTERM:\n%s", evs.text())
				}
				return
			}
			// Not the reset's to stop, nor to fail on (a wipe may
			// follow): named in its progress.
			require.NoError(t, err, "Reset() with %s on port %d", comm, l.port)
			want := fmt.Sprintf("%d held by %s (pid %d), not a Kubernetes component: left running", l.port, comm, l.cmd.Process.Pid)
			if !strings.Contains(evs.text(), want) {
				t.Errorf("Reset() progress lacks %q:\n%s", want, evs.text())
			}
			if l.exited() {
				t.Errorf("Reset() stopped %s, which is not a Kubernetes component", comm)
			}
		})
	}
}

// TestInitFailureFreesPorts: after a failed init the reset that undoes it
// also stops the component left listening, so that the retry is not
// refused by kubeadm's preflight; the init's error stays kubeadm's.
func TestInitFailureFreesPorts(t *testing.T) {
	h := newFakeHost(t, "v1.34.4", "v1.34.4")
	require.NoError(t, os.WriteFile(filepath.Join(h.root, "fail-init"), nil, 0o644))
	l := startLeftover(t, "kube-apiserver", "")
	other := startLeftover(t, "sshd", "")
	k := New(Options{Root: h.root, Kubeadm: h.kubeadm, Kubelet: h.kubelet, Ports: map[int]string{l.port: "kube-apiserver", other.port: "etcd"}, StopGrace: time.Second})
	var evs events
	_, err := k.Init(context.Background(), &agentv1.KubeadmInitRequest{Cluster: labCluster()}, evs.emit)
	require.Error(t, err)
	t.Logf("Init() = %v", err)
	if strings.Contains(err.Error(), "kube-apiserver (pid") {
		t.Errorf("Init() = %v, names the kube-apiserver the reset stopped", err)
	}
	for _, want := range []string{
		"the API server did not become healthy",
		fmt.Sprintf("%d held by sshd (pid %d), not a Kubernetes component", other.port, other.cmd.Process.Pid),
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Init() = %v, want it to contain %q", err, want)
		}
	}
	if strings.Contains(err.Error(), fmt.Sprintf("%d held by", l.port)) {
		t.Errorf("Init() = %v, names port %d, which the reset freed", err, l.port)
	}
	require.Eventually(t, l.exited, 5*time.Second, 50*time.Millisecond, "kube-apiserver left running after the failed init's reset")
}

// withoutPtrace runs f on a thread of its own that cannot read the
// /proc/PID/fd of pid, as the agent cannot read the kubelet's or a
// container's: pid made itself non-dumpable, and when the test runs as
// root the thread drops CAP_SYS_PTRACE from its effective capabilities
// (the agent's unit drops it from its bounding set). The thread ends
// with f. It fails t when the fds are still readable.
func withoutPtrace(t *testing.T, pid int, f func() error) error {
	t.Helper()
	type result struct{ err, setup error }
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		if os.Geteuid() == 0 {
			hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
			var data [2]unix.CapUserData
			if err := unix.Capget(&hdr, &data[0]); err != nil {
				done <- result{setup: fmt.Errorf("capget: %w", err)}
				return
			}
			data[unix.CAP_SYS_PTRACE/32].Effective &^= 1 << (unix.CAP_SYS_PTRACE % 32)
			if err := unix.Capset(&hdr, &data[0]); err != nil {
				done <- result{setup: fmt.Errorf("capset: %w", err)}
				return
			}
		}
		// Listing /proc/PID/fd needs only the directory's mode; reading
		// a link needs ptrace access.
		if link, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/0", pid)); err == nil {
			done <- result{setup: fmt.Errorf("/proc/%d/fd/0 reads %q without CAP_SYS_PTRACE: the test would not show the search by name", pid, link)}
			return
		}
		done <- result{err: f()}
	}()
	r := <-done
	require.NoError(t, r.setup)
	return r.err
}

// A component that exits during the wait between SIGTERM and SIGKILL and
// whose PID is then another process's must not get the SIGKILL: the root
// agent would kill a process it never vetted. The reuse is simulated in a
// copy of proc/PID/stat whose start time changes after SIGTERM; the real
// process behind the PID ignores SIGTERM, so a SIGKILL would end it.
func TestStopSparesReusedPID(t *testing.T) {
	l := startLeftover(t, "kube-scheduler", "ignore-term")
	pid := l.cmd.Process.Pid
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	require.NoError(t, err)
	proc := t.TempDir()
	dir := filepath.Join(proc, strconv.Itoa(pid))
	require.NoError(t, os.MkdirAll(dir, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "stat"), stat, 0o644))
	st, ok := startTime(proc, pid)
	require.True(t, ok, "start time of %q", stat)
	real, ok := startTime("/proc", pid)
	require.True(t, ok)
	require.Equal(t, real, st)

	// After SIGTERM, the PID "is" a process started a tick later.
	i := bytes.LastIndexByte(stat, ')')
	f := strings.Fields(string(stat[i+1:]))
	f[19] = strconv.FormatUint(st+1, 10)
	reused := append(append([]byte{}, stat[:i+1]...), []byte(" "+strings.Join(f, " ")+"\n")...)
	go func() {
		time.Sleep(300 * time.Millisecond)
		_ = os.WriteFile(filepath.Join(dir, "stat"), reused, 0o644)
	}()

	var evs []string
	err = stopProcesses(context.Background(), proc, []int{pid}, time.Second, func(e *agentv1.OperationEvent) { evs = append(evs, e.GetMessage()) })
	require.NoError(t, err)
	for _, e := range evs {
		require.NotContains(t, e, "SIGKILL", "a SIGKILL for a reused PID")
	}
	time.Sleep(200 * time.Millisecond)
	require.False(t, l.exited(), "the process behind the reused PID was killed")
}

// runningSince tells a running process from a reused PID and from a
// zombie: a zombie leader still runs while another of its threads does
// (its sockets stay open until then), and is gone once it is alone.
func TestRunningSince(t *testing.T) {
	proc := t.TempDir()
	write := func(pid int, state string, start uint64, tasks int) {
		dir := filepath.Join(proc, strconv.Itoa(pid))
		require.NoError(t, os.MkdirAll(filepath.Join(dir, "task"), 0o755))
		f := make([]string, 50)
		for i := range f {
			f[i] = "0"
		}
		f[0] = state
		f[19] = strconv.FormatUint(start, 10)
		stat := fmt.Sprintf("%d (kube apiserver)) %s\n", pid, strings.Join(f, " "))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "stat"), []byte(stat), 0o644))
		for i := range tasks {
			require.NoError(t, os.MkdirAll(filepath.Join(dir, "task", strconv.Itoa(pid+i)), 0o755))
		}
	}
	write(100, "S", 500, 1)
	write(200, "Z", 500, 3)
	write(300, "Z", 500, 1)
	for _, tt := range []struct {
		pid   int
		start uint64
		want  bool
		what  string
	}{
		{100, 500, true, "sleeping, same start time"},
		{100, 501, false, "PID reused by a later process"},
		{200, 500, true, "zombie leader with threads still exiting"},
		{300, 500, false, "zombie alone"},
		{400, 500, false, "no such process"},
	} {
		if got := runningSince(proc, tt.pid, tt.start); got != tt.want {
			t.Errorf("%s: runningSince(%d, %d) = %v, want %v", tt.what, tt.pid, tt.start, got, tt.want)
		}
	}
}
