package reboot

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// recorder sends every command line it is asked to run.
type recorder chan string

func (r recorder) Run(_ context.Context, name string, args ...string) ([]byte, error) {
	r <- strings.Join(append([]string{name}, args...), " ")
	return nil, nil
}

func TestReboot(t *testing.T) {
	rec := make(recorder, 2)
	c := &Commands{RebootCommand: "systemctl reboot", PowerOffCommand: "systemctl poweroff", Runner: rec, Delay: time.Millisecond}
	tests := []struct {
		req  *agentv1.RebootRequest
		want string
	}{
		{&agentv1.RebootRequest{}, "systemctl reboot"},
		{&agentv1.RebootRequest{PowerOff: true}, "systemctl poweroff"},
	}
	for _, tt := range tests {
		if err := c.Reboot(context.Background(), tt.req); err != nil {
			t.Fatalf("Reboot(%v) = %v", tt.req, err)
		}
		if got := <-rec; got != tt.want {
			t.Errorf("Reboot(%v) ran %q, want %q", tt.req, got, tt.want)
		}
	}
}

func TestNotConfigured(t *testing.T) {
	c := &Commands{RebootCommand: "reboot -f", Runner: make(recorder)}
	err := c.Reboot(context.Background(), &agentv1.RebootRequest{PowerOff: true})
	if !errdefs.IsNotSupported(err) || !strings.Contains(err.Error(), "--poweroff-command") {
		t.Errorf("Reboot(power off) without a command = %v, want NotSupported naming --poweroff-command", err)
	}
}
