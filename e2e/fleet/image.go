// Package fleet is the end-to-end fleet lifecycle of the lab: golden
// images laid onto lab hosts (e2e/lab/netns machines), booted from disk
// and driven into a Kubernetes cluster through their installed agents.
//
// LabImage builds the lab's golden image (examples/images/lab.yaml) once
// per input and caches it, for `make lab` and the tests:
//
//	dir, m, err := fleet.LabImage(ctx, fleet.ImageOptions{Agent: "bin/kiln-agent"})
//	// dir/<m.Tag>.raw is the raw disk to serve for block-map laying.
package fleet

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"time"

	"github.com/kilnhq/kiln/imagebuilder/golden"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/imagebuilder/manifest"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/imagebuilder/spec"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/filelock"
)

// ImageOptions configure LabImage.
type ImageOptions struct {
	// Spec is the image spec file (default examples/images/lab.yaml of
	// this source tree).
	Spec string
	// Agent is the kiln-agent binary to install, overriding the spec's
	// agent: (default the spec's, bin/kiln-agent for lab.yaml).
	Agent string
	// TagDate (yyyymmdd) overrides the spec's tagDate: the date in the
	// image's tag, by default the day its OS packages were fetched. Tests
	// set it to a date no example names, to show that nothing depends on
	// the day the examples were written.
	TagDate string
	// CacheDir holds the built images, one directory per key (default
	// ${KILN_CACHE:-/var/cache/kiln}/images).
	CacheDir string
	// KubeTools is the kube-tools cache (default golden's:
	// ${KILN_CACHE:-/var/cache/kiln}/kube-tools); RootfsCacheDir the
	// rootfs cache (default rootfs's).
	KubeTools      kubetools.Cache
	RootfsCacheDir string
	// Progress receives the build's progress lines; nil discards.
	Progress io.Writer
	// Keep and KeepUnused bound the cache after a build: the Keep most
	// recently used entries stay (default DefaultKeep), and of the others
	// those unused for KeepUnused are removed (default DefaultKeepUnused;
	// negative keeps every entry). Each call that returns an entry marks
	// it used. An entry is ≈ 1.3 GiB on disk, and every change of the
	// agent makes a new one.
	Keep       int
	KeepUnused time.Duration
}

// Defaults of ImageOptions.Keep and KeepUnused.
const (
	DefaultKeep       = 3
	DefaultKeepUnused = time.Hour
)

// DefaultLabSpec is examples/images/lab.yaml in the source tree this
// package was built from.
func DefaultLabSpec() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "examples", "images", "lab.yaml")
}

// ImageKey is the cache key of a lab image: a sha256 of the spec file,
// the agent binary's sha256, the kube-tools release (its Kubernetes version) and its
// cache's manifest, and what the builder bakes in (golden.Digest), cut to
// 16 hex digits. Any change to one of them is a new image.
func ImageKey(specBytes []byte, s *spec.Spec, agentSHA256 string, rel kubetools.Release, kubeManifest []byte) string {
	h := sha256.New()
	fmt.Fprintf(h, "kiln-lab-image v1\nspec %x\nagent %s\nkubernetes %s\nkube-tools %x\nbuilder %s\n",
		sha256.Sum256(specBytes), agentSHA256, rel.Kubernetes, sha256.Sum256(kubeManifest),
		golden.Digest(s, rel.Registry+"/pause:"+rel.Pause))
	return hex.EncodeToString(h.Sum(nil))[:16]
}

