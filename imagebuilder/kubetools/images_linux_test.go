package kubetools

import (
	"archive/tar"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/imagebuilder/ociarchive"
	"github.com/kilnhq/kiln/internal/testenv"
)

// extractLayer writes the image's layer into dir, as a runtime unpacks it.
func extractLayer(t *testing.T, img ociarchive.Image, dir string) {
	t.Helper()
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(ociarchive.WriteLayer(pw, img.Files)) }()
	tr := tar.NewReader(pr)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return
		}
		require.NoError(t, err)
		p := filepath.Join(dir, hdr.Name)
		switch hdr.Typeflag {
		case tar.TypeDir:
			require.NoError(t, os.MkdirAll(p, os.FileMode(hdr.Mode).Perm()))
		case tar.TypeSymlink:
			require.NoError(t, os.Symlink(hdr.Linkname, p))
		case tar.TypeReg:
			f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY, os.FileMode(hdr.Mode).Perm())
			require.NoError(t, err)
			_, err = io.Copy(f, tr)
			require.NoError(t, err)
			require.NoError(t, f.Close())
		}
	}
}

// TestKubeProxyImageTools unpacks the kube-proxy image and runs its
// iptables and conntrack inside it (chroot): every library they load,
// including libm for the statistic match kube-proxy uses, must be in the
// image.
func TestKubeProxyImageTools(t *testing.T) {
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root to chroot into the unpacked image")
	}
	host := DebianHostTools("amd64")
	for _, p := range []string{host.Xtables, host.Conntrack, "/usr/bin/ldd"} {
		if _, err := os.Stat(p); err != nil {
			testenv.Skipf(t, "needs %s (Debian packages iptables, conntrack, libc-bin): %v", p, err)
		}
	}
	binDir := t.TempDir()
	for _, name := range Binaries() {
		require.NoError(t, os.WriteFile(filepath.Join(binDir, name), []byte("fake "+name), 0o755))
	}
	imgs, err := Images(context.Background(), Pinned(), binDir, host, ExecRunner{})
	require.NoError(t, err)
	var refs []string
	var proxy ociarchive.Image
	for _, ni := range imgs {
		refs = append(refs, ni.Image.Ref)
		if ni.Name == KubeProxy {
			proxy = ni.Image
		}
	}
	if want := ImageRefs(Pinned()); !slices.Equal(refs, want) {
		t.Errorf("Images() refs = %v, want %v", refs, want)
	}

	root := t.TempDir()
	extractLayer(t, proxy, root)
	var env []string
	for _, e := range proxy.Env {
		env = append(env, e)
	}
	tests := []struct {
		args []string
		want string
	}{
		{args: []string{"/usr/sbin/iptables", "--version"}, want: "nf_tables"},
		{args: []string{"/usr/sbin/ip6tables-restore", "--version"}, want: "nf_tables"},
		// Loads libxt_statistic.so, which needs libm.so.6.
		{args: []string{"/usr/sbin/iptables", "-m", "statistic", "--help"}, want: "statistic match options"},
		{args: []string{"/usr/sbin/conntrack", "--version"}, want: "conntrack"},
	}
	for _, tt := range tests {
		cmd := exec.Command(tt.args[0], tt.args[1:]...)
		cmd.Env = env
		cmd.Dir = "/"
		cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: root}
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), tt.want) {
			t.Errorf("in the kube-proxy image, %s = %q, %v; want output containing %q", strings.Join(tt.args, " "), out, err, tt.want)
		}
	}
	if _, err := os.Stat(filepath.Join(root, "usr/local/bin/kube-proxy")); err != nil {
		t.Errorf("kube-proxy image lacks /usr/local/bin/kube-proxy: %v", err)
	}
}

func TestWriteArchivesIncremental(t *testing.T) {
	host := DebianHostTools("amd64")
	for _, p := range []string{host.Xtables, host.Conntrack, "/usr/bin/ldd"} {
		if _, err := os.Stat(p); err != nil {
			testenv.Skipf(t, "needs %s (Debian packages iptables, conntrack, libc-bin): %v", p, err)
		}
	}
	fake := newFakeGo(t)
	b, progress := newTestBuilder(t, fake)
	b.Arch = "amd64"
	ctx := context.Background()
	_, err := b.WriteArchives(ctx)
	require.Error(t, err, "WriteArchives() before the binaries exist")

	_, err = b.Ensure(ctx)
	require.NoError(t, err)
	progress.Reset()
	first, err := b.WriteArchives(ctx)
	require.NoError(t, err)
	var refs []string
	for _, a := range first {
		refs = append(refs, a.Ref)
		require.FileExists(t, a.Path)
	}
	if want := ImageRefs(b.Release); !slices.Equal(refs, want) {
		t.Errorf("WriteArchives() refs = %v, want %v", refs, want)
	}
	if n := strings.Count(progress.String(), "] wrote "); n != 7 {
		t.Errorf("first WriteArchives() wrote %d archives, want 7:\n%s", n, progress.String())
	}

	// Nothing changed: nothing is written. A deleted archive is rewritten,
	// with the same image ID (the output is deterministic).
	require.NoError(t, os.Remove(first[6].Path))
	progress.Reset()
	second, err := b.WriteArchives(ctx)
	require.NoError(t, err)
	if n := strings.Count(progress.String(), "] wrote "); n != 1 || !strings.Contains(progress.String(), "etcd.tar") {
		t.Errorf("second WriteArchives() output:\n%s\nwant only etcd.tar written", progress.String())
	}
	for i := range first {
		if first[i].ID != second[i].ID {
			t.Errorf("archive %s: ID %s then %s, want equal", first[i].Ref, first[i].ID, second[i].ID)
		}
	}
}
