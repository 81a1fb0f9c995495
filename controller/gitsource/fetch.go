package gitsource

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"path"
	"path/filepath"
	"slices"
	"strings"

	"github.com/go-git/go-git/v5"
	"github.com/go-git/go-git/v5/plumbing"
	"github.com/go-git/go-git/v5/plumbing/object"
	"github.com/go-git/go-git/v5/storage/memory"

	"github.com/kilnhq/kiln/controller/gitplan"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/manifest"
)

// Limits of what one revision may hold, so that a repository cannot
// exhaust the controller's memory.
const (
	MaxFileBytes  = 4 << 20
	MaxTotalBytes = 32 << 20
)

// Fetcher reads the YAML files under a path of a branch's head commit.
type Fetcher interface {
	// Fetch returns the head commit of spec.Branch and its *.yaml and
	// *.yml files under spec.Path, recursively, by path (relative to the
	// repository), sorted. It returns NotFound when the branch or path
	// does not exist, InvalidArgument when the files pass the limits, and
	// Unavailable when the repository cannot be reached.
	Fetch(ctx context.Context, spec gitplan.Spec) (commit string, files []manifest.File, err error)
}

// GoGit fetches with go-git: a file:// repository is opened where it lies
// (no clone, no git binary); git://, http:// and https:// repositories
// are cloned into memory, one commit deep, on every fetch.
type GoGit struct {
	// FileRoots are the directories under which a file:// repository may
	// lie (kiln-controller --gitsource-file-root). With none, file:// is
	// refused: a GitSource is read with the controller's own access to
	// its machine's files.
	FileRoots []string
}

var _ Fetcher = GoGit{}

// allowFile returns the resolved path of a file:// repository at p when
// it lies under one of the roots (after symbolic links), and
// PermissionDenied otherwise, saying the same whether p exists or not.
func (g GoGit) allowFile(p string) (string, error) {
	refuse := errdefs.PermissionDenied("file://%s is not under a directory this controller allows for file:// GitSources (kiln-controller --gitsource-file-root DIR; allowed now: %s): use an https:// repository, or start the controller with that flag", p, rootsList(g.FileRoots))
	if !filepath.IsAbs(p) {
		return "", refuse
	}
	resolved, err := filepath.EvalSymlinks(filepath.Clean(p))
	if err != nil {
		return "", refuse
	}
	for _, root := range g.FileRoots {
		r, err := filepath.EvalSymlinks(filepath.Clean(root))
		if err != nil {
			continue
		}
		if resolved == r || strings.HasPrefix(resolved, strings.TrimSuffix(r, "/")+"/") {
			return resolved, nil
		}
	}
	return "", refuse
}

func rootsList(roots []string) string {
	if len(roots) == 0 {
		return "none"
	}
	return strings.Join(roots, ", ")
}

// Fetch implements Fetcher. It blocks until the clone ends or ctx does.
func (g GoGit) Fetch(ctx context.Context, spec gitplan.Spec) (string, []manifest.File, error) {
	u, err := url.Parse(spec.URL)
	if err != nil {
		return "", nil, errdefs.InvalidArgument("url: %w", err)
	}
	ref := plumbing.NewBranchReferenceName(spec.Branch)
	var repo *git.Repository
	if u.Scheme == "file" {
		dir, err := g.allowFile(u.Path)
		if err != nil {
			return "", nil, err
		}
		repo, err = git.PlainOpenWithOptions(dir, &git.PlainOpenOptions{DetectDotGit: false})
		if err != nil {
			return "", nil, errdefs.NotFound("open repository %s: %w", u.Path, err)
		}
	} else {
		repo, err = git.CloneContext(ctx, memory.NewStorage(), nil, &git.CloneOptions{
			URL: spec.URL, ReferenceName: ref, SingleBranch: true, Depth: 1, NoCheckout: true, Tags: git.NoTags,
		})
		if err != nil {
			if errors.Is(err, plumbing.ErrReferenceNotFound) {
				return "", nil, errdefs.NotFound("branch %q: %w", spec.Branch, err)
			}
			return "", nil, errdefs.Unavailable("clone %s: %w", redact(u), err)
		}
	}
	r, err := repo.Reference(ref, true)
	if err != nil {
		return "", nil, errdefs.NotFound("branch %q: %w", spec.Branch, err)
	}
	commit, err := repo.CommitObject(r.Hash())
	if err != nil {
		return "", nil, fmt.Errorf("commit %s: %w", r.Hash(), err)
	}
	files, err := readTree(commit, spec.Path)
	return r.Hash().String(), files, err
}

// readTree reads the manifests under dir of commit's tree.
func readTree(commit *object.Commit, dir string) ([]manifest.File, error) {
	tree, err := commit.Tree()
	if err != nil {
		return nil, fmt.Errorf("commit %s: tree: %w", commit.Hash, err)
	}
	if dir != "" {
		if tree, err = tree.Tree(dir); err != nil {
			return nil, errdefs.NotFound("commit %s: path %q: %w", commit.Hash, dir, err)
		}
	}
	var files []manifest.File
	var total int64
	err = tree.Files().ForEach(func(f *object.File) error {
		if !manifest.Manifest(f.Name) || hidden(f.Name) {
			return nil
		}
		if f.Size > MaxFileBytes {
			return errdefs.InvalidArgument("%s: %d bytes, more than the %d a manifest may hold", path.Join(dir, f.Name), f.Size, MaxFileBytes)
		}
		if total += f.Size; total > MaxTotalBytes {
			return errdefs.InvalidArgument("the manifests under %q hold more than %d bytes", dir, MaxTotalBytes)
		}
		rd, err := f.Reader()
		if err != nil {
			return err
		}
		defer rd.Close()
		data, err := io.ReadAll(io.LimitReader(rd, MaxFileBytes+1))
		if err != nil {
			return err
		}
		files = append(files, manifest.File{Name: path.Join(dir, f.Name), Data: data})
		return nil
	})
	if err != nil {
		return nil, err
	}
	slices.SortFunc(files, func(a, b manifest.File) int { return strings.Compare(a.Name, b.Name) })
	return files, nil
}

// hidden reports whether a path has a component starting with ".".
func hidden(p string) bool {
	for _, c := range strings.Split(p, "/") {
		if strings.HasPrefix(c, ".") {
			return true
		}
	}
	return false
}

// redact drops credentials from a URL for messages.
func redact(u *url.URL) string {
	c := *u
	c.User = nil
	return c.String()
}
