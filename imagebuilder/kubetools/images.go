package kubetools

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/kilnhq/kiln/imagebuilder/ociarchive"
	"github.com/kilnhq/kiln/internal/atomicfile"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// NamedImage is an image and the base name of its archive file.
type NamedImage struct {
	// Name is the archive's base name without ".tar", e.g. "kube-proxy".
	Name  string
	Image ociarchive.Image
}

// ImageRefs returns the image names of release r exactly as
// `kubeadm config images list --kubernetes-version <r.Kubernetes>` prints
// them, in its order.
func ImageRefs(r Release) []string {
	reg := r.Registry
	return []string{
		reg + "/kube-apiserver:" + r.Kubernetes,
		reg + "/kube-controller-manager:" + r.Kubernetes,
		reg + "/kube-scheduler:" + r.Kubernetes,
		reg + "/kube-proxy:" + r.Kubernetes,
		reg + "/coredns/coredns:" + r.CoreDNS,
		reg + "/pause:" + r.Pause,
		reg + "/etcd:" + r.Etcd,
	}
}

// HostTools names the files the kube-proxy image copies from the build
// machine (Debian packages iptables and conntrack).
type HostTools struct {
	// Xtables is the iptables multi-call binary in nft mode.
	Xtables string
	// Conntrack is the conntrack tool.
	Conntrack string
	// ExtensionsDir holds the xtables match and target modules (*.so).
	ExtensionsDir string
	// LibDirs is the image's LD_LIBRARY_PATH: the image has no
	// ld.so.cache, so the multiarch directories must be named.
	LibDirs []string
}

