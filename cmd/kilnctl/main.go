// Command kilnctl is the Kiln CLI: apply, get, describe, delete and watch
// resources, create enrollment tokens. The commands live in
// cmd/kilnctl/internal/cli.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/kilnhq/kiln/cmd/kilnctl/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := cli.Run(ctx, cli.Options{Lab: cli.LabCommand()}, os.Args[1:])
	stop()
	if err != nil {
		if !errors.Is(err, cli.ErrDiffers) { // kilnctl diff printed the diff
			fmt.Fprintln(os.Stderr, "error:", err)
		}
		os.Exit(cli.ExitCode(err)) // 3: a wait stalled; 1: differs or any other error; 2: diff failed
	}
}
