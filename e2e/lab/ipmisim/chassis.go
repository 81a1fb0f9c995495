package ipmisim

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// RunChassis is the body of the kiln-chassis program that ipmi_sim runs as
// its chassis_control: args are SOCKET followed by ipmi_sim's request
// ("get power boot", "set power 1", ...). It forwards the request to the
// control socket, copies the answer to stdout and returns the exit code
// (0, or 1 with the error on stdout, where ipmi_sim collects it).
func RunChassis(args []string, stdout io.Writer) int {
	if len(args) < 3 {
		fmt.Fprintln(stdout, "usage: kiln-chassis SOCKET get|set PARM [VAL]...")
		return 1
	}
	c, err := net.DialTimeout("unix", args[0], 2*time.Second)
	if err != nil {
		fmt.Fprintf(stdout, "kiln-chassis: %v\n", err)
		return 1
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(8 * time.Second))
	if _, err := fmt.Fprintln(c, strings.Join(args[1:], " ")); err != nil {
		fmt.Fprintf(stdout, "kiln-chassis: %v\n", err)
		return 1
	}
	out, err := io.ReadAll(c)
	if err != nil {
		fmt.Fprintf(stdout, "kiln-chassis: %v\n", err)
		return 1
	}
	_, _ = stdout.Write(out)
	if strings.HasPrefix(string(out), "error:") {
		return 1
	}
	return 0
}

// BuildChassis compiles kiln-chassis into dir and returns its path. It
// needs the Go toolchain (tests have it); the lab's release ships the
// binary instead. Equivalent to:
// `go build -o DIR/kiln-chassis github.com/kilnhq/kiln/e2e/lab/cmd/kiln-chassis`.
func BuildChassis(ctx context.Context, dir string) (string, error) {
	gobin, err := exec.LookPath("go")
	if err != nil {
		gobin = filepath.Join(runtime.GOROOT(), "bin", "go")
		if _, serr := os.Stat(gobin); serr != nil {
			return "", errdefs.FailedPrecondition("build kiln-chassis: go toolchain not found")
		}
	}
	out := filepath.Join(dir, "kiln-chassis")
	cmd := exec.CommandContext(ctx, gobin, "build", "-o", out, "github.com/kilnhq/kiln/e2e/lab/cmd/kiln-chassis")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build kiln-chassis: %v: %s", err, b)
	}
	return out, nil
}
