package ociarchive

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// entry is one parsed tar entry.
type entry struct {
	hdr  *tar.Header
	data []byte
}

// readTar parses a tar stream into its entries, in order.
func readTar(t *testing.T, b []byte) ([]string, map[string]entry) {
	t.Helper()
	tr := tar.NewReader(bytes.NewReader(b))
	var order []string
	m := map[string]entry{}
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
		data, err := io.ReadAll(tr)
		require.NoError(t, err)
		order = append(order, hdr.Name)
		m[hdr.Name] = entry{hdr: hdr, data: data}
	}
	return order, m
}

// parsed is an archive read back the way an importer reads it.
type parsed struct {
	manifest []Manifest
	config   Config
	configID string
	layer    []byte
	files    []string
	entries  map[string]entry
}

func parseArchive(t *testing.T, b []byte) parsed {
	t.Helper()
	_, outer := readTar(t, b)
	var p parsed
	require.Contains(t, outer, "manifest.json")
	require.NoError(t, json.Unmarshal(outer["manifest.json"].data, &p.manifest))
	require.Len(t, p.manifest, 1)
	cfg, ok := outer[p.manifest[0].Config]
	require.True(t, ok, "config %s named by manifest.json is missing", p.manifest[0].Config)
	require.NoError(t, json.Unmarshal(cfg.data, &p.config))
	sum := sha256.Sum256(cfg.data)
	p.configID = "sha256:" + hex.EncodeToString(sum[:])
	require.Len(t, p.manifest[0].Layers, 1)
	layer, ok := outer[p.manifest[0].Layers[0]]
	require.True(t, ok, "layer %s named by manifest.json is missing", p.manifest[0].Layers[0])
	p.layer = layer.data
	p.files, p.entries = readTar(t, p.layer)
	return p
}

func testImage(t *testing.T) Image {
	t.Helper()
	dir := t.TempDir()
	bin := filepath.Join(dir, "tool")
	require.NoError(t, os.WriteFile(bin, []byte("#!/bin/true\nbinary"), 0o755))
	lib := filepath.Join(dir, "libx.so.1")
	require.NoError(t, os.WriteFile(lib, []byte("library"), 0o644))
	return Image{
		Ref:        "registry.k8s.io/example/tool:v1.2.3",
		Entrypoint: []string{"/usr/local/bin/tool"},
		Env:        []string{"LD_LIBRARY_PATH=/lib/x86_64-linux-gnu"},
		Files: []File{
			{Path: "/usr/local/bin/tool", Source: bin},
			{Path: "/lib/x86_64-linux-gnu/libx.so.1", Source: lib},
			{Path: "/usr/sbin/tool-alias", Link: "/usr/local/bin/tool"},
			{Path: "/etc/tool.conf", Data: []byte("a=b\n"), Mode: 0o600},
		},
	}
}

func TestWriteStructure(t *testing.T) {
	img := testImage(t)
	var buf bytes.Buffer
	id, err := Write(&buf, img)
	require.NoError(t, err)
	p := parseArchive(t, buf.Bytes())

	if got := p.manifest[0].RepoTags; !slices.Equal(got, []string{img.Ref}) {
		t.Errorf("RepoTags = %v, want [%s]", got, img.Ref)
	}
	layerSum := sha256.Sum256(p.layer)
	wantDiff := "sha256:" + hex.EncodeToString(layerSum[:])
	if got := p.config.RootFS.DiffIDs; !slices.Equal(got, []string{wantDiff}) {
		t.Errorf("config diff_ids = %v, want [%s] (sha256 of the layer)", got, wantDiff)
	}
	if want := hex.EncodeToString(layerSum[:]) + "/layer.tar"; p.manifest[0].Layers[0] != want {
		t.Errorf("manifest layer = %s, want %s", p.manifest[0].Layers[0], want)
	}
	if id != p.configID {
		t.Errorf("Write() id = %s, want the config digest %s", id, p.configID)
	}
	if p.config.Architecture != "amd64" || p.config.OS != "linux" || p.config.RootFS.Type != "layers" {
		t.Errorf("config platform = %s/%s rootfs %s, want linux/amd64 layers", p.config.OS, p.config.Architecture, p.config.RootFS.Type)
	}
	if got := p.config.Config.Entrypoint; !slices.Equal(got, img.Entrypoint) {
		t.Errorf("Entrypoint = %v, want %v", got, img.Entrypoint)
	}
	if got, want := p.config.Config.Env, []string{DefaultPath, "LD_LIBRARY_PATH=/lib/x86_64-linux-gnu"}; !slices.Equal(got, want) {
		t.Errorf("Env = %v, want %v", got, want)
	}

	if !slices.IsSorted(p.files) {
		t.Errorf("layer entries are not sorted: %v", p.files)
	}
	for _, name := range p.files {
		h := p.entries[name].hdr
		if !h.ModTime.Equal(epoch) || h.Uid != 0 || h.Gid != 0 {
			t.Errorf("layer entry %s: mtime %v uid %d gid %d, want epoch and root", name, h.ModTime, h.Uid, h.Gid)
		}
	}
	tests := []struct {
		name     string
		typeflag byte
		mode     int64
		data     string
		link     string
	}{
		{name: "usr/local/bin/tool", typeflag: tar.TypeReg, mode: 0o755, data: "#!/bin/true\nbinary"},
		{name: "lib/x86_64-linux-gnu/libx.so.1", typeflag: tar.TypeReg, mode: 0o644, data: "library"},
		{name: "usr/sbin/tool-alias", typeflag: tar.TypeSymlink, mode: 0o777, link: "/usr/local/bin/tool"},
		{name: "etc/tool.conf", typeflag: tar.TypeReg, mode: 0o600, data: "a=b\n"},
		{name: "etc/passwd", typeflag: tar.TypeReg, mode: 0o644, data: "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"},
		{name: "usr/", typeflag: tar.TypeDir, mode: 0o755},
		{name: "usr/local/bin/", typeflag: tar.TypeDir, mode: 0o755},
		{name: "lib/x86_64-linux-gnu/", typeflag: tar.TypeDir, mode: 0o755},
		{name: "tmp/", typeflag: tar.TypeDir, mode: 0o1777},
	}
	for _, tt := range tests {
		e, ok := p.entries[tt.name]
		if !ok {
			t.Errorf("layer entry %q missing; have %v", tt.name, p.files)
			continue
		}
		if e.hdr.Typeflag != tt.typeflag || e.hdr.Mode != tt.mode || string(e.data) != tt.data || e.hdr.Linkname != tt.link {
			t.Errorf("layer entry %q = type %c mode %o data %q link %q, want type %c mode %o data %q link %q",
				tt.name, e.hdr.Typeflag, e.hdr.Mode, e.data, e.hdr.Linkname, tt.typeflag, tt.mode, tt.data, tt.link)
		}
	}
}

