package kmod

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/host/command"
)

func write(t *testing.T, path, content string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	require.NoError(t, os.WriteFile(path, []byte(content), 0o644))
}

func TestStatus(t *testing.T) {
	root := t.TempDir()
	write(t, filepath.Join(root, "proc/modules"), "overlay 151552 0 - Live 0x0000000000000000\n")
	write(t, filepath.Join(root, "lib/modules/6.1.0-test/modules.builtin"), "kernel/net/bridge/bridge.ko\n")
	write(t, filepath.Join(root, "sys/module/nf_conntrack/parameters/hashsize"), "65536\n")
	write(t, filepath.Join(root, "proc/sys/net/bridge/bridge-nf-call-iptables"), "1\n")
	write(t, filepath.Join(root, "proc/filesystems"), "nodev\tsysfs\nnodev\ttmpfs\n\text4\nnodev\toverlay\n")
	tests := []struct {
		name string
		want State
	}{
		{"overlay", Loaded},
		{"ext4", Missing}, // a filesystem, but no evidence rule for it
		{"bridge", BuiltIn},
		{"nf_conntrack", BuiltIn},
		{"nf-conntrack", BuiltIn},
		{"br_netfilter", BuiltIn},
		{"ip_vs", Missing},
	}
	for _, tt := range tests {
		got, err := Status(root, "6.1.0-test", tt.name)
		require.NoError(t, err)
		if got != tt.want {
			t.Errorf("Status(%q) = %v, want %v", tt.name, got, tt.want)
		}
	}
}

// TestStatusContainer is a container's view: no /proc/modules, no
// /sys/module, only /proc/filesystems and the bridge sysctls.
func TestStatusContainer(t *testing.T) {
	root := t.TempDir()
	write(t, filepath.Join(root, "proc/filesystems"), "nodev\tsysfs\nnodev\toverlay\n")
	for _, name := range []string{"overlay"} {
		if got, err := Status(root, "", name); err != nil || got != BuiltIn {
			t.Errorf("Status(%q) = %v, %v, want built-in", name, got, err)
		}
	}
	if got, _ := Status(root, "", "br_netfilter"); got != Missing {
		t.Errorf("Status(%q) without bridge sysctls = %v, want missing", "br_netfilter", got)
	}
}

func TestEnsure(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	write(t, filepath.Join(root, "proc/modules"), "")

	// modprobe that "loads" the module by adding it to /proc/modules.
	loads := &command.Recorder{Fail: func(line string) error {
		write(t, filepath.Join(root, "proc/modules"), "br_netfilter 32768 0 - Live 0x0\n")
		return nil
	}}
	before, after, err := Ensure(ctx, root, "", loads, "br_netfilter")
	require.NoError(t, err)
	if before != Missing || after != Loaded {
		t.Errorf("Ensure(br_netfilter) = %v -> %v, want missing -> loaded", before, after)
	}
	require.Equal(t, []string{"modprobe br_netfilter"}, loads.Lines())

	// Already loaded: no command.
	again := &command.Recorder{}
	before, after, err = Ensure(ctx, root, "", again, "br_netfilter")
	require.NoError(t, err)
	if before != Loaded || after != Loaded || len(again.Lines()) != 0 {
		t.Errorf("Ensure(loaded) = %v -> %v running %v, want loaded, no command", before, after, again.Lines())
	}

	// modprobe fails, as on a kernel without loadable modules.
	failing := &command.Recorder{Err: errors.New("modprobe: FATAL: Module overlay not found")}
	if _, _, err := Ensure(ctx, root, "", failing, "overlay"); err == nil {
		t.Errorf("Ensure(overlay) with failing modprobe error = nil, want an error")
	}
	// modprobe "succeeds" but nothing is loaded.
	lying := &command.Recorder{}
	if _, _, err := Ensure(ctx, root, "", lying, "overlay"); err == nil {
		t.Errorf("Ensure(overlay) with modprobe that loads nothing error = nil, want an error")
	}
}

func TestPersist(t *testing.T) {
	root := t.TempDir()
	write(t, filepath.Join(root, PersistFile), "# mine\nip_vs\n")
	changed, err := Persist(root, []string{"overlay", "br_netfilter"})
	require.NoError(t, err)
	require.True(t, changed, "Persist() changed")
	b, err := os.ReadFile(filepath.Join(root, PersistFile))
	require.NoError(t, err)
	want := "# Written by kiln-agent (Prepare): modules Kubernetes needs.\nbr_netfilter\nip_vs\noverlay\n"
	if string(b) != want {
		t.Errorf("Persist() wrote %q, want %q", b, want)
	}
	changed, err = Persist(root, []string{"overlay", "br_netfilter"})
	require.NoError(t, err)
	if changed {
		t.Errorf("Persist() again changed = true, want false")
	}
}