// DebianHostTools returns where Debian installs them for arch.
func DebianHostTools(arch string) HostTools {
	triplet := map[string]string{"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}[arch]
	if triplet == "" {
		triplet = arch + "-linux-gnu"
	}
	return HostTools{
		Xtables:       "/usr/sbin/xtables-nft-multi",
		Conntrack:     "/usr/sbin/conntrack",
		ExtensionsDir: "/usr/lib/" + triplet + "/xtables",
		LibDirs:       []string{"/lib/" + triplet, "/usr/lib/" + triplet},
	}
}

// iptablesNames are the commands kube-proxy runs, all links to the
// multi-call binary.
var iptablesNames = []string{
	"iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore",
	"iptables-nft", "iptables-nft-save", "iptables-nft-restore", "ip6tables-nft", "ip6tables-nft-save", "ip6tables-nft-restore",
}

// Images returns the seven images kubeadm pulls for release r, built from
// the binaries in binDir. The kube-proxy image also carries iptables (nft),
// conntrack, the xtables extensions and every shared library they need
// (found with ldd, run through run; libm comes in through the statistic
// match kube-proxy uses with several endpoints). Errors are NotFound when a
// host tool is missing (install Debian's iptables and conntrack).
func Images(ctx context.Context, r Release, binDir string, host HostTools, run Runner) ([]NamedImage, error) {
	refs := ImageRefs(r)
	bin := func(name string) string { return filepath.Join(binDir, name) }
	control := func(name, ref string) NamedImage {
		return NamedImage{Name: name, Image: ociarchive.Image{
			Ref:   ref,
			Files: []ociarchive.File{{Path: "/usr/local/bin/" + name, Source: bin(name)}},
		}}
	}
	imgs := []NamedImage{
		control(KubeAPIServer, refs[0]),
		control(KubeControllerManager, refs[1]),
		control(KubeScheduler, refs[2]),
	}
	proxy, err := kubeProxyImage(ctx, refs[3], bin(KubeProxy), host, run)
	if err != nil {
		return nil, err
	}
	imgs = append(imgs, proxy,
		NamedImage{Name: CoreDNS, Image: ociarchive.Image{
			Ref:        refs[4],
			Entrypoint: []string{"/coredns"},
			Files:      []ociarchive.File{{Path: "/coredns", Source: bin(CoreDNS)}},
		}},
		NamedImage{Name: Pause, Image: ociarchive.Image{
			Ref:        refs[5],
			Entrypoint: []string{"/pause"},
			Files:      []ociarchive.File{{Path: "/pause", Source: bin(Pause)}},
		}},
		// kubeadm's static pod runs "etcd" from PATH.
		control(Etcd, refs[6]),
	)
	return imgs, nil
}

func kubeProxyImage(ctx context.Context, ref, kubeProxy string, host HostTools, run Runner) (NamedImage, error) {
	for _, p := range []string{host.Xtables, host.Conntrack} {
		if _, err := os.Stat(p); err != nil {
			return NamedImage{}, errdefs.NotFound("kube-proxy image: %s is missing (install Debian packages iptables and conntrack): %v", p, err)
		}
	}
	exts, err := filepath.Glob(filepath.Join(host.ExtensionsDir, "*.so"))
	if err != nil || len(exts) == 0 {
		return NamedImage{}, errdefs.NotFound("kube-proxy image: no xtables extensions in %s (install Debian package iptables)", host.ExtensionsDir)
	}
	sort.Strings(exts)
	files := []ociarchive.File{
		{Path: "/usr/local/bin/kube-proxy", Source: kubeProxy},
		{Path: "/usr/sbin/xtables-nft-multi", Source: host.Xtables},
		{Path: "/usr/sbin/conntrack", Source: host.Conntrack},
	}
	for _, name := range iptablesNames {
		files = append(files, ociarchive.File{Path: "/usr/sbin/" + name, Link: "xtables-nft-multi"})
	}
	for _, e := range exts {
		files = append(files, ociarchive.File{Path: e, Source: e})
	}
	libs, err := SharedLibraries(ctx, run, append([]string{host.Xtables, host.Conntrack}, exts...)...)
	if err != nil {
		return NamedImage{}, fmt.Errorf("kube-proxy image: %w", err)
	}
	for _, l := range libs {
		files = append(files, ociarchive.File{Path: l, Source: l})
	}
	return NamedImage{Name: KubeProxy, Image: ociarchive.Image{
		Ref:   ref,
		Env:   []string{ociarchive.DefaultPath, "LD_LIBRARY_PATH=" + strings.Join(host.LibDirs, ":")},
		Files: files,
	}}, nil
}

// SharedLibraries returns the shared libraries (and the dynamic loader) the
// given ELF files load, sorted and without duplicates, as ldd resolves them
// on the build machine. Equivalent to: `ldd FILE...`. A library ldd cannot
// find is a NotFound error.
func SharedLibraries(ctx context.Context, run Runner, files ...string) ([]string, error) {
	if len(files) == 0 {
		return nil, nil
	}
	// One ldd for all files: it prints a "file:" header before each.
	var out bytes.Buffer
	var stderr tailBuffer
	if err := run.Run(ctx, Cmd{Path: "ldd", Args: files, Env: os.Environ(), Stdout: &out, Stderr: &stderr}); err != nil {
		return nil, fmt.Errorf("ldd %s: %w: %s", strings.Join(files, " "), err, stderr.String())
	}
	libs, err := ParseLDD(out.Bytes())
	if err != nil {
		return nil, fmt.Errorf("ldd: %w", err)
	}
	set := map[string]bool{}
	for _, l := range libs {
		set[l] = true
	}
	libs = libs[:0]
	for l := range set {
		libs = append(libs, l)
	}
	sort.Strings(libs)
	return libs, nil
}

// ParseLDD returns the absolute paths in ldd's output: the
// "name => /path (addr)" lines and the loader's "/path (addr)" line. The
// vDSO has no file and is skipped, as are the "file:" headers ldd prints
// when given several files. "name => not found" is a NotFound error.
func ParseLDD(out []byte) ([]string, error) {
	var libs []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.Contains(line, "statically linked") || strings.HasSuffix(line, ":") {
			continue
		}
		if name, rest, ok := strings.Cut(line, "=>"); ok {
			rest = strings.TrimSpace(rest)
			if strings.HasPrefix(rest, "not found") {
				return nil, errdefs.NotFound("shared library %s not found", strings.TrimSpace(name))
			}
			if f := strings.Fields(rest); len(f) > 0 && strings.HasPrefix(f[0], "/") {
				libs = append(libs, f[0])
			}
			continue
		}
		if f := strings.Fields(line); len(f) > 0 && strings.HasPrefix(f[0], "/") {
			libs = append(libs, f[0])
		}
	}
	return libs, sc.Err()
}

// Archive is one written image archive.
type Archive struct {
	Ref  string
	Path string
	// ID is the image's config digest, the ID containerd shows.
	ID   string
	Size int64
}

