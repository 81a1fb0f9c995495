package systemd

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

func TestDialNoBus(t *testing.T) {
	root := t.TempDir()
	_, err := Dial(context.Background(), root)
	if !errdefs.IsNotSupported(err) || !strings.Contains(err.Error(), "no systemd D-Bus at "+filepath.Join(root, BusSocket)) {
		t.Errorf("Dial(%q) error = %v, want NotSupported naming the socket", root, err)
	}
}

// TestDialBusWithoutSystemd runs a real dbus-daemon with no systemd on the
// bus (what a container or lab host without systemd looks like when dbus
// is installed): Dial must say NotSupported, not hang or succeed.
func TestDialBusWithoutSystemd(t *testing.T) {
	daemon, err := exec.LookPath("dbus-daemon")
	if err != nil {
		testenv.Skip(t, "dbus-daemon not installed (Debian package dbus)")
	}
	root := t.TempDir()
	sock := filepath.Join(root, BusSocket)
	require.NoError(t, os.MkdirAll(filepath.Dir(sock), 0o755))
	conf := filepath.Join(root, "bus.conf")
	require.NoError(t, os.WriteFile(conf, []byte(fmt.Sprintf(`<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path=%s</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
    <allow user="*"/>
  </policy>
</busconfig>
`, sock)), 0o644))
	cmd := exec.Command(daemon, "--config-file="+conf, "--nofork", "--nopidfile")
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	for i := 0; i < 200; i++ { // wait for the socket, not a timing assertion
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err = Dial(ctx, root)
	if !errdefs.IsNotSupported(err) || !strings.Contains(err.Error(), "no systemd D-Bus at") {
		t.Errorf("Dial(bus without systemd) error = %v, want NotSupported", err)
	}
}

// TestNotify receives the notifications on a real datagram socket, as
// systemd would.
func TestNotify(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "notify")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	require.NoError(t, err)
	defer conn.Close()
	t.Setenv("NOTIFY_SOCKET", sock)

	recv := func() string {
		buf := make([]byte, 256)
		require.NoError(t, conn.SetReadDeadline(time.Now().Add(10*time.Second)))
		n, err := conn.Read(buf)
		require.NoError(t, err)
		return string(buf[:n])
	}
	sent, err := NotifyReady()
	require.NoError(t, err)
	require.True(t, sent, "NotifyReady() sent")
	if got := recv(); got != "READY=1" {
		t.Errorf("NotifyReady() sent %q, want %q", got, "READY=1")
	}
	sent, err = NotifyWatchdog()
	require.NoError(t, err)
	require.True(t, sent, "NotifyWatchdog() sent")
	if got := recv(); got != "WATCHDOG=1" {
		t.Errorf("NotifyWatchdog() sent %q, want %q", got, "WATCHDOG=1")
	}

	t.Setenv("WATCHDOG_USEC", "4000000")
	t.Setenv("WATCHDOG_PID", fmt.Sprint(os.Getpid()))
	d, err := WatchdogInterval()
	require.NoError(t, err)
	if d != 2*time.Second {
		t.Errorf("WatchdogInterval() with WATCHDOG_USEC=4000000 = %v, want 2s", d)
	}
}

func TestNotifyWithoutSystemd(t *testing.T) {
	t.Setenv("NOTIFY_SOCKET", "")
	sent, err := NotifyReady()
	if sent || err != nil {
		t.Errorf("NotifyReady() without NOTIFY_SOCKET = %v, %v, want false, nil", sent, err)
	}
	t.Setenv("WATCHDOG_USEC", "")
	d, err := WatchdogInterval()
	if d != 0 || err != nil {
		t.Errorf("WatchdogInterval() without WATCHDOG_USEC = %v, %v, want 0, nil", d, err)
	}
	if err := RunWatchdog(context.Background()); err != nil {
		t.Errorf("RunWatchdog() with watchdog off = %v, want nil at once", err)
	}
}
