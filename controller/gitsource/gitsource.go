// Package gitsource is the executor of GitSources: on the leader, it
// fetches each source's branch when gitplan says it is due, parses the
// path's YAML, and applies the revision gitplan plans as one store
// transaction (resources.Service.ApplyBatch: every object and prune, or
// none), then records the outcome in the source's status.
//
// Authority: a GitSource is applied with the controller's authority, so
// only an admin may create, change or delete one (package api enforces
// it), a repository may not create GitSources itself (gitplan), and every
// write a revision makes is audited as the caller "gitsource/<name>" with
// the role "controller".
package gitsource

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/audit"
	"github.com/kilnhq/kiln/controller/authz"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/gitplan"
	"github.com/kilnhq/kiln/controller/resources"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/manifest"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Kind is the store kind of GitSources.
const Kind = "gitsources"

// Store is what the executor needs of the store.
type Store interface {
	Get(ctx context.Context, kind, name string, into proto.Message) (int64, error)
	Update(ctx context.Context, kind, name string, m proto.Message, expectRev int64) (int64, error)
	List(ctx context.Context, kind string, newMsg func() proto.Message, opts store.ListOptions) ([]store.Item, string, error)
}

var _ Store = (*store.Store)(nil)

// Resources is what the executor needs of the resources domain.
type Resources interface {
	ApplyBatch(ctx context.Context, objs []*controllerv1.Resource, prunes []resources.Ref, dryRun bool) ([]*controllerv1.ApplyResult, error)
	List(ctx context.Context, kind string, selector map[string]string, limit int64, cont string) ([]*controllerv1.Resource, string, error)
	Get(ctx context.Context, kind, name string) (*controllerv1.Resource, error)
}

var _ Resources = (*resources.Service)(nil)

// Recorder records events.
type Recorder interface {
	Record(ctx context.Context, kind, name, typ, reason, message string)
}

// Deps are the executor's parts.
type Deps struct {
	Store     Store
	Resources Resources
	Fetcher   Fetcher
	Recorder  Recorder
}

// Config tunes the executor.
type Config struct {
	// Tick is how often the executor looks for due sources (each source
	// fetches on its own spec.interval); default 1s.
	Tick time.Duration
	// FetchTimeout bounds one fetch; default 2m.
	FetchTimeout time.Duration
	Clock        func() time.Time
	// FileRoots are the directories file:// repositories may lie under
	// (GoGit.FileRoots); none refuses file://.
	FileRoots []string
}

// Executor syncs GitSources.
type Executor struct {
	deps Deps
	cfg  Config
	log  *slog.Logger
}

