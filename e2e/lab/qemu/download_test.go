package qemu

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestDownloadKeepsTheOldFileOnACutBody checks that a media download
// replaces the file whole: a body cut short leaves the previous file and
// no temporary file behind.
func TestDownloadKeepsTheOldFileOnACutBody(t *testing.T) {
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/cut.iso" {
			// Promise more than is sent: the client sees an unexpected EOF.
			w.Header().Set("Content-Length", "1000")
			_, _ = w.Write([]byte("part"))
			return
		}
		_, _ = w.Write([]byte("new iso"))
	}))
	defer ts.Close()
	dir := t.TempDir()
	path := filepath.Join(dir, "media.iso")
	require.NoError(t, os.WriteFile(path, []byte("old iso"), 0o644))

	if err := download(context.Background(), ts.URL+"/cut.iso", path); err == nil {
		t.Fatalf("download(cut body) = nil, want an error")
	}
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	if string(b) != "old iso" {
		t.Errorf("after a cut download %s = %q, want the old %q", path, b, "old iso")
	}
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	if len(entries) != 1 {
		t.Errorf("after a cut download the directory holds %d entries, want 1", len(entries))
	}

	require.NoError(t, download(context.Background(), ts.URL+"/a.iso", path))
	b, err = os.ReadFile(path)
	require.NoError(t, err)
	if string(b) != "new iso" {
		t.Errorf("download() wrote %q, want %q", b, "new iso")
	}
}
