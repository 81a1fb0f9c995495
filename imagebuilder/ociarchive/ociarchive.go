// Package ociarchive writes container images as docker-archive tarballs (the
// format of `docker save`) from local files, without a daemon or a registry.
// The result imports with `ctr -n k8s.io images import FILE`.
//
// An archive holds one uncompressed layer, a config JSON whose rootfs diff_id
// is the layer's sha256, and a manifest.json naming the image. Output is
// deterministic: entries are sorted, parent directories are implied, every
// mtime is the Unix epoch and owners are root, so the same inputs always give
// the same bytes (and the same image ID).
package ociarchive

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"sort"
	"strings"
	"time"

	"github.com/kilnhq/kiln/internal/atomicfile"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// DefaultPath is the PATH every image gets unless Image.Env sets one.
const DefaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// epoch is the mtime of every entry.
var epoch = time.Unix(0, 0).UTC()

// File is one entry of the image's root filesystem. Exactly one of Source,
// Data or Link is used; a File with none of them and Dir set is a directory.
type File struct {
	// Path is the absolute path inside the image, e.g. "/usr/local/bin/etcd".
	Path string
	// Source is a file on the build machine whose content is copied.
	// Symbolic links are followed.
	Source string
	// Data is the literal content, used when Source is empty.
	Data []byte
	// Link makes the entry a symbolic link to this target.
	Link string
	// Dir makes the entry a directory.
	Dir bool
	// Mode is the permission bits; zero means 0755 for directories and
	// sources that are executable, 0644 otherwise.
	Mode fs.FileMode
}

// Image describes one single-layer image.
type Image struct {
	// Ref is the name the image is imported as, e.g.
	// "registry.k8s.io/pause:3.10.1".
	Ref string
	// Entrypoint is the config's Entrypoint; empty leaves it unset.
	Entrypoint []string
	// Env is the config's Env; DefaultPath is added when no PATH is given.
	Env []string
	// Architecture and OS default to "amd64" and "linux".
	Architecture string
	OS           string
	// Files are the layer's contents. /etc/passwd, /etc/group,
	// /etc/nsswitch.conf, /tmp, /var and /run are added unless given.
	Files []File
}

// Manifest is one entry of an archive's manifest.json.
type Manifest struct {
	Config   string   `json:"Config"`
	RepoTags []string `json:"RepoTags"`
	Layers   []string `json:"Layers"`
}

// Config is the image configuration (the subset Kiln writes).
type Config struct {
	Architecture string          `json:"architecture"`
	OS           string          `json:"os"`
	Created      string          `json:"created"`
	Config       ContainerConfig `json:"config"`
	RootFS       RootFS          `json:"rootfs"`
	History      []History       `json:"history"`
}

// ContainerConfig is the runtime part of Config.
type ContainerConfig struct {
	Env        []string `json:"Env,omitempty"`
	Entrypoint []string `json:"Entrypoint,omitempty"`
}

// RootFS lists the layers' uncompressed digests.
type RootFS struct {
	Type    string   `json:"type"`
	DiffIDs []string `json:"diff_ids"`
}

// History is one history entry of Config.
type History struct {
	Created   string `json:"created"`
	CreatedBy string `json:"created_by"`
}

// created is the fixed creation time written in every config.
const created = "1970-01-01T00:00:00Z"

// baseFiles are added to every image unless the caller gives the same path.
func baseFiles() []File {
	return []File{
		{Path: "/etc/passwd", Data: []byte("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")},
		{Path: "/etc/group", Data: []byte("root:x:0:\nnogroup:x:65534:\n")},
		{Path: "/etc/nsswitch.conf", Data: []byte("hosts: files dns\n")},
		{Path: "/tmp", Dir: true, Mode: 0o777 | fs.ModeSticky},
		{Path: "/var", Dir: true},
		{Path: "/run", Dir: true},
	}
}

// WriteFile writes img as a docker-archive to name (mode 0644). The file
// appears atomically (internal/atomicfile: a temporary file in the same
// directory, fsynced and renamed), so an interrupted run never leaves a
// partial archive under name.
// It returns the image's config digest ("sha256:..."), which is the image ID
// containerd shows. Errors are InvalidArgument for a bad Image, NotFound for a
// missing source file, or the I/O error wrapped.
func WriteFile(name string, img Image) (string, error) {
	var id string
	err := atomicfile.WriteFunc(name, 0o644, func(w io.Writer) error {
		var err error
		id, err = Write(w, img)
		return err
	})
	if err != nil {
		return "", fmt.Errorf("archive %s: %w", name, err)
	}
	return id, nil
}

