//go:build linux

package systemd

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"

	sd "github.com/coreos/go-systemd/v22/dbus"
	godbus "github.com/godbus/dbus/v5"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Manager talks to systemd (PID 1) over the system bus.
type Manager struct {
	conn *sd.Conn
}

// Dial connects to systemd through ROOT/run/dbus/system_bus_socket.
//
// It returns a NotSupported error ("no systemd D-Bus at ...") when the
// socket does not exist or nobody answers on it, which is the case on
// hosts where PID 1 is not systemd.
func Dial(ctx context.Context, root string) (*Manager, error) {
	sock := socketPath(root)
	if _, err := os.Stat(sock); errors.Is(err, fs.ErrNotExist) {
		return nil, errdefs.NotSupported("no systemd D-Bus at %s", sock)
	}
	conn, err := sd.NewConnection(func() (*godbus.Conn, error) {
		c, err := godbus.Dial("unix:path="+sock, godbus.WithContext(ctx))
		if err != nil {
			return nil, err
		}
		if err := c.Auth([]godbus.Auth{godbus.AuthExternal(strconv.Itoa(os.Getuid()))}); err != nil {
			c.Close()
			return nil, err
		}
		if err := c.Hello(); err != nil {
			c.Close()
			return nil, err
		}
		return c, nil
	})
	if err != nil {
		return nil, errdefs.NotSupported("no systemd D-Bus at %s: %v", sock, err)
	}
	// A bus without systemd on it (a lone dbus-daemon) is no systemd either.
	if _, err := conn.GetManagerProperty("Version"); err != nil {
		conn.Close()
		return nil, errdefs.NotSupported("no systemd D-Bus at %s: %v", sock, err)
	}
	return &Manager{conn: conn}, nil
}

// Close closes the bus connection.
func (m *Manager) Close() error {
	m.conn.Close()
	return nil
}

// State returns a unit's load, active, sub and unit-file states.
//
// Equivalent to: `systemctl show -p LoadState,ActiveState,SubState,UnitFileState kubelet.service`.
func (m *Manager) State(ctx context.Context, unit string) (UnitState, error) {
	props, err := m.conn.GetUnitPropertiesContext(ctx, unit)
	if err != nil {
		return UnitState{}, fmt.Errorf("unit %s: %w", unit, err)
	}
	s := func(k string) string { v, _ := props[k].(string); return v }
	return UnitState{Load: s("LoadState"), Active: s("ActiveState"), Sub: s("SubState"), UnitFile: s("UnitFileState")}, nil
}

// Enable enables a unit and reloads systemd when that changed anything;
// it reports whether it did.
//
// Equivalent to: `systemctl enable kubelet.service`.
//
// It returns a NotFound error when systemd has no such unit.
func (m *Manager) Enable(ctx context.Context, unit string) (changed bool, err error) {
	st, err := m.State(ctx, unit)
	if err != nil {
		return false, err
	}
	if st.Load == "not-found" {
		return false, errdefs.NotFound("unit %s not found", unit)
	}
	if st.UnitFile == "enabled" || st.UnitFile == "static" || st.UnitFile == "enabled-runtime" {
		return false, nil
	}
	_, changes, err := m.conn.EnableUnitFilesContext(ctx, []string{unit}, false, true)
	if err != nil {
		return false, fmt.Errorf("enable %s: %w", unit, err)
	}
	if len(changes) == 0 {
		return false, nil
	}
	if err := m.conn.ReloadContext(ctx); err != nil {
		return true, fmt.Errorf("enable %s: daemon-reload: %w", unit, err)
	}
	return true, nil
}

// Start starts a unit and waits for the job to finish.
//
// Equivalent to: `systemctl start kubelet.service`.
func (m *Manager) Start(ctx context.Context, unit string) error {
	return m.job(ctx, "start", unit, m.conn.StartUnitContext)
}

// Restart restarts a unit (starts it when stopped) and waits for the job.
//
// Equivalent to: `systemctl restart containerd.service`.
func (m *Manager) Restart(ctx context.Context, unit string) error {
	return m.job(ctx, "restart", unit, m.conn.RestartUnitContext)
}

func (m *Manager) job(ctx context.Context, verb, unit string, f func(context.Context, string, string, chan<- string) (int, error)) error {
	done := make(chan string, 1)
	if _, err := f(ctx, unit, "replace", done); err != nil {
		return fmt.Errorf("%s %s: %w", verb, unit, err)
	}
	select {
	case <-ctx.Done():
		return fmt.Errorf("%s %s: %w", verb, unit, ctx.Err())
	case result := <-done:
		if result != "done" {
			return errdefs.FailedPrecondition("%s %s: job %s", verb, unit, result)
		}
		return nil
	}
}
