package command

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestExecRun(t *testing.T) {
	ctx := context.Background()
	out, err := Exec{}.Run(ctx, "sh", "-c", "echo hello")
	require.NoError(t, err)
	if got := string(out); got != "hello\n" {
		t.Errorf("Run(%q) = %q, want %q", "echo hello", got, "hello\n")
	}
	_, err = Exec{}.Run(ctx, "sh", "-c", "echo broken >&2; exit 3")
	if err == nil || !strings.Contains(err.Error(), "broken") {
		t.Errorf("Run(exit 3) error = %v, want it to carry stderr %q", err, "broken")
	}
}

func TestRecorder(t *testing.T) {
	boom := errors.New("boom")
	r := &Recorder{
		Outputs: map[string]string{"swapon --show": "/swapfile"},
		Fail: func(line string) error {
			if line == "swapoff -a" {
				return boom
			}
			return nil
		},
	}
	ctx := context.Background()
	out, err := r.Run(ctx, "swapon", "--show")
	require.NoError(t, err)
	if string(out) != "/swapfile" {
		t.Errorf("Run(%q) = %q, want %q", "swapon --show", out, "/swapfile")
	}
	if _, err := r.Run(ctx, "swapoff", "-a"); !errors.Is(err, boom) {
		t.Errorf("Run(%q) error = %v, want %v", "swapoff -a", err, boom)
	}
	require.Equal(t, []string{"swapon --show", "swapoff -a"}, r.Lines())
}
