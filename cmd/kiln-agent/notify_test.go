package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/agent/identity"
	"github.com/kilnhq/kiln/agent/logring"
	"github.com/kilnhq/kiln/controller/controllertest"
)

// TestRunNotifiesSystemd runs an enrolled agent as kiln-agent.service
// (Type=notify, WatchdogSec=) would: with NOTIFY_SOCKET and WATCHDOG_USEC
// set, it must say READY=1 once it serves and then pet the watchdog at
// half the interval; systemd would kill an agent that stays silent.
func TestRunNotifiesSystemd(t *testing.T) {
	env := controllertest.Start(t)
	dataDir := filepath.Join(t.TempDir(), "kiln-agent")
	tok := env.Token(t, "", time.Hour)
	out, err := kilnAgent(t, "enroll", "--controller", env.Addr, "--token", tok, "--ca-hash", env.CAHash, "--host", "node-sd", "--data-dir", dataDir)
	require.NoError(t, err, out)
	id, err := identity.Load(dataDir)
	require.NoError(t, err)

	sock := filepath.Join(t.TempDir(), "notify")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	require.NoError(t, err)
	defer conn.Close()
	t.Setenv("NOTIFY_SOCKET", sock)
	const watchdog = 400 * time.Millisecond
	t.Setenv("WATCHDOG_USEC", fmt.Sprint(watchdog.Microseconds()))
	t.Setenv("WATCHDOG_PID", fmt.Sprint(os.Getpid()))

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	g := &globals{dataDir: dataDir, root: "/", logLevel: "info"}
	log := slog.New(slog.NewTextHandler(testWriter{t}, nil))
	go func() {
		done <- run(ctx, g, id, runOptions{listen: "127.0.0.1:0", heartbeatInterval: time.Second}, logring.New(10), log)
	}()
	defer func() {
		cancel()
		require.NoError(t, <-done)
	}()

	recv := func() (string, time.Time) {
		buf := make([]byte, 256)
		require.NoError(t, conn.SetReadDeadline(time.Now().Add(10*time.Second)))
		n, err := conn.Read(buf)
		require.NoError(t, err, "waiting for the agent's sd_notify message")
		return string(buf[:n]), time.Now()
	}
	if got, _ := recv(); got != "READY=1" {
		t.Fatalf("first sd_notify message = %q, want READY=1", got)
	}
	var last time.Time
	for i := range 3 {
		got, at := recv()
		if got != "WATCHDOG=1" {
			t.Fatalf("sd_notify message %d after READY = %q, want WATCHDOG=1", i+1, got)
		}
		if !last.IsZero() && at.Sub(last) > watchdog {
			t.Errorf("watchdog pings %v apart, want at most WatchdogSec %v", at.Sub(last), watchdog)
		}
		last = at
	}
}
