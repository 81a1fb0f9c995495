package bootserver_test

import (
	"bytes"
	"net/http"
	"os/exec"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/bootserver"
	"github.com/kilnhq/kiln/internal/testenv"
)

// TestHostISOIsReproducible builds a host's ISO (bootmedia.BuildISO) on
// two boot servers, at different times, with the same boot media, token
// and SOURCE_DATE_EPOCH: the bytes are the same. Another token gives
// another ISO.
func TestHostISOIsReproducible(t *testing.T) {
	for _, tool := range []string{"grub-mkimage", "xorriso", "mformat", "mcopy"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (apt-get install grub-common grub-pc-bin grub-efi-amd64-bin xorriso mtools)", tool)
		}
	}
	t.Setenv("SOURCE_DATE_EPOCH", "1764633600")
	dir, _ := media(t)
	const token = "abc001.secret0000000000001"
	fetch := func(tok string) []byte {
		t.Helper()
		_, ts := newServer(t, bootserver.Options{MediaDir: dir, Tokens: &issuer{token: tok}, ISOCacheDir: t.TempDir()})
		resp, body := get(t, bootserver.ISOURL(ts.URL, "vm1"))
		require.Equal(t, http.StatusOK, resp.StatusCode, string(body))
		return body
	}
	a := fetch(token)
	for now := time.Now().Unix(); time.Now().Unix() == now; {
		time.Sleep(50 * time.Millisecond)
	}
	b := fetch(token)
	if !bytes.Equal(a, b) {
		t.Errorf("two ISOs of vm1 with the same media, token and SOURCE_DATE_EPOCH differ (%d and %d bytes)", len(a), len(b))
	}
	if c := fetch("abc002.secret0000000000002"); bytes.Equal(a, c) {
		t.Errorf("ISOs with two tokens are identical")
	}
}
