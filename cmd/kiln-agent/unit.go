package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/kilnhq/kiln/host/systemd"
	"github.com/kilnhq/kiln/internal/atomicfile"
	"github.com/kilnhq/kiln/internal/units"
)

const unitName = units.AgentName

// packagedUnits are where the kiln-agent package puts its unit, relative
// to the root (Debian 12 merges /lib into /usr/lib).
var packagedUnits = []string{"usr/lib/systemd/system/" + units.AgentName, "lib/systemd/system/" + units.AgentName}

type unitOptions struct {
	Exec    string
	DataDir string
	Listen  string
	Root    string
}

// renderUnit returns the systemd unit that runs the agent
// (internal/units).
func renderUnit(o unitOptions) ([]byte, error) {
	return units.AgentUnit(units.Agent{Exec: o.Exec, DataDir: o.DataDir, Listen: o.Listen, Root: o.Root}), nil
}

// packaged reports whether the kiln-agent package's unit under root
// already runs the agent as o asks: the packaged binary, data directory
// and listen address, on the host's own root.
func packaged(o unitOptions) bool {
	if o.Exec != units.AgentExec || o.DataDir != units.AgentDataDir || o.Listen != units.AgentListen || (o.Root != "/" && o.Root != "") {
		return false
	}
	for _, p := range packagedUnits {
		if _, err := os.Stat(filepath.Join("/", p)); err == nil {
			return true
		}
	}
	return false
}

// installUnit writes the unit to path, then enables and starts it when
// systemd answers; without systemd it says how to start the agent. When
// the kiln-agent package's unit already runs the agent as asked (and path
// is the default), it writes nothing and enables and starts that one, so
// purging the package leaves no unit behind.
//
// Equivalent to: `systemctl enable --now kiln-agent.service`.
func installUnit(ctx context.Context, out io.Writer, path string, o unitOptions, log *slog.Logger) error {
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("install unit: %w", err)
	}
	o.Exec = exe
	if o.DataDir, err = filepath.Abs(o.DataDir); err != nil {
		return fmt.Errorf("install unit: %w", err)
	}
	if pkg := packaged(o); pkg && path == defaultUnitPath {
		fmt.Fprintf(out, "using the packaged %s\n", unitName)
	} else {
		unit, err := renderUnit(o)
		if err != nil {
			return fmt.Errorf("install unit: %w", err)
		}
		if err := atomicfile.Write(path, unit, 0o644, atomicfile.MkdirAll(0o755)); err != nil {
			return fmt.Errorf("install unit: %w", err)
		}
		fmt.Fprintf(out, "wrote %s\n", path)
	}
	m, err := systemd.Dial(ctx, o.Root)
	if err != nil {
		log.Warn("systemd not reachable; unit written but not started", "error", err)
		fmt.Fprintf(out, "systemd is not running here: start the agent with %s run --data-dir %s\n", exe, o.DataDir)
		return nil
	}
	defer m.Close()
	if _, err := m.Enable(ctx, unitName); err != nil {
		return fmt.Errorf("install unit: %w (try: systemctl daemon-reload && systemctl enable --now %s)", err, unitName)
	}
	if err := m.Start(ctx, unitName); err != nil {
		return fmt.Errorf("install unit: %w", err)
	}
	fmt.Fprintf(out, "enabled and started %s\n", unitName)
	return nil
}