// IndexFile records, in the images directory, what each archive was
// written from, so that unchanged archives are not written again.
const IndexFile = "index.json"

type indexEntry struct {
	Ref    string `json:"ref"`
	ID     string `json:"id"`
	Size   int64  `json:"size"`
	Inputs string `json:"inputs"`
}

// inputsDigest fingerprints an image's definition and its source files
// (path, size, modification time), like make does.
func inputsDigest(img ociarchive.Image) (string, error) {
	type src struct {
		Path    string
		Size    int64
		ModTime int64
	}
	var srcs []src
	for _, f := range img.Files {
		if f.Source == "" {
			continue
		}
		st, err := os.Stat(f.Source)
		if err != nil {
			return "", err
		}
		srcs = append(srcs, src{f.Source, st.Size(), st.ModTime().UnixNano()})
	}
	j, err := json.Marshal(struct {
		Image   ociarchive.Image
		Sources []src
	}{img, srcs})
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(j)
	return "sha256:" + hex.EncodeToString(sum[:]), nil
}

// WriteArchives writes the release's images as docker-archive tarballs
// into the cache's images directory (<name>.tar), from a cache that
// verifies (checked here unless Ensure just succeeded). Each file appears
// atomically; an archive whose inputs did not
// change since it was written (images/index.json) is kept. Import one with
// `ctr -n k8s.io images import FILE`. Errors as for Cache.Verify and Images.
func (b *Builder) WriteArchives(ctx context.Context) ([]Archive, error) {
	if b.start.IsZero() {
		b.start = time.Now()
	}
	r := b.Release
	if !b.verified {
		if _, err := b.Cache.Verify(r); err != nil {
			return nil, fmt.Errorf("archives (run `make kube-tools` first): %w", err)
		}
	}
	imgs, err := Images(ctx, r, b.Cache.BinDir(r), DebianHostTools(b.arch()), b.runner())
	if err != nil {
		return nil, fmt.Errorf("archives %s: %w", r.Kubernetes, err)
	}
	dir := b.Cache.ImagesDir(r)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("archives %s: %w", r.Kubernetes, err)
	}
	index := map[string]indexEntry{}
	if j, err := os.ReadFile(filepath.Join(dir, IndexFile)); err == nil {
		_ = json.Unmarshal(j, &index) // an unreadable index only costs a rewrite
	}
	var out []Archive
	for _, ni := range imgs {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		p := filepath.Join(dir, ni.Name+".tar")
		inputs, err := inputsDigest(ni.Image)
		if err != nil {
			return nil, fmt.Errorf("archives %s: %s: %w", r.Kubernetes, ni.Name, err)
		}
		if e, ok := index[ni.Name]; ok && e.Inputs == inputs && e.Ref == ni.Image.Ref {
			if st, err := os.Stat(p); err == nil && st.Size() == e.Size {
				b.stepf("%s is up to date (%s)", p, ni.Image.Ref)
				out = append(out, Archive{Ref: e.Ref, Path: p, ID: e.ID, Size: e.Size})
				continue
			}
		}
		id, err := ociarchive.WriteFile(p, ni.Image)
		if err != nil {
			return nil, fmt.Errorf("archives %s: %w", r.Kubernetes, err)
		}
		st, err := os.Stat(p)
		if err != nil {
			return nil, fmt.Errorf("archives %s: %w", r.Kubernetes, err)
		}
		b.stepf("wrote %s (%s, %d MiB)", p, ni.Image.Ref, st.Size()>>20)
		out = append(out, Archive{Ref: ni.Image.Ref, Path: p, ID: id, Size: st.Size()})
		index[ni.Name] = indexEntry{Ref: ni.Image.Ref, ID: id, Size: st.Size(), Inputs: inputs}
		if err := writeIndex(dir, index); err != nil {
			return nil, fmt.Errorf("archives %s: %w", r.Kubernetes, err)
		}
	}
	return out, nil
}

// writeIndex replaces images/index.json atomically.
func writeIndex(dir string, index map[string]indexEntry) error {
	j, err := json.MarshalIndent(index, "", "  ")
	if err != nil {
		return err
	}
	return atomicfile.Write(filepath.Join(dir, IndexFile), append(j, '\n'), 0o644)
}
