package kubetools

import (
	"context"
	"io"
	"os/exec"
)

// Cmd is one command the builder runs.
type Cmd struct {
	Dir  string
	Env  []string // the complete environment
	Path string
	Args []string // without the command name
	// Stdout and Stderr receive the command's output; nil discards it.
	Stdout io.Writer
	Stderr io.Writer
}

// Runner runs commands to completion. The builder runs every go command
// through it; tests inject one that fakes the toolchain and its failures.
type Runner interface {
	Run(ctx context.Context, c Cmd) error
}

// ExecRunner runs commands with os/exec. Cancelling ctx kills the command.
type ExecRunner struct{}

var _ Runner = ExecRunner{}

// Run runs c and waits for it.
func (ExecRunner) Run(ctx context.Context, c Cmd) error {
	cmd := exec.CommandContext(ctx, c.Path, c.Args...)
	cmd.Dir = c.Dir
	cmd.Env = c.Env
	cmd.Stdout = c.Stdout
	cmd.Stderr = c.Stderr
	return cmd.Run()
}