// Write writes img as a docker-archive to w and returns the config digest.
// The layer is spooled to a temporary file first (its size and digest go in
// front of it), so w may be any writer. Errors as for WriteFile.
func Write(w io.Writer, img Image) (string, error) {
	if err := validate(img); err != nil {
		return "", err
	}
	layer, err := os.CreateTemp("", "kiln-layer-*.tar")
	if err != nil {
		return "", fmt.Errorf("image %s: layer spool: %w", img.Ref, err)
	}
	defer func() {
		layer.Close()
		os.Remove(layer.Name())
	}()
	h := sha256.New()
	if err := WriteLayer(io.MultiWriter(layer, h), img.Files); err != nil {
		return "", fmt.Errorf("image %s: %w", img.Ref, err)
	}
	size, err := layer.Seek(0, io.SeekCurrent)
	if err != nil {
		return "", fmt.Errorf("image %s: layer spool: %w", img.Ref, err)
	}
	if _, err := layer.Seek(0, io.SeekStart); err != nil {
		return "", fmt.Errorf("image %s: layer spool: %w", img.Ref, err)
	}
	layerHex := hex.EncodeToString(h.Sum(nil))

	cfg := img.config("sha256:" + layerHex)
	cfgJSON, err := json.Marshal(cfg)
	if err != nil {
		return "", fmt.Errorf("image %s: config: %w", img.Ref, err)
	}
	cfgSum := sha256.Sum256(cfgJSON)
	cfgHex := hex.EncodeToString(cfgSum[:])
	layerName := layerHex + "/layer.tar"
	man, err := json.Marshal([]Manifest{{
		Config:   cfgHex + ".json",
		RepoTags: []string{img.Ref},
		Layers:   []string{layerName},
	}})
	if err != nil {
		return "", fmt.Errorf("image %s: manifest: %w", img.Ref, err)
	}

	tw := tar.NewWriter(w)
	if err := writeBytes(tw, cfgHex+".json", cfgJSON); err != nil {
		return "", fmt.Errorf("image %s: %w", img.Ref, err)
	}
	if err := tw.WriteHeader(&tar.Header{Name: layerHex + "/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: epoch, Format: tar.FormatUSTAR}); err != nil {
		return "", fmt.Errorf("image %s: %w", img.Ref, err)
	}
	if err := tw.WriteHeader(&tar.Header{Name: layerName, Typeflag: tar.TypeReg, Mode: 0o644, Size: size, ModTime: epoch, Format: tar.FormatPAX}); err != nil {
		return "", fmt.Errorf("image %s: %w", img.Ref, err)
	}
	if _, err := io.Copy(tw, layer); err != nil {
		return "", fmt.Errorf("image %s: write layer: %w", img.Ref, err)
	}
	if err := writeBytes(tw, "manifest.json", man); err != nil {
		return "", fmt.Errorf("image %s: %w", img.Ref, err)
	}
	if err := tw.Close(); err != nil {
		return "", fmt.Errorf("image %s: %w", img.Ref, err)
	}
	return "sha256:" + cfgHex, nil
}

func writeBytes(tw *tar.Writer, name string, data []byte) error {
	if err := tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(data)), ModTime: epoch, Format: tar.FormatUSTAR}); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	if _, err := tw.Write(data); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	return nil
}

func validate(img Image) error {
	if img.Ref == "" {
		return errdefs.InvalidArgument("image has no reference")
	}
	if !strings.Contains(path.Base(img.Ref), ":") {
		return errdefs.InvalidArgument("image %q: reference has no tag", img.Ref)
	}
	for _, f := range img.Files {
		if !path.IsAbs(f.Path) || path.Clean(f.Path) != f.Path || f.Path == "/" {
			return errdefs.InvalidArgument("image %q: file path %q is not a clean absolute path", img.Ref, f.Path)
		}
	}
	return nil
}

