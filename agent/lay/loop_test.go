package lay

import (
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/imagebuilder/manifest"
	"github.com/kilnhq/kiln/internal/testenv"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// loopDevice attaches a new file of size bytes, filled with 0xAB (old
// data), to a free loop device and detaches it at cleanup.
// Equivalent to: `losetup --find --show FILE`.
func loopDevice(t *testing.T, size int) string {
	t.Helper()
	if os.Geteuid() != 0 {
		testenv.Skip(t, "loop devices need root")
	}
	need(t, "losetup")
	backing := tempTarget(t)
	require.NoError(t, os.WriteFile(backing, bytes.Repeat([]byte{0xAB}, size), 0o600))
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
	return dev
}

func TestLayAndWipeLoopDevice(t *testing.T) {
	const size = 16 << 20
	dev := loopDevice(t, size)
	img := makeImage(6<<20+4096, 20)
	srv := newImageServer(t, img, func(s *imageServer) { s.dropAfter = 2 << 20; s.drops.Store(1) })

	var steps []string
	res, err := testLayer(t).Lay(context.Background(), &agentv1.LayImageRequest{
		Url: srv.url(), Sha256: hexsum(img), Target: dev, RawSize: uint64(len(img)),
	}, func(p *agentv1.Progress) { steps = append(steps, p.GetStep()) })
	require.NoError(t, err)
	t.Logf("Lay(%s) = %v; steps %q", dev, res, steps)

	f, err := os.Open(dev)
	require.NoError(t, err)
	defer f.Close()
	got := make([]byte, size)
	_, err = io.ReadFull(f, got)
	require.NoError(t, err)
	if !bytes.Equal(got[:len(img)], img) {
		t.Errorf("Lay(%s): the device does not hold the image", dev)
	}
	// Beyond the image: discarded (zeros), or the old data where the
	// device cannot discard; never anything else.
	tail := got[len(img):]
	if !bytes.Equal(tail, make([]byte, len(tail))) && !bytes.Equal(tail, bytes.Repeat([]byte{0xAB}, len(tail))) {
		t.Errorf("Lay(%s): the bytes beyond the image are neither discarded nor untouched", dev)
	}

	// An image larger than the device is refused before anything is written.
	_, err = testLayer(t).Lay(context.Background(), &agentv1.LayImageRequest{
		Url: srv.url(), Sha256: hexsum(img), Target: dev, RawSize: size + 1,
	}, nil)
	if err == nil || !strings.Contains(err.Error(), "smaller than the image") {
		t.Errorf("Lay(image larger than %s) = %v, want a target-too-small error", dev, err)
	}

	need(t, "blkid", "sfdisk")
	run(t, "label: gpt\n,,L\n", "sfdisk", "-q", "--no-reread", dev)
	require.Contains(t, signatures(t, dev), "PTTYPE=gpt")
	require.NoError(t, testLayer(t).Wipe(context.Background(), dev, nil))
	if s := signatures(t, dev); s != "" {
		t.Errorf("Wipe(%s): blkid still finds %q", dev, s)
	}
}

func TestLayBlockMapLoopDevice(t *testing.T) {
	const size = 16 << 20
	dev := loopDevice(t, size) // holds 0xAB everywhere: old data
	img, src := sparseImage(t, 12<<20, 512<<10, 2<<20)
	ranges, err := manifest.BlockMap(context.Background(), src, 4096)
	require.NoError(t, err)
	srv := newImageServer(t, img, nil)
	res, err := testLayer(t).Lay(context.Background(), &agentv1.LayImageRequest{
		Url: srv.url(), Target: dev, BlockMap: toBlockMap(ranges), RawSize: uint64(len(img)), RawSha256: hexsum(img),
	}, nil)
	require.NoError(t, err)
	if res.GetBytesFetched() != uint64(srv.sent.Load()) || srv.sent.Load() > int64(len(img))/3 {
		t.Errorf("Lay(block map onto %s) fetched %d bytes (server sent %d) of a %d-byte image with %d data ranges", dev, res.GetBytesFetched(), srv.sent.Load(), len(img), len(ranges))
	}
	f, err := os.Open(dev)
	require.NoError(t, err)
	defer f.Close()
	got := make([]byte, len(img))
	_, err = io.ReadFull(f, got)
	require.NoError(t, err)
	if !bytes.Equal(got, img) {
		t.Errorf("Lay(block map onto %s): the device does not hold the image (old data left in the holes?)", dev)
	}
}
