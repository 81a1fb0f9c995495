package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/kilnhq/kiln/host/systemd"
	"github.com/kilnhq/kiln/internal/atomicfile"
)

const unitName = "kiln-agent.service"

type unitOptions struct {
	Exec    string
	DataDir string
	Listen  string
	Root    string
}

// renderUnit returns the systemd unit that runs the agent.
//
// It is written with fmt, not text/template: executing a template makes the
// linker keep every exported method of every type in the binary (reflection
// may call any of them), which costs the agent about 2.4 MiB of binary and
// as much resident memory (docs/bench/agent.md).
func renderUnit(o unitOptions) ([]byte, error) {
	root := ""
	if o.Root != "/" {
		root = " --root " + o.Root
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, `[Unit]
Description=Kiln host agent
Documentation=https://github.com/kilnhq/kiln/blob/main/docs/agent.md
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=%s run --data-dir %s --listen %s%s --reboot-command "systemctl reboot" --poweroff-command "systemctl poweroff"
Restart=always
RestartSec=5

[Install]
WantedBy=multi-user.target
`, o.Exec, o.DataDir, o.Listen, root)
	return b.Bytes(), nil
}

// installUnit writes the unit to path, then enables and starts it when
// systemd answers; without systemd it says how to start the agent.
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
	unit, err := renderUnit(o)
	if err != nil {
		return fmt.Errorf("install unit: %w", err)
	}
	if err := atomicfile.Write(path, unit, 0o644, atomicfile.MkdirAll(0o755)); err != nil {
		return fmt.Errorf("install unit: %w", err)
	}
	fmt.Fprintf(out, "wrote %s\n", path)
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
