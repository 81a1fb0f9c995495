package machine_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/internal/errdefs"
)

func alive(pid int) bool { return pid > 0 && syscall.Kill(pid, 0) == nil }

func TestProcessPowerCycle(t *testing.T) {
	dir := t.TempDir()
	envFile := filepath.Join(dir, "env")
	// The "host" writes its boot environment, then runs until killed.
	p, err := machine.NewProcess(machine.ProcessOptions{
		Command:     []string{"sh", "-c", `env | grep ^KILN_BOOT_ | sort > "$0"; exec sleep 3600`, envFile},
		GracePeriod: 2 * time.Second,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	ctx := context.Background()

	if p.State() || p.PID() != 0 {
		t.Fatalf("new machine: State() = %v PID() = %d, want off", p.State(), p.PID())
	}
	require.NoError(t, p.InsertMedia("http://127.0.0.1:9/agent.iso"))
	require.NoError(t, p.PowerOn(ctx, machine.BootCD))
	pid := p.PID()
	if !alive(pid) {
		t.Fatalf("after PowerOn pid %d is not running", pid)
	}
	require.Eventually(t, func() bool { b, _ := os.ReadFile(envFile); return len(b) > 0 }, 10*time.Second, 20*time.Millisecond)
	env, _ := os.ReadFile(envFile)
	want := "KILN_BOOT_DEVICE=cd\nKILN_BOOT_MEDIA=http://127.0.0.1:9/agent.iso\nKILN_BOOT_SOURCE=virtualmedia\n"
	if string(env) != want {
		t.Fatalf("boot environment = %q, want %q", env, want)
	}

	// Power on again is a no-op.
	require.NoError(t, p.PowerOn(ctx, machine.BootPXE))
	if p.PID() != pid || p.BootSource() != machine.BootCD {
		t.Fatalf("second PowerOn restarted the machine (pid %d -> %d)", pid, p.PID())
	}

	require.NoError(t, p.Reset(ctx))
	if alive(pid) || !alive(p.PID()) || p.PID() == pid {
		t.Fatalf("Reset: old pid %d alive=%v new pid %d", pid, alive(pid), p.PID())
	}

	pid = p.PID()
	require.NoError(t, p.PowerOff(ctx, true))
	if alive(pid) || p.State() {
		t.Fatalf("after graceful PowerOff pid %d alive=%v State()=%v", pid, alive(pid), p.State())
	}
	if err := p.Reset(ctx); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("Reset() of an off machine = %v, want FailedPrecondition", err)
	}
	if p.Runs() != 2 {
		t.Fatalf("Runs() = %d, want 2", p.Runs())
	}
}

func TestProcessHardOffKillsTheGroup(t *testing.T) {
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "child")
	// A shell that ignores TERM and has a child: hard off must kill both.
	p, err := machine.NewProcess(machine.ProcessOptions{
		Command: []string{"sh", "-c", `trap "" TERM; sleep 3600 & echo $! > "$0"; wait`, pidFile},
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	require.NoError(t, p.PowerOn(context.Background(), machine.BootDisk))
	require.Eventually(t, func() bool { b, _ := os.ReadFile(pidFile); return len(b) > 0 }, 10*time.Second, 20*time.Millisecond)
	b, _ := os.ReadFile(pidFile)
	var child int
	for _, c := range strings.TrimSpace(string(b)) {
		child = child*10 + int(c-'0')
	}
	require.True(t, alive(child))
	require.NoError(t, p.PowerOff(context.Background(), false))
	require.Eventually(t, func() bool { return !alive(child) }, 5*time.Second, 20*time.Millisecond,
		"child %d of the machine survived a hard power off", child)
}

func TestProcessExitMeansOff(t *testing.T) {
	p, err := machine.NewProcess(machine.ProcessOptions{Command: []string{"true"}})
	require.NoError(t, err)
	require.NoError(t, p.PowerOn(context.Background(), machine.BootPXE))
	require.Eventually(t, func() bool { return !p.State() }, 5*time.Second, 10*time.Millisecond)
}

func TestMemoryRecordsAndFails(t *testing.T) {
	m := &machine.Memory{}
	ctx := context.Background()
	boom := errors.New("psu fault")
	m.FailNext("on", boom)
	if err := m.PowerOn(ctx, machine.BootPXE); !errors.Is(err, boom) {
		t.Fatalf("PowerOn() with an injected fault = %v, want %v", err, boom)
	}
	if m.State() {
		t.Fatalf("machine on after a failed PowerOn")
	}
	require.NoError(t, m.PowerOn(ctx, machine.BootPXE))
	require.NoError(t, m.PowerOff(ctx, true))
	if err := m.PowerOn(ctx, "floppy"); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("PowerOn(floppy) = %v, want InvalidArgument", err)
	}
	var got []string
	for _, e := range m.Events() {
		got = append(got, e.String())
	}
	if strings.Join(got, " ") != "on:pxe on:pxe soft-off" {
		t.Fatalf("Events() = %v, want [on:pxe on:pxe soft-off]", got)
	}
}
