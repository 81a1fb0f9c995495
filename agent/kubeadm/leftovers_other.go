//go:build !linux

package kubeadm

import (
	"syscall"

	"github.com/kilnhq/kiln/internal/errdefs"
)

const (
	sigTerm = syscall.SIGTERM
	sigKill = syscall.SIGKILL
)

func kill(int, syscall.Signal) error { return errdefs.NotSupported("signal: not on this OS") }

func runningSince(string, int, uint64) bool { return false }

func startTime(string, int) (uint64, bool) { return 0, false }

func listeners(string, []int, map[int]string) ([]Leftover, error) {
	return nil, errdefs.NotSupported("finding a port's process: not on this OS")
}
