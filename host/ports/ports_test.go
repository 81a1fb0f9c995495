package ports

import (
	"net"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/host/netnstest"
)

func TestBusy(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	used := l.Addr().(*net.TCPAddr).Port

	free, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	unused := free.Addr().(*net.TCPAddr).Port
	free.Close()

	busy, err := Busy([]int{used, unused})
	require.NoError(t, err)
	if !slices.Equal(busy, []int{used}) {
		t.Errorf("Busy(%d, %d) = %v, want [%d] (only the loopback listener's port)", used, unused, busy, used)
	}
}

// TestBusyControlPlaneInNamespace takes the API server port in a fresh
// namespace and finds it, and only it, busy there.
func TestBusyControlPlaneInNamespace(t *testing.T) {
	ns := netnstest.New(t)
	var busy []int
	var err error
	ns.Do(t, func() {
		l, lerr := net.Listen("tcp", "127.0.0.1:6443")
		require.NoError(t, lerr)
		defer l.Close()
		busy, err = Busy(ControlPlane)
	})
	require.NoError(t, err)
	if !slices.Equal(busy, []int{6443}) {
		t.Errorf("Busy(%v) in namespace = %v, want [6443]", ControlPlane, busy)
	}
}

// Every control-plane port preflight checks names its component, and no
// component is named for a port preflight does not check: the leftover
// check after a reset and preflight look at the same ports.
func TestComponentCoversControlPlane(t *testing.T) {
	if len(Component) != len(ControlPlane) {
		t.Errorf("Component names %d ports, ControlPlane has %d", len(Component), len(ControlPlane))
	}
	for _, p := range ControlPlane {
		if Component[p] == "" {
			t.Errorf("port %d: no component", p)
		}
	}
}