func (img Image) config(diffID string) Config {
	arch, goos := img.Architecture, img.OS
	if arch == "" {
		arch = "amd64"
	}
	if goos == "" {
		goos = "linux"
	}
	env := append([]string(nil), img.Env...)
	hasPath := false
	for _, e := range env {
		if strings.HasPrefix(e, "PATH=") {
			hasPath = true
		}
	}
	if !hasPath {
		env = append([]string{DefaultPath}, env...)
	}
	return Config{
		Architecture: arch,
		OS:           goos,
		Created:      created,
		Config:       ContainerConfig{Env: env, Entrypoint: img.Entrypoint},
		RootFS:       RootFS{Type: "layers", DiffIDs: []string{diffID}},
		History:      []History{{Created: created, CreatedBy: "kiln-imagebuilder"}},
	}
}

// WriteLayer writes files (plus the base files and every implied parent
// directory) as an uncompressed tar to w, sorted by path, with fixed mtimes
// and root ownership. A later File with the same Path replaces an earlier one.
func WriteLayer(w io.Writer, files []File) error {
	byPath := map[string]File{}
	for _, f := range baseFiles() {
		byPath[f.Path] = f
	}
	for _, f := range files {
		byPath[f.Path] = f
	}
	for p := range byPath {
		for d := path.Dir(p); d != "/"; d = path.Dir(d) {
			if _, ok := byPath[d]; !ok {
				byPath[d] = File{Path: d, Dir: true}
			}
		}
	}
	paths := make([]string, 0, len(byPath))
	for p := range byPath {
		paths = append(paths, p)
	}
	sort.Strings(paths)

	tw := tar.NewWriter(w)
	for _, p := range paths {
		if err := writeEntry(tw, byPath[p]); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return fmt.Errorf("layer: %w", err)
	}
	return nil
}

func writeEntry(tw *tar.Writer, f File) error {
	name := strings.TrimPrefix(f.Path, "/")
	hdr := &tar.Header{Name: name, ModTime: epoch, Uname: "root", Gname: "root", Format: tar.FormatPAX}
	switch {
	case f.Link != "":
		hdr.Typeflag = tar.TypeSymlink
		hdr.Linkname = f.Link
		hdr.Mode = 0o777
		return writeHeader(tw, hdr)
	case f.Dir:
		hdr.Typeflag = tar.TypeDir
		hdr.Name += "/"
		hdr.Mode = int64(modeOr(f.Mode, 0o755))
		if f.Mode&fs.ModeSticky != 0 {
			hdr.Mode |= 0o1000
		}
		return writeHeader(tw, hdr)
	case f.Source != "":
		src, err := os.Open(f.Source)
		if err != nil {
			if os.IsNotExist(err) {
				return errdefs.NotFound("layer file %s: source %s does not exist", f.Path, f.Source)
			}
			return fmt.Errorf("layer file %s: %w", f.Path, err)
		}
		defer src.Close()
		st, err := src.Stat()
		if err != nil {
			return fmt.Errorf("layer file %s: %w", f.Path, err)
		}
		if !st.Mode().IsRegular() {
			return errdefs.InvalidArgument("layer file %s: source %s is not a regular file", f.Path, f.Source)
		}
		def := fs.FileMode(0o644)
		if st.Mode().Perm()&0o111 != 0 {
			def = 0o755
		}
		hdr.Typeflag = tar.TypeReg
		hdr.Mode = int64(modeOr(f.Mode, def))
		hdr.Size = st.Size()
		if err := writeHeader(tw, hdr); err != nil {
			return err
		}
		n, err := io.Copy(tw, src)
		if err != nil {
			return fmt.Errorf("layer file %s: copy %s: %w", f.Path, f.Source, err)
		}
		if n != st.Size() {
			return fmt.Errorf("layer file %s: %s changed size while copying", f.Path, f.Source)
		}
		return nil
	default:
		hdr.Typeflag = tar.TypeReg
		hdr.Mode = int64(modeOr(f.Mode, 0o644))
		hdr.Size = int64(len(f.Data))
		if err := writeHeader(tw, hdr); err != nil {
			return err
		}
		if _, err := io.Copy(tw, bytes.NewReader(f.Data)); err != nil {
			return fmt.Errorf("layer file %s: %w", f.Path, err)
		}
		return nil
	}
}

func writeHeader(tw *tar.Writer, hdr *tar.Header) error {
	if err := tw.WriteHeader(hdr); err != nil {
		return fmt.Errorf("layer file /%s: %w", hdr.Name, err)
	}
	return nil
}

func modeOr(m, def fs.FileMode) fs.FileMode {
	if p := m.Perm(); p != 0 {
		return p
	}
	return def
}
