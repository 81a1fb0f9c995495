package sysctl

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/host/netnstest"
	"github.com/kilnhq/kiln/internal/errdefs"
)

func TestPath(t *testing.T) {
	if got, want := Path("/r", "net.ipv4.ip_forward"), "/r/proc/sys/net/ipv4/ip_forward"; got != want {
		t.Errorf("Path(%q, %q) = %q, want %q", "/r", "net.ipv4.ip_forward", got, want)
	}
}

func TestGetSetFiles(t *testing.T) {
	root := t.TempDir()
	p := Path(root, "net.ipv4.ip_forward")
	require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
	require.NoError(t, os.WriteFile(p, []byte("0\n"), 0o644))

	require.NoError(t, Set(root, "net.ipv4.ip_forward", "1"))
	got, err := Get(root, "net.ipv4.ip_forward")
	require.NoError(t, err)
	if got != "1" {
		t.Errorf("Get(%q) = %q, want %q", "net.ipv4.ip_forward", got, "1")
	}
	if _, err := Get(root, "net.bridge.bridge-nf-call-iptables"); !errdefs.IsNotFound(err) {
		t.Errorf("Get(missing) error = %v, want NotFound", err)
	}
	if err := Set(root, "net.bridge.bridge-nf-call-iptables", "1"); !errdefs.IsNotFound(err) {
		t.Errorf("Set(missing) error = %v, want NotFound", err)
	}
}

func TestParse(t *testing.T) {
	in := "# c\n; c\nnet.ipv4.ip_forward = 1\n-net/bridge/bridge-nf-call-iptables=1\nbad line\n"
	got := Parse(in)
	want := map[string]string{"net.ipv4.ip_forward": "1", "net.bridge.bridge-nf-call-iptables": "1"}
	require.Equal(t, want, got, "Parse(%q)", in)
}

func TestPersist(t *testing.T) {
	root := t.TempDir()
	path := filepath.Join(root, PersistFile)
	require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	require.NoError(t, os.WriteFile(path, []byte("vm.max_map_count = 262144\n"), 0o644))

	changed, err := Persist(root, map[string]string{"net.ipv4.ip_forward": "1"})
	require.NoError(t, err)
	if !changed {
		t.Errorf("Persist() changed = false, want true")
	}
	got, err := Persisted(root)
	require.NoError(t, err)
	want := map[string]string{"net.ipv4.ip_forward": "1", "vm.max_map_count": "262144"}
	require.Equal(t, want, got, "Persisted() after Persist() keeps other keys")

	changed, err = Persist(root, map[string]string{"net.ipv4.ip_forward": "1"})
	require.NoError(t, err)
	if changed {
		t.Errorf("Persist() again changed = true, want false")
	}
}

// TestSetInNamespace writes a real per-namespace parameter in a fresh
// network namespace and checks that the host's value does not move.
func TestSetInNamespace(t *testing.T) {
	ns := netnstest.New(t)
	hostBefore, err := Get("/", "net.ipv4.ip_forward")
	require.NoError(t, err)
	want := "1"
	if hostBefore == "1" {
		want = "0"
	}
	var got string
	ns.Do(t, func() {
		require.NoError(t, Set("/", "net.ipv4.ip_forward", want))
		got, err = Get("/", "net.ipv4.ip_forward")
	})
	require.NoError(t, err)
	if got != want {
		t.Errorf("Get(ip_forward) in namespace = %q, want %q", got, want)
	}
	hostAfter, err := Get("/", "net.ipv4.ip_forward")
	require.NoError(t, err)
	if hostAfter != hostBefore {
		t.Errorf("host ip_forward = %q after setting it in a namespace, want unchanged %q", hostAfter, hostBefore)
	}
}
