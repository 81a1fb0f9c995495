// Package systemd manages units through systemd's D-Bus API (go-systemd)
// and speaks sd_notify for the agent's own unit.
//
// Hosts without systemd as PID 1 (containers, the built-in lab's
// namespace hosts) have no system bus: Dial returns a NotSupported error
// there, which callers may treat as "nothing to manage".
package systemd

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
)

// BusSocket is the system bus socket, relative to the root.
const BusSocket = "run/dbus/system_bus_socket"

// socketPath is the system bus socket under root.
func socketPath(root string) string { return filepath.Join(root, BusSocket) }

// UnitState is a unit's load, activation and enablement state.
type UnitState struct {
	// Load is "loaded", "not-found", ...
	Load string
	// Active is "active", "inactive", "failed", ...
	Active string
	// Sub is the unit type's own state, e.g. "running".
	Sub string
	// UnitFile is "enabled", "disabled", "static", ...
	UnitFile string
}

// Notify states understood by NotifyReady and NotifyWatchdog.
const (
	stateReady    = daemon.SdNotifyReady
	stateWatchdog = daemon.SdNotifyWatchdog
)

// NotifyReady tells systemd that the service finished starting
// (Type=notify). It reports false when the service does not run under
// systemd with NOTIFY_SOCKET set.
//
// Equivalent to: `systemd-notify --ready`.
func NotifyReady() (sent bool, err error) {
	sent, err = daemon.SdNotify(false, stateReady)
	if err != nil {
		return false, fmt.Errorf("sd_notify READY: %w", err)
	}
	return sent, nil
}

// NotifyWatchdog pets the service watchdog (WatchdogSec=). It reports
// false when no NOTIFY_SOCKET is set.
//
// Equivalent to: `systemd-notify WATCHDOG=1`.
func NotifyWatchdog() (sent bool, err error) {
	sent, err = daemon.SdNotify(false, stateWatchdog)
	if err != nil {
		return false, fmt.Errorf("sd_notify WATCHDOG: %w", err)
	}
	return sent, nil
}

// WatchdogInterval returns how often to call NotifyWatchdog (half of
// WatchdogSec), or 0 when the watchdog is off for this process.
func WatchdogInterval() (time.Duration, error) {
	d, err := daemon.SdWatchdogEnabled(false)
	if err != nil {
		return 0, fmt.Errorf("sd_watchdog_enabled: %w", err)
	}
	return d / 2, nil
}

// RunWatchdog pets the watchdog every WatchdogInterval until ctx is done.
// It returns at once when the watchdog is off. It blocks.
func RunWatchdog(ctx context.Context) error {
	every, err := WatchdogInterval()
	if err != nil || every == 0 {
		return err
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			if _, err := NotifyWatchdog(); err != nil {
				return err
			}
		}
	}
}
