// Package reboot restarts or powers off the host on the controller's
// request, with commands the operator configures (kiln-agent run
// --reboot-command, --poweroff-command): "systemctl reboot" on an installed
// host, "reboot -f" in boot media, and whatever the lab uses to restart one
// of its machines. Nothing is configured by default, so an agent running in
// a lab namespace can never reboot the machine it runs on.
//
// The command runs after a short delay, so that the RPC's answer reaches
// the controller before the host goes down.
package reboot

import (
	"context"
	"log/slog"
	"strings"
	"time"

	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// DefaultDelay is how long after answering the command runs.
const DefaultDelay = time.Second

// Runner runs a host command (command.Exec in production).
type Runner interface {
	Run(ctx context.Context, name string, args ...string) ([]byte, error)
}

// Commands reboots with configured commands.
type Commands struct {
	// RebootCommand and PowerOffCommand are command lines split on
	// spaces; empty means not available.
	RebootCommand, PowerOffCommand string
	Runner                         Runner
	// Delay before the command runs (DefaultDelay when 0).
	Delay time.Duration
	Log   *slog.Logger
}

// Reboot schedules the reboot (or power-off) command and returns at once.
// It returns NotSupported when no command is configured for the request.
// The command's failure is logged: by then the answer has been sent.
func (c *Commands) Reboot(_ context.Context, req *agentv1.RebootRequest) error {
	line, what := c.RebootCommand, "reboot"
	if req.GetPowerOff() {
		line, what = c.PowerOffCommand, "power off"
	}
	args := strings.Fields(line)
	if len(args) == 0 {
		return errdefs.NotSupported("%s: no command configured (kiln-agent run --%s-command)", what, strings.ReplaceAll(what, " ", ""))
	}
	delay := c.Delay
	if delay <= 0 {
		delay = DefaultDelay
	}
	log := c.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log.Warn("host going down", "action", what, "command", line, "in", delay)
	time.AfterFunc(delay, func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if _, err := c.Runner.Run(ctx, args[0], args[1:]...); err != nil {
			log.Error("host did not go down", "action", what, "command", line, "error", err)
		}
	})
	return nil
}
