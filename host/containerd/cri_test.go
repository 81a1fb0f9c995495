package containerd_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/host/containerd"
	"github.com/kilnhq/kiln/host/containerd/containerdtest"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// TestQueryRunning starts Debian's containerd, edits its config with
// WriteSystemdCgroup, and reads the effective value back over CRI: the
// running daemon keeps its value until restarted, which is why Kiln
// verifies the running containerd and not the file.
func TestQueryRunning(t *testing.T) {
	d := containerdtest.New(t)
	ctx := context.Background()

	_, _, err := containerd.WriteSystemdCgroup(d.Config, false)
	require.NoError(t, err)
	d.Start()
	r, err := containerd.Query(ctx, d.Socket)
	require.NoError(t, err)
	if r.SystemdCgroup || r.Driver() != containerd.DriverCgroupfs || r.RuntimeName != "runc" || r.Version == "" {
		t.Errorf("Query() = %+v, want runc on cgroupfs with a version", r)
	}

	_, changed, err := containerd.WriteSystemdCgroup(d.Config, true)
	require.NoError(t, err)
	require.True(t, changed)
	r, err = containerd.Query(ctx, d.Socket)
	require.NoError(t, err)
	if r.SystemdCgroup {
		t.Errorf("Query() before restart = SystemdCgroup %v, want the old false: containerd reads its file only at start", r.SystemdCgroup)
	}

	d.Restart()
	r, err = containerd.Query(ctx, d.Socket)
	require.NoError(t, err)
	if !r.SystemdCgroup || r.Driver() != containerd.DriverSystemd {
		t.Errorf("Query() after restart = %+v, want SystemdCgroup true", r)
	}
	// The file we wrote is one containerd accepts as is: the runc runtime
	// kept its type.
	if !r.RuntimeReady {
		t.Errorf("Query() RuntimeReady = false, want true")
	}
}

func TestQueryNobody(t *testing.T) {
	_, err := containerd.Query(context.Background(), t.TempDir()+"/none.sock")
	if !errdefs.IsUnavailable(err) {
		t.Errorf("Query(no socket) error = %v, want Unavailable", err)
	}
}
