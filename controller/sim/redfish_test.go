package sim_test

import (
	"context"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/bmc"
	"github.com/kilnhq/kiln/controller/provision"
	"github.com/kilnhq/kiln/controller/resources"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/e2e/lab/redfish"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/seal"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// labMachine lets the lab's Redfish emulator drive a simulated host.
type labMachine struct{ h *sim.Host }

var _ machine.Machine = labMachine{}

func simDevice(dev string) string {
	if dev == machine.BootCD {
		return "cdrom"
	}
	return dev
}

func (m labMachine) PowerOn(_ context.Context, dev string) error {
	m.h.PowerOnFrom(simDevice(dev))
	return nil
}
func (m labMachine) PowerOff(context.Context, bool) error { m.h.PowerCut(); return nil }
func (m labMachine) Reset(context.Context) error {
	if !m.h.Powered() {
		return errdefs.FailedPrecondition("machine is off")
	}
	m.h.ResetFrom(m.h.LastDevice())
	return nil
}
func (m labMachine) State() bool                  { return m.h.Powered() }
func (m labMachine) InsertMedia(url string) error { m.h.SetMedia(url); return nil }
func (m labMachine) BootSource() string {
	if d := m.h.LastDevice(); d != "cdrom" {
		return d
	}
	return machine.BootCD
}

// TestRealBMCPathAgainstRedfishEmulator runs the executor with the
// production BMC path — provision.ManagerDialer, bmc.Manager, bmclib's
// Redfish provider, the password read from the host's sealed secret —
// against the lab's Redfish emulator, whose systems are simulated hosts
// with simulated agents.
func TestRealBMCPathAgainstRedfishEmulator(t *testing.T) {
	w := newWorld(t, fastSim)
	sealer, err := seal.LoadOrCreateKey(filepath.Join(t.TempDir(), "seal.key"))
	require.NoError(t, err)
	st := store.New(w.client, store.WithSealer(sealer))
	w.st = st
	names, err := sim.Populate(w.ctx, st, 3, "rf")
	require.NoError(t, err)
	const password = "s3cret-bmc-pw"
	emus := map[string]*redfish.BMC{}
	for _, n := range names {
		emu, err := redfish.New(redfish.Config{
			Username: "admin", Password: password,
			Systems: []redfish.System{{ID: "1", Name: n, Machine: labMachine{w.fleet.Host(n)}}},
		})
		require.NoError(t, err)
		emu.Start()
		t.Cleanup(emu.Close)
		emus[n] = emu
		h := &typesv1.Host{}
		rev, err := st.Get(w.ctx, "hosts", n, h)
		require.NoError(t, err)
		h.Spec.Bmc = &typesv1.BMCSpec{Protocol: "redfish", Address: emu.URL(), Username: "admin", PasswordSet: true}
		_, err = st.Update(w.ctx, "hosts", n, h, rev)
		require.NoError(t, err)
		require.NoError(t, st.PutSecret(w.ctx, resources.BMCSecretPath(n), []byte(password)))
	}

	mgr := bmc.NewManager(bmc.ManagerOptions{Defaults: bmc.Options{PollInterval: 20 * time.Millisecond}})
	ctx, cancel := context.WithCancel(w.ctx)
	ex := provision.New(provision.Deps{
		Store:    st,
		Recorder: w.rec,
		BMCs:     provision.ManagerDialer(mgr, st),
		Agents:   w.fleet.AgentDialer(),
	}, w.cfg, slog.New(slog.DiscardHandler))
	done := make(chan struct{})
	go func() { defer close(done); _ = ex.Run(ctx) }()
	defer func() { cancel(); <-done }()

	w.waitFor(names, "Provisioned", provisioned)
	w.checkProvisionedOnce(names)
	for _, n := range names {
		if target, enabled, _ := emus[n].BootOverride("1"); target != "Hdd" || enabled != "Continuous" {
			t.Errorf("host %s: stored boot override = %s/%s, want Hdd/Continuous (boot from disk)", n, target, enabled)
		}
		if got := w.fleet.Host(n).LastDevice(); got != "disk" {
			t.Errorf("host %s: last boot from %q, want disk", n, got)
		}
		if emus[n].Stats().Resets["On"] == 0 {
			t.Errorf("host %s: the emulator saw no power on", n)
		}
	}
}
