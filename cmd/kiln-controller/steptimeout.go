package main

import (
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// stepTimeoutFlags is --step-timeout STEP=DURATION (repeatable): the host
// lifecycle's step timeouts (hostlife.Config.Timeouts).
type stepTimeoutFlags struct {
	vals []string
}

func (f *stepTimeoutFlags) bind(cmd *cobra.Command) {
	cmd.Flags().StringArrayVar(&f.vals, "step-timeout", nil,
		"`STEP=DURATION`: how long host lifecycle step STEP may take before it times out (StepTimedOut: a failed attempt, tried again after a backoff; docs/lifecycle.md); repeatable, STEP in any case. Defaults: "+defaultStepTimeouts())
}

func (f *stepTimeoutFlags) apply(cfg *controller.Config) error {
	m, err := parseStepTimeouts(f.vals)
	if err != nil {
		return err
	}
	cfg.StepTimeouts = m
	return nil
}

// defaultStepTimeouts renders hostlife.DefaultTimeouts in step order
// ("CheckBMC=2m0s, PowerOff=3m0s, ...").
func defaultStepTimeouts() string {
	d := hostlife.DefaultTimeouts()
	var parts []string
	for _, s := range hostlife.Steps() {
		parts = append(parts, fmt.Sprintf("%s=%s", s, d[s]))
	}
	return strings.Join(parts, ", ")
}

// parseStepTimeouts reads --step-timeout values, "LayImage=45m": a step
// named twice, an unknown step (the error lists the steps) or a duration
// that is not positive is refused.
func parseStepTimeouts(vals []string) (map[hostlife.Step]time.Duration, error) {
	if len(vals) == 0 {
		return nil, nil
	}
	m := make(map[hostlife.Step]time.Duration, len(vals))
	for _, v := range vals {
		name, dur, ok := strings.Cut(v, "=")
		if !ok {
			return nil, errdefs.InvalidArgument("--step-timeout %q: want STEP=DURATION such as LayImage=45m", v)
		}
		step, err := hostlife.ParseStep(strings.TrimSpace(name))
		if err != nil {
			return nil, fmt.Errorf("--step-timeout %q: %w", v, err)
		}
		d, err := time.ParseDuration(strings.TrimSpace(dur))
		if err != nil || d <= 0 {
			return nil, errdefs.InvalidArgument("--step-timeout %q: want a positive duration such as 45m or 1h30m after %s=", v, step)
		}
		if _, dup := m[step]; dup {
			return nil, errdefs.InvalidArgument("--step-timeout %q: step %s is given twice", v, step)
		}
		m[step] = d
	}
	return m, nil
}