// LabImage returns the directory holding the built lab image
// (<tag>.raw, <tag>.raw.zst, <tag>.json, <tag>.image.yaml) and its
// manifest, building it into CacheDir/<key>/ when that does not exist
// (ImageKey). A warm call returns at once; concurrent callers (other
// processes too) wait on a lock (CacheDir/<key>.lock) for the one that
// builds. The build goes to CacheDir/.tmp-<key>-<pid>/ and is renamed into
// place when complete, so a failed or interrupted build leaves nothing
// under the key. Building needs root and the caches golden.Build needs;
// its errors are golden.Build's (FailedPrecondition when not root, a tool
// or the kube-tools cache is missing).
func LabImage(ctx context.Context, o ImageOptions) (string, *manifest.Manifest, error) {
	if o.Spec == "" {
		o.Spec = DefaultLabSpec()
	}
	if o.CacheDir == "" {
		o.CacheDir = filepath.Join(rootfs.CacheRoot(), "images")
	}
	if o.KubeTools.Dir == "" {
		o.KubeTools.Dir = filepath.Join(rootfs.CacheRoot(), "kube-tools")
	}
	if o.Progress == nil {
		o.Progress = io.Discard
	}
	if o.KeepUnused == 0 {
		o.KeepUnused = DefaultKeepUnused
	}
	if o.Keep <= 0 {
		o.Keep = DefaultKeep
	}
	specBytes, err := os.ReadFile(o.Spec)
	if err != nil {
		return "", nil, fmt.Errorf("lab image: %w", err)
	}
	s, err := spec.Load(o.Spec)
	if err != nil {
		return "", nil, fmt.Errorf("lab image: %w", err)
	}
	if o.Agent != "" {
		abs, err := filepath.Abs(o.Agent)
		if err != nil {
			return "", nil, fmt.Errorf("lab image: %w", err)
		}
		s.Agent = abs
	}
	if o.TagDate != "" {
		if _, err := time.Parse("20060102", o.TagDate); err != nil || len(o.TagDate) != 8 {
			return "", nil, errdefs.InvalidArgument("lab image: tag date %q: want yyyymmdd", o.TagDate)
		}
		s.TagDate = o.TagDate
		// The tag is part of what is built: another date, another entry.
		specBytes = append(specBytes, "\ntagDate: "+o.TagDate+"\n"...)
	}
	agentSum, err := fileSHA256(s.AgentPath())
	if err != nil {
		return "", nil, errdefs.InvalidArgument("lab image: agent binary %s: %v (build it with `make build`)", s.AgentPath(), err)
	}
	// The kube-tools release the spec names: the pinned one, or the
	// previous minor for upgrades (examples/images/lab-previous.yaml).
	rel, err := kubetools.ReleaseFor(s.KubernetesVersion)
	if err != nil {
		return "", nil, fmt.Errorf("lab image: %s: kubernetesVersion: %w", o.Spec, err)
	}
	kubeManifest, err := os.ReadFile(filepath.Join(o.KubeTools.VersionDir(rel), "manifest.json"))
	if err != nil {
		return "", nil, errdefs.FailedPrecondition("lab image: kube-tools %s: %v (run: %s)", rel.Kubernetes, err, kubetools.BuildCommand(rel))
	}
	key := ImageKey(specBytes, s, agentSum, rel, kubeManifest)
	dir := filepath.Join(o.CacheDir, key)
	if m, err := cached(dir); err == nil {
		touch(dir)
		return dir, m, nil
	}

	if err := os.MkdirAll(o.CacheDir, 0o755); err != nil {
		return "", nil, fmt.Errorf("lab image: %w", err)
	}
	unlock, err := filelock.Lock(ctx, filepath.Join(o.CacheDir, key+".lock"))
	if err != nil {
		return "", nil, fmt.Errorf("lab image %s: %w", key, err)
	}
	defer unlock()
	if m, err := cached(dir); err == nil { // built while we waited
		touch(dir)
		return dir, m, nil
	}
	tmp := filepath.Join(o.CacheDir, ".tmp-"+key+"-"+strconv.Itoa(os.Getpid()))
	if err := os.RemoveAll(tmp); err != nil {
		return "", nil, fmt.Errorf("lab image %s: %w", key, err)
	}
	defer os.RemoveAll(tmp)
	fmt.Fprintf(o.Progress, "lab image %s: building into %s\n", key, dir)
	res, err := golden.Build(ctx, golden.Options{
		Spec: s, OutDir: tmp, KubeTools: o.KubeTools, Release: rel,
		RootfsCacheDir: o.RootfsCacheDir, Progress: o.Progress,
	})
	if err != nil {
		return "", nil, fmt.Errorf("lab image %s: %w", key, err)
	}
	// A directory of multi-gigabyte images, published whole by rename
	// (internal/atomicfile writes single files).
	if err := os.Rename(tmp, dir); err != nil {
		return "", nil, fmt.Errorf("lab image %s: %w", key, err)
	}
	if d, err := os.Open(o.CacheDir); err == nil {
		_ = d.Sync()
		d.Close()
	}
	if o.KeepUnused > 0 {
		for _, old := range prune(o.CacheDir, key, o.Keep, time.Now().Add(-o.KeepUnused)) {
			fmt.Fprintf(o.Progress, "lab image: removed %s (unused for %s)\n", old, o.KeepUnused)
		}
	}
	return dir, res.Manifest, nil
}

// touch marks a cache entry used now.
func touch(dir string) {
	now := time.Now()
	_ = os.Chtimes(dir, now, now)
}

// prune removes the entries of cacheDir (key directories and their lock
// files) other than the just built one (newKey) and the keep most recently
// used ones (newKey among them) that were last used before cutoff, and
// returns them. Work directories of builds in progress (.tmp-*) are left
// alone.
func prune(cacheDir, newKey string, keep int, cutoff time.Time) []string {
	entries, err := os.ReadDir(cacheDir)
	if err != nil {
		return nil
	}
	type entry struct {
		name string
		used time.Time
	}
	var es []entry
	for _, e := range entries {
		if !e.IsDir() || e.Name() == newKey || !isKey(e.Name()) {
			continue
		}
		if info, err := e.Info(); err == nil {
			es = append(es, entry{e.Name(), info.ModTime()})
		}
	}
	slices.SortFunc(es, func(a, b entry) int { return b.used.Compare(a.used) }) // newest first
	var removed []string
	for i, e := range es {
		if i < keep-1 || !e.used.Before(cutoff) {
			continue
		}
		p := filepath.Join(cacheDir, e.name)
		if os.RemoveAll(p) == nil {
			_ = os.Remove(p + ".lock")
			removed = append(removed, p)
		}
	}
	return removed
}

// isKey says whether name is an ImageKey (16 lowercase hex digits).
func isKey(name string) bool {
	if len(name) != 16 {
		return false
	}
	for _, c := range name {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// cached reads the manifest of a complete cache entry: the directory
// exists only once renamed into place, with exactly one manifest.
func cached(dir string) (*manifest.Manifest, error) {
	ms, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		return nil, err
	}
	if len(ms) != 1 {
		return nil, errdefs.NotFound("no lab image in %s", dir)
	}
	m, err := manifest.Read(ms[0])
	if err != nil {
		return nil, err
	}
	raw, _, _, _ := golden.FileNames(m.Tag)
	if st, err := os.Stat(filepath.Join(dir, raw)); err != nil || uint64(st.Size()) != m.RawSize {
		return nil, errdefs.NotFound("lab image %s: %s missing or not %d bytes", dir, raw, m.RawSize)
	}
	return m, nil
}

func fileSHA256(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
