package rootdisk_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnhq/kiln/agent/agenttest"
	"github.com/kilnhq/kiln/agent/lay"
	"github.com/kilnhq/kiln/agent/rootdisk"
	"github.com/kilnhq/kiln/agent/server"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	require.NoError(t, os.WriteFile(path, []byte(content), 0o644))
}

// fakeRoot is a host root whose sysfs lists sda and sdb (two identical
// spinning disks with serials) and "null", a disk whose device node
// (/dev/null) is a character device; sda has a by-path link.
func fakeRoot(t *testing.T) string {
	root := t.TempDir()
	for name, serial := range map[string]string{"sda": "ZC11AAAA", "sdb": "ZC11BBBB", "null": "NULL0001"} {
		dir := filepath.Join(root, "sys/block", name)
		writeFile(t, filepath.Join(dir, "size"), "7814037168\n")
		writeFile(t, filepath.Join(dir, "queue/rotational"), "1\n")
		writeFile(t, filepath.Join(dir, "device/serial"), serial+"\n")
	}
	require.NoError(t, os.MkdirAll(filepath.Join(root, "dev/disk/by-path"), 0o755))
	require.NoError(t, os.Symlink("../../sda", filepath.Join(root, "dev/disk/by-path/pci-0000:00:17.0-ata-1")))
	return root
}

// TestResolveRefusals: what the agent refuses before it touches a disk,
// against a fake sysfs (no root needed).
func TestResolveRefusals(t *testing.T) {
	root := fakeRoot(t)
	file := filepath.Join(t.TempDir(), "disk.raw")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	tests := []struct {
		name   string
		target string
		hints  *typesv1.RootDeviceHints
		class  func(error) bool
		want   []string
	}{
		{"serial of no disk", "NOSUCHSERIAL", nil, errdefs.IsInvalidArgument,
			[]string{"serial=NOSUCHSERIAL matches none of this host's 3 disks", "/dev/sda (3726.0 GiB, serial ZC11AAAA, by-path /dev/disk/by-path/pci-0000:00:17.0-ata-1, rotational)", "/dev/sdb (3726.0 GiB, serial ZC11BBBB, rotational)", "change spec.rootDiskHint (or spec.rootDeviceHints) to name one of them: /dev/null"}},
		{"two disks", "", &typesv1.RootDeviceHints{MinSizeGigabytes: 3000, Rotational: new(true)}, errdefs.IsInvalidArgument,
			[]string{"matches 3 disks", "add a hint that tells them apart"}},
		{"a file outside file-target mode", file, nil, errdefs.IsInvalidArgument,
			[]string{"is not a device under /dev", "--file-targets", "/dev/sdb (3726.0 GiB"}},
		{"a device name that is not a path", "", &typesv1.RootDeviceHints{DeviceName: "sda"}, errdefs.IsInvalidArgument,
			[]string{`deviceName "sda" is not a path`}},
		{"not a block device", "NULL0001", nil, errdefs.IsInvalidArgument,
			[]string{"chose /dev/null", "is not a block device"}},
	}
	r := &rootdisk.Resolver{Root: root}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := r.Resolve(context.Background(), tt.target, tt.hints)
			t.Logf("Resolve(%q, %v) = %q, %v", tt.target, tt.hints, got, err)
			require.Error(t, err)
			if !tt.class(err) {
				t.Errorf("Resolve(%q) error class of %v: want InvalidArgument", tt.target, err)
			}
			for _, s := range tt.want {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("Resolve(%q) = %q, want it to contain %q", tt.target, err, s)
				}
			}
		})
	}

	// Without udev (boot media) there are no links to match: the refusal
	// says to use another hint.
	bare := t.TempDir()
	writeFile(t, filepath.Join(bare, "sys/block/sda/size"), "7814037168\n")
	_, err := (&rootdisk.Resolver{Root: bare}).Resolve(context.Background(), "/dev/disk/by-path/pci-0000:00:17.0-ata-1", nil)
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "no /dev/disk links") || !strings.Contains(err.Error(), "serial, wwn or size") {
		t.Errorf("Resolve(by-path) without udev links = %v, want InvalidArgument saying to name the disk by serial, wwn or size", err)
	}

	// The lab's mode takes the file as it is, and only alone.
	lab := &rootdisk.Resolver{Root: root, FileTargets: true}
	got, err := lab.Resolve(context.Background(), file, nil)
	require.NoError(t, err)
	if got != file {
		t.Errorf("Resolve(%q) in file-target mode = %q, want the file", file, got)
	}
	_, err = lab.Resolve(context.Background(), "", &typesv1.RootDeviceHints{DeviceName: file, Serial: "X"})
	require.ErrorContains(t, err, "takes no other hint")
}

