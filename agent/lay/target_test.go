package lay

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// TestRefusesFileTargetOutsideFileMode: without --file-targets, a regular
// file is never laid into or wiped, and a path that does not exist is not
// created (a hint that names no disk once laid the image into a new file
// and reported success).
func TestRefusesFileTargetOutsideFileMode(t *testing.T) {
	img := makeImage(1<<20, 3)
	srv := newImageServer(t, img, nil)
	old := bytes.Repeat([]byte{0xAB}, 2<<20)
	existing := tempTarget(t)
	require.NoError(t, os.WriteFile(existing, old, 0o600))
	missing := tempTarget(t)
	l := testLayer(t, WithFileTargets(false))

	for _, target := range []string{existing, missing} {
		_, err := l.Lay(context.Background(), &agentv1.LayImageRequest{Url: srv.url(), Sha256: hexsum(img), Target: target}, nil)
		t.Logf("Lay(%s) = %v", target, err)
		if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "not a block device") || !strings.Contains(err.Error(), "--file-targets") {
			t.Errorf("Lay(%s) without file-target mode = %v, want InvalidArgument saying it is not a block device", target, err)
		}
		err = l.Wipe(context.Background(), target, nil)
		if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "not a block device") {
			t.Errorf("Wipe(%s) without file-target mode = %v, want InvalidArgument saying it is not a block device", target, err)
		}
	}
	if got, err := os.ReadFile(existing); err != nil || !bytes.Equal(got, old) {
		t.Errorf("Lay(%s) refused, yet the file changed (err %v)", existing, err)
	}
	if _, err := os.Stat(missing); !os.IsNotExist(err) {
		t.Errorf("Lay(%s) refused, yet the file was created: stat = %v", missing, err)
	}
	if srv.sent.Load() != 0 {
		t.Errorf("Lay refused, yet %d bytes of the image were fetched", srv.sent.Load())
	}

	// A missing device under /dev is NotFound, in either mode.
	for _, files := range []bool{false, true} {
		_, err := testLayer(t, WithFileTargets(files)).Lay(context.Background(), &agentv1.LayImageRequest{Url: srv.url(), Sha256: hexsum(img), Target: "/dev/kiln-no-such-disk"}, nil)
		if !errdefs.IsNotFound(err) {
			t.Errorf("Lay(/dev/kiln-no-such-disk, file targets %v) = %v, want NotFound", files, err)
		}
	}

	// The lab's mode lays into the same file.
	_, err := testLayer(t, WithFileTargets(true)).Lay(context.Background(), &agentv1.LayImageRequest{Url: srv.url(), Sha256: hexsum(img), Target: existing}, nil)
	require.NoError(t, err, "Lay(%s) in file-target mode", existing)
}
