//go:build linux

package systemd_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/host/systemd"
	"github.com/kilnhq/kiln/host/systemd/systemdtest"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// TestManagerRealSystemd enables, starts and restarts a unit in a real
// systemd booted under systemd-nspawn, through its D-Bus socket as seen
// from outside (the lab's view of a node, and the agent's own view with
// root "/").
func TestManagerRealSystemd(t *testing.T) {
	root := systemdtest.Boot(t, map[string]string{
		"kiln-test.service": "[Unit]\nDescription=Kiln test\n[Service]\nExecStart=/bin/sleep infinity\n[Install]\nWantedBy=multi-user.target\n",
	}).Root
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	m, err := systemd.Dial(ctx, root)
	require.NoError(t, err)
	defer m.Close()

	st, err := m.State(ctx, "kiln-test.service")
	require.NoError(t, err)
	if st.Load != "loaded" || st.UnitFile != "disabled" || st.Active != "inactive" {
		t.Fatalf("State(kiln-test.service) = %+v, want loaded, disabled, inactive", st)
	}

	changed, err := m.Enable(ctx, "kiln-test.service")
	require.NoError(t, err)
	if !changed {
		t.Errorf("Enable(kiln-test.service) changed = false, want true")
	}
	if st, _ = m.State(ctx, "kiln-test.service"); st.UnitFile != "enabled" {
		t.Errorf("State() after Enable = %+v, want enabled", st)
	}
	changed, err = m.Enable(ctx, "kiln-test.service")
	require.NoError(t, err)
	if changed {
		t.Errorf("Enable(kiln-test.service) again changed = true, want false")
	}

	require.NoError(t, m.Start(ctx, "kiln-test.service"))
	if st, _ = m.State(ctx, "kiln-test.service"); st.Active != "active" || st.Sub != "running" {
		t.Errorf("State() after Start = %+v, want active running", st)
	}
	require.NoError(t, m.Restart(ctx, "kiln-test.service"))
	if st, _ = m.State(ctx, "kiln-test.service"); st.Active != "active" {
		t.Errorf("State() after Restart = %+v, want active", st)
	}

	if _, err := m.Enable(ctx, "kiln-missing.service"); !errdefs.IsNotFound(err) {
		t.Errorf("Enable(kiln-missing.service) error = %v, want NotFound", err)
	}
	if err := m.Start(ctx, "kiln-missing.service"); err == nil {
		t.Errorf("Start(kiln-missing.service) error = nil, want an error")
	}
}
