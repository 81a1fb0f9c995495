// Package swap turns swap off now and for later boots, as the kubelet
// requires by default (failSwapOn).
package swap

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/kilnhq/kiln/internal/atomicfile"
)

// Runner runs a host command (command.Exec in production).
type Runner interface {
	Run(ctx context.Context, name string, args ...string) ([]byte, error)
}

// Active returns the swap devices and files in use, from ROOT/proc/swaps.
//
// Equivalent to: `swapon --show=NAME --noheadings`.
func Active(root string) ([]string, error) {
	b, err := os.ReadFile(filepath.Join(root, "proc/swaps"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read /proc/swaps: %w", err)
	}
	var names []string
	for i, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if i == 0 || len(f) == 0 { // header: Filename Type Size Used Priority
			continue
		}
		names = append(names, f[0])
	}
	return names, nil
}

// Off turns off all swap when any is active, and reports what was on.
//
// Equivalent to: `swapoff -a`.
func Off(ctx context.Context, root string, run Runner) (was []string, err error) {
	was, err = Active(root)
	if err != nil || len(was) == 0 {
		return was, err
	}
	if _, err := run.Run(ctx, "swapoff", "-a"); err != nil {
		return was, fmt.Errorf("swap off: %w", err)
	}
	return was, nil
}

// DisableInFstab comments out the swap entries of ROOT/etc/fstab (a "#"
// in front of the line) and returns the lines it commented out. Every
// other byte of the file stays as it was; a missing fstab is not an error.
//
// Equivalent to: `sed -i '/\sswap\s/s/^/#/' /etc/fstab`.
func DisableInFstab(root string) (disabled []string, err error) {
	path := filepath.Join(root, "etc/fstab")
	fi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("fstab: %w", err)
	}
	old, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("fstab: %w", err)
	}
	lines := bytes.SplitAfter(old, []byte("\n"))
	var out bytes.Buffer
	for _, line := range lines {
		if IsSwapEntry(string(line)) {
			disabled = append(disabled, strings.TrimRight(string(line), "\n"))
			out.WriteByte('#')
		}
		out.Write(line)
	}
	if len(disabled) == 0 {
		return nil, nil
	}
	if err := atomicfile.Write(path, out.Bytes(), fi.Mode().Perm(), atomicfile.MkdirAll(0o755)); err != nil {
		return nil, fmt.Errorf("fstab: %w", err)
	}
	return disabled, nil
}

// IsSwapEntry reports whether an fstab(5) line is an active swap entry:
// not a comment, and its third field (the type) is "swap".
func IsSwapEntry(line string) bool {
	f := strings.Fields(line)
	return len(f) >= 3 && !strings.HasPrefix(f[0], "#") && f[2] == "swap"
}