func TestWriteDeterministic(t *testing.T) {
	img := testImage(t)
	var a, b bytes.Buffer
	idA, err := Write(&a, img)
	require.NoError(t, err)
	// The same files given in another order must give the same bytes.
	slices.Reverse(img.Files)
	idB, err := Write(&b, img)
	require.NoError(t, err)
	if idA != idB || !bytes.Equal(a.Bytes(), b.Bytes()) {
		t.Errorf("Write() twice: ids %s and %s, equal bytes %v; want identical output", idA, idB, bytes.Equal(a.Bytes(), b.Bytes()))
	}
}

func TestWriteErrors(t *testing.T) {
	tests := []struct {
		name string
		img  Image
		is   func(error) bool
	}{
		{name: "no ref", img: Image{}, is: errdefs.IsInvalidArgument},
		{name: "no tag", img: Image{Ref: "registry.k8s.io/pause"}, is: errdefs.IsInvalidArgument},
		{name: "relative path", img: Image{Ref: "x:1", Files: []File{{Path: "bin/x", Data: []byte("x")}}}, is: errdefs.IsInvalidArgument},
		{name: "unclean path", img: Image{Ref: "x:1", Files: []File{{Path: "/bin/../x", Data: []byte("x")}}}, is: errdefs.IsInvalidArgument},
		{name: "missing source", img: Image{Ref: "x:1", Files: []File{{Path: "/bin/x", Source: "/nonexistent/kiln/x"}}}, is: errdefs.IsNotFound},
		{name: "source is a directory", img: Image{Ref: "x:1", Files: []File{{Path: "/bin/x", Source: os.TempDir()}}}, is: errdefs.IsInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Write(io.Discard, tt.img)
			if err == nil || !tt.is(err) {
				t.Errorf("Write(%q) = %v, want an error of the right class", tt.name, err)
			}
		})
	}
}

func TestWriteFileAtomic(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "tool.tar")
	img := testImage(t)
	id, err := WriteFile(out, img)
	require.NoError(t, err)
	before, err := os.ReadFile(out)
	require.NoError(t, err)
	if p := parseArchive(t, before); p.configID != id {
		t.Errorf("WriteFile() id = %s, archive config digest %s", id, p.configID)
	}

	// A failing write must leave the previous archive untouched and no
	// temporary file behind.
	bad := img
	bad.Files = append(slices.Clone(img.Files), File{Path: "/bin/missing", Source: filepath.Join(dir, "missing")})
	_, err = WriteFile(out, bad)
	require.Error(t, err)
	after, err := os.ReadFile(out)
	require.NoError(t, err)
	if !bytes.Equal(before, after) {
		t.Errorf("WriteFile(%q) after a failed write changed the existing archive", out)
	}
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	if len(ents) != 1 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("directory after failed WriteFile = %v, want only tool.tar", names)
	}
}