// New returns an Executor.
func New(deps Deps, cfg Config, log *slog.Logger) *Executor {
	if cfg.Tick <= 0 {
		cfg.Tick = time.Second
	}
	if cfg.FetchTimeout <= 0 {
		cfg.FetchTimeout = 2 * time.Minute
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if deps.Fetcher == nil {
		deps.Fetcher = GoGit{FileRoots: cfg.FileRoots}
	}
	return &Executor{deps: deps, cfg: cfg, log: log.With("component", "gitsource")}
}

// Run syncs every due source each tick until ctx ends. It returns nil
// then.
func (e *Executor) Run(ctx context.Context) error {
	t := time.NewTicker(e.cfg.Tick)
	defer t.Stop()
	for {
		e.syncDue(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

func (e *Executor) syncDue(ctx context.Context) {
	items, _, err := e.deps.Store.List(ctx, Kind, func() proto.Message { return &typesv1.GitSource{} }, store.ListOptions{})
	if err != nil {
		if ctx.Err() == nil {
			e.log.Warn("list gitsources", "err", err)
		}
		return
	}
	for _, it := range items {
		src := it.Msg.(*typesv1.GitSource)
		if !gitplan.Due(src, e.cfg.Clock()) {
			continue
		}
		if _, err := e.Sync(ctx, it.Name); err != nil && ctx.Err() == nil {
			e.log.Warn("sync gitsource", "gitsource", it.Name, "err", err)
		}
	}
}

// Sync fetches source name once, applies or refuses its revision and
// stores the status, whether or not the source is due. It returns the
// outcome; an error only when the source could not be read or its status
// not stored (a refused revision is an outcome, not an error).
func (e *Executor) Sync(ctx context.Context, name string) (gitplan.Outcome, error) {
	src := &typesv1.GitSource{}
	if _, err := e.deps.Store.Get(ctx, Kind, name, src); err != nil {
		return gitplan.Outcome{}, err
	}
	out := e.sync(ctx, src)
	st, changed := gitplan.Status(src, out, e.cfg.Clock())
	if changed {
		e.event(ctx, name, out)
	}
	// Store the status on the latest object: when an admin changed the
	// spec meanwhile, the status's observed generation (the one acted on)
	// makes the next round fetch again.
	for attempt := 0; ; attempt++ {
		cur := &typesv1.GitSource{}
		rev, err := e.deps.Store.Get(ctx, Kind, name, cur)
		if err != nil {
			return out, err
		}
		cur.Status = st
		if _, err = e.deps.Store.Update(ctx, Kind, name, cur, rev); err == nil || !errdefs.IsConflict(err) || attempt >= 3 {
			return out, err
		}
	}
}

func (e *Executor) event(ctx context.Context, name string, out gitplan.Outcome) {
	if e.deps.Recorder == nil {
		return
	}
	switch {
	case out.FetchError != "":
		e.deps.Recorder.Record(ctx, Kind, name, events.Warning, gitplan.ReasonFetchFailed, out.FetchError)
	case out.Refused != "":
		e.deps.Recorder.Record(ctx, Kind, name, events.Warning, gitplan.ReasonRevisionRefused, "commit "+out.Commit+" refused: "+out.Refused)
	case out.ApplyError != "":
		e.deps.Recorder.Record(ctx, Kind, name, events.Warning, gitplan.ReasonApplyFailed, "commit "+out.Commit+": "+out.ApplyError)
	default:
		e.deps.Recorder.Record(ctx, Kind, name, events.Normal, gitplan.ReasonApplied, fmt.Sprintf("commit %s applied (%d objects)", out.Commit, out.Objects))
	}
}

// sync fetches, plans and applies one revision of src.
func (e *Executor) sync(ctx context.Context, src *typesv1.GitSource) gitplan.Outcome {
	name := src.GetMetadata().GetName()
	spec := gitplan.Defaults(src.GetSpec())
	fctx, cancel := context.WithTimeout(ctx, e.cfg.FetchTimeout)
	commit, files, err := e.deps.Fetcher.Fetch(fctx, spec)
	cancel()
	if err != nil {
		if commit == "" {
			return gitplan.Outcome{FetchError: err.Error()}
		}
		// The commit was read but its files pass the limits or the path
		// is missing: the revision is refused.
		return gitplan.Outcome{Commit: commit, Refused: err.Error()}
	}
	rev := gitplan.Revision{Commit: commit}
	docs, err := validation.ParseManifests(files)
	var merr *manifest.Error
	switch {
	case errors.As(err, &merr):
		rev.Problems = strings.ReplaceAll(merr.Error(), "\n", "; ")
	case err != nil:
		rev.Problems = err.Error()
	}
	for _, d := range docs {
		rev.Objects = append(rev.Objects, gitplan.Object{File: d.File, Resource: d.Resource})
	}
	obs, err := e.observe(ctx, name, rev)
	if err != nil {
		return gitplan.Outcome{Commit: commit, ApplyError: err.Error()}
	}
	plan := gitplan.PlanRevision(name, rev, obs)
	if plan.Refused != "" {
		e.log.Info("revision refused", "gitsource", name, "commit", commit, "why", plan.Refused)
		return gitplan.Outcome{Commit: commit, Refused: plan.Refused}
	}
	call := audit.NewCall(authz.Caller{Role: authz.RoleController, Name: "gitsource/" + name}, "apply", e.cfg.Clock)
	results, err := e.deps.Resources.ApplyBatch(audit.WithCall(ctx, call), plan.Apply, plan.Prune, false)
	if errdefs.IsInvalidArgument(err) || errdefs.IsFailedPrecondition(err) {
		e.log.Info("revision refused", "gitsource", name, "commit", commit, "err", err)
		why := err.Error()
		var oerr *resources.ObjectError
		if errors.As(err, &oerr) && oerr.Index < len(plan.Files) {
			why = plan.Files[oerr.Index] + ": " + why
		}
		return gitplan.Outcome{Commit: commit, Refused: why}
	}
	if err != nil {
		return gitplan.Outcome{Commit: commit, ApplyError: err.Error()}
	}
	for _, r := range results {
		if r.GetAction() != resources.Unchanged {
			e.log.Info("applied from git", "gitsource", name, "commit", commit, "kind", r.GetKind(), "name", r.GetName(), "action", r.GetAction())
		}
	}
	return gitplan.Outcome{Commit: commit, Objects: len(plan.Apply)}
}

// observe lists what the source applied before and which objects of the
// revision another source applies.
func (e *Executor) observe(ctx context.Context, name string, rev gitplan.Revision) (gitplan.Observed, error) {
	obs := gitplan.Observed{OwnedBy: map[resources.Ref]string{}}
	for _, k := range resources.Kinds {
		if k.Plural == Kind {
			continue
		}
		cont := ""
		for {
			items, next, err := e.deps.Resources.List(ctx, k.Plural, map[string]string{resources.GitSourceLabel: name}, 500, cont)
			if err != nil {
				return obs, err
			}
			for _, it := range items {
				_, obj, err := resources.Unwrap(it)
				if err != nil {
					return obs, err
				}
				obs.Owned = append(obs.Owned, resources.Ref{Kind: k.Plural, Name: resources.Meta(obj).GetName()})
			}
			if next == "" {
				break
			}
			cont = next
		}
	}
	for _, o := range rev.Objects {
		k, obj, err := resources.Unwrap(o.Resource)
		if err != nil {
			continue // the planner refuses it
		}
		cur, err := e.deps.Resources.Get(ctx, k.Plural, resources.Meta(obj).GetName())
		if errdefs.IsNotFound(err) {
			continue
		}
		if err != nil {
			return obs, err
		}
		_, cobj, _ := resources.Unwrap(cur)
		if v, ok := resources.Meta(cobj).GetLabels()[resources.GitSourceLabel]; ok {
			obs.OwnedBy[resources.Ref{Kind: k.Plural, Name: resources.Meta(obj).GetName()}] = v
		}
	}
	return obs, nil
}