// loop is a loop device made for a test and the fake root's view of it.
type loop struct{ dev, name string }

// newLoop attaches a sparse file of size bytes to a free loop device and
// detaches it at cleanup, and links it into the fake root's sysfs (so
// that the test sees its own loop devices and no other) and, with
// byPath, into ROOT/dev/disk/by-path. Equivalent to:
// `truncate -s SIZE F && losetup --find --show F`.
func newLoop(t *testing.T, root string, size int64, byPath string) loop {
	t.Helper()
	if os.Geteuid() != 0 {
		testenv.Skip(t, "loop devices need root")
	}
	if _, err := exec.LookPath("losetup"); err != nil {
		testenv.Skip(t, "losetup not installed (util-linux)")
	}
	backing := filepath.Join(t.TempDir(), "backing.raw")
	f, err := os.Create(backing)
	require.NoError(t, err)
	require.NoError(t, f.Truncate(size))
	require.NoError(t, f.Close())
	out, err := exec.Command("losetup", "--find", "--show", backing).CombinedOutput()
	if err != nil {
		testenv.Skipf(t, "no loop device available: losetup: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() {
		if out, err := exec.Command("losetup", "--detach", dev).CombinedOutput(); err != nil {
			t.Errorf("losetup --detach %s: %v: %s", dev, err, out)
		}
	})
	name := filepath.Base(dev)
	require.NoError(t, os.MkdirAll(filepath.Join(root, "sys/block"), 0o755))
	require.NoError(t, os.Symlink("/sys/block/"+name, filepath.Join(root, "sys/block", name)))
	if byPath != "" {
		require.NoError(t, os.MkdirAll(filepath.Join(root, "dev/disk/by-path"), 0o755))
		require.NoError(t, os.Symlink(dev, filepath.Join(root, "dev/disk/by-path", byPath)))
	}
	return loop{dev: dev, name: name}
}

