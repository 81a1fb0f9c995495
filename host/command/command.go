// Package command runs host commands. Every host operation in Kiln takes a
// Runner so that tests can record or fail commands instead of running them;
// production passes Exec.
package command

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strings"
	"sync"
)

// Exec runs commands with os/exec. The zero value is ready to use.
type Exec struct{}

// Run runs name with args and returns its standard output. On failure the
// error carries the command line and the first line of standard error.
// It blocks until the command exits or ctx is done (the process is killed).
func (Exec) Run(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		msg := strings.TrimSpace(stderr.String())
		if i := strings.IndexByte(msg, '\n'); i >= 0 {
			msg = msg[:i]
		}
		if msg != "" {
			return out, fmt.Errorf("%s: %w: %s", Line(name, args...), err, msg)
		}
		return out, fmt.Errorf("%s: %w", Line(name, args...), err)
	}
	return out, nil
}

// Line formats a command line for messages.
func Line(name string, args ...string) string {
	return strings.TrimSpace(name + " " + strings.Join(args, " "))
}

// Recorder is a Runner for tests: it records every command line and
// answers from Outputs (keyed by the full command line) or, failing that,
// with Err (nil: empty output, success). Fail, when set, decides per
// command whether to fail, which lets a test inject faults.
type Recorder struct {
	mu      sync.Mutex
	Outputs map[string]string
	Err     error
	Fail    func(line string) error
	lines   []string
}

// Run records the command line and answers as configured.
func (r *Recorder) Run(_ context.Context, name string, args ...string) ([]byte, error) {
	line := Line(name, args...)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.lines = append(r.lines, line)
	if r.Fail != nil {
		if err := r.Fail(line); err != nil {
			return nil, err
		}
	}
	if out, ok := r.Outputs[line]; ok {
		return []byte(out), nil
	}
	return nil, r.Err
}

// Lines returns the command lines run so far.
func (r *Recorder) Lines() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.lines...)
}