// TestLayByHintOnLoopDevices lays an image through the agent API onto real
// loop devices chosen by by-path link, device path and size range, and
// shows the refusals of a hint that matches two disks and one that
// matches none. Loop devices have no serial or WWN: those hints are
// covered by internal/diskhint's table.
func TestLayByHintOnLoopDevices(t *testing.T) {
	root := t.TempDir()
	big := newLoop(t, root, 3<<30, "kiln-test-pci-0000:00:1f.2-ata-1")
	small := newLoop(t, root, 2<<30, "")

	img := make([]byte, 2<<20)
	rng := rand.New(rand.NewPCG(7, 7))
	for i := range img {
		img[i] = byte(rng.Uint32())
	}
	sum := sha256.Sum256(img)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.ServeContent(w, r, "image.raw", time.Time{}, bytes.NewReader(img))
	}))
	t.Cleanup(srv.Close)

	log := slog.New(slog.NewTextHandler(tWriter{t}, nil))
	layer := lay.New(log) // no file targets: block devices only
	a := agenttest.Start(t, server.Options{
		ImageLayer: lay.Service{Layer: layer},
		Wiper:      lay.Service{Layer: layer},
		Disks:      &rootdisk.Resolver{Root: root, VirtualDisks: true, Log: log},
		Log:        log,
	})
	c := a.Controller(t)
	layBy := func(id, target string, hints *typesv1.RootDeviceHints) error {
		s, err := c.LayImage(context.Background(), &agentv1.LayImageRequest{
			OperationId: id, Url: srv.URL + "/image.raw", Sha256: hex.EncodeToString(sum[:]), Target: target, RootDeviceHints: hints,
		})
		require.NoError(t, err)
		return follow(s)
	}
	holds := func(dev string) bool {
		f, err := os.Open(dev)
		require.NoError(t, err)
		defer f.Close()
		got := make([]byte, len(img))
		_, err = io.ReadFull(f, got)
		require.NoError(t, err)
		return bytes.Equal(got, img)
	}

	t.Log("| hint | result |")
	t.Log("|---|---|")
	row := func(hint string, err error, dev string) {
		if err != nil {
			t.Logf("| `%s` | refused: %s |", hint, status.Convert(err).Message())
			return
		}
		t.Logf("| `%s` | laid onto %s |", hint, dev)
	}

	// by-path (the one-string form, as spec.rootDiskHint sends it).
	byPath := "/dev/disk/by-path/kiln-test-pci-0000:00:1f.2-ata-1"
	err := layBy("by-path", byPath, nil)
	row("rootDiskHint: "+byPath, err, big.dev)
	require.NoError(t, err)
	if !holds(big.dev) {
		t.Errorf("LayImage(%s): %s does not hold the image", byPath, big.dev)
	}

	// Device path.
	err = layBy("device-path", small.dev, nil)
	row("rootDiskHint: "+small.dev, err, small.dev)
	require.NoError(t, err)
	if !holds(small.dev) {
		t.Errorf("LayImage(%s): the device does not hold the image", small.dev)
	}

	// Size range: only the 2 GiB disk.
	wipe, err := c.Wipe(context.Background(), &agentv1.WipeRequest{OperationId: "wipe-small", Target: small.dev})
	require.NoError(t, err)
	require.NoError(t, follow(wipe), "Wipe(%s)", small.dev)
	require.False(t, holds(small.dev), "after Wipe(%s)", small.dev)
	err = layBy("size", "", &typesv1.RootDeviceHints{MinSizeGigabytes: 1, MaxSizeGigabytes: 2})
	row("rootDeviceHints: {minSizeGigabytes: 1, maxSizeGigabytes: 2}", err, small.dev)
	require.NoError(t, err)
	if !holds(small.dev) {
		t.Errorf("LayImage(size 1-2 GiB): %s does not hold the image", small.dev)
	}

	// Two disks in range, and no disk with that serial: refused before
	// the operation starts, as InvalidArgument, naming both candidates.
	err = layBy("two", "", &typesv1.RootDeviceHints{MinSizeGigabytes: 1, MaxSizeGigabytes: 3})
	row("rootDeviceHints: {minSizeGigabytes: 1, maxSizeGigabytes: 3}", err, "")
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "matches 2 disks") ||
		!strings.Contains(err.Error(), big.dev+" (3.0 GiB, no serial, by-path "+byPath) || !strings.Contains(err.Error(), small.dev+" (2.0 GiB, no serial") {
		t.Errorf("LayImage(size 1-3 GiB) = %v, want InvalidArgument naming %s and %s", err, big.dev, small.dev)
	}
	err = layBy("serial", "S45PNA0M512345", nil)
	row("rootDiskHint: S45PNA0M512345", err, "")
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "matches none of this host's 2 disks") || !strings.Contains(err.Error(), big.dev) {
		t.Errorf("LayImage(serial S45PNA0M512345) = %v, want InvalidArgument listing the disks", err)
	}

	// A regular file, outside file-target mode.
	file := filepath.Join(t.TempDir(), "disk.raw")
	err = layBy("file", file, nil)
	row("rootDiskHint: "+file, err, "")
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "is not a device under /dev") {
		t.Errorf("LayImage(%s) = %v, want InvalidArgument", file, err)
	}
	if _, err := os.Stat(file); !os.IsNotExist(err) {
		t.Errorf("LayImage(%s) refused, yet the file exists: %v", file, err)
	}
}

// follow reads an operation's events until it ends: nil when it
// succeeded, its error when it failed, the stream's error when the call
// was refused.
func follow(s interface {
	Recv() (*agentv1.OperationEvent, error)
}) error {
	for {
		ev, err := s.Recv()
		if err != nil {
			return err
		}
		switch ev.GetState() {
		case agentv1.OperationState_OPERATION_STATE_SUCCEEDED:
			return nil
		case agentv1.OperationState_OPERATION_STATE_FAILED, agentv1.OperationState_OPERATION_STATE_INTERRUPTED:
			return errors.New(ev.GetError())
		}
	}
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
