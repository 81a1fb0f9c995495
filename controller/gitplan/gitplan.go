// Package gitplan decides what a GitSource does, with no I/O: whether its
// branch is due for a fetch, what a fetched revision applies and prunes
// (or why it is refused whole), and the status that records the outcome.
// The executor (controller/gitsource) fetches, calls these functions,
// writes the plan as one store transaction and stores the status.
package gitplan

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/resources"
	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/conditions"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Condition types and reasons of a GitSource.
const (
	Ready = "Ready"

	ReasonApplied         = "Applied"
	ReasonRevisionRefused = "RevisionRefused"
	ReasonFetchFailed     = "FetchFailed"
	ReasonApplyFailed     = "ApplyFailed"
)

// Spec is a GitSource spec with its defaults filled in.
type Spec struct {
	URL, Branch, Path string
	Interval          time.Duration
}

// Defaults returns s with empty fields defaulted: branch main, path the
// repository's root, interval one minute. The spec is valid
// (validation.Validate passed), so the interval parses.
func Defaults(s *typesv1.GitSourceSpec) Spec {
	out := Spec{URL: s.GetUrl(), Branch: s.GetBranch(), Path: strings.Trim(s.GetPath(), "/"), Interval: validation.DefaultGitInterval}
	if out.Branch == "" {
		out.Branch = validation.DefaultGitBranch
	}
	if out.Path == "." {
		out.Path = ""
	}
	if d, err := time.ParseDuration(s.GetInterval()); err == nil && d > 0 {
		out.Interval = d
	}
	return out
}

// Due reports whether a source should fetch now: it never fetched, its
// spec changed since it last acted, or an interval passed since its last
// fetch.
func Due(src *typesv1.GitSource, now time.Time) bool {
	st := src.GetStatus()
	if st.GetLastFetchTime() == nil || st.GetObservedGeneration() != src.GetMetadata().GetGeneration() {
		return true
	}
	return !now.Before(st.GetLastFetchTime().AsTime().Add(Defaults(src.GetSpec()).Interval))
}

// Object is one resource of a revision and the file it came from.
type Object struct {
	File     string
	Resource *controllerv1.Resource
}

// Revision is a commit's objects under the source's path, or the problems
// that kept its files from parsing.
type Revision struct {
	Commit   string
	Objects  []Object
	Problems string
}

// Observed is the store's side: the objects labelled as this source's
// (what it applied before) and, for every object of the revision that
// exists with another source's label, that source's name.
type Observed struct {
	Owned   []resources.Ref
	OwnedBy map[resources.Ref]string
}

// Plan is what a revision does: apply Apply (each labelled as the
// source's) and delete Prune, in one transaction; or nothing, when Refused
// says why the revision may not be applied.
type Plan struct {
	Apply   []*controllerv1.Resource
	Files   []string // Apply[i] came from Files[i]
	Prune   []resources.Ref
	Refused string
}

// PlanRevision plans a fetched revision of source. A revision is refused
// whole when its files do not parse or validate, when it holds a kind a
// GitSource may not apply (a GitSource: sources are an admin's, not a
// repository's; a Machine: the deployments own them), or when it names an
// object another GitSource applies. Otherwise it applies every object
// with the label kiln.dev/gitsource: source and prunes what the source
// applied before and the revision no longer holds (only of the prunable
// kinds).
func PlanRevision(source string, rev Revision, obs Observed) Plan {
	if rev.Problems != "" {
		return Plan{Refused: rev.Problems}
	}
	var p Plan
	var refusals []string
	named := map[resources.Ref]bool{}
	for _, o := range rev.Objects {
		k, obj, err := resources.Unwrap(o.Resource)
		if err != nil {
			refusals = append(refusals, fmt.Sprintf("%s: %v", o.File, err))
			continue
		}
		md := resources.Meta(obj)
		ref := resources.Ref{Kind: k.Plural, Name: md.GetName()}
		switch {
		case k.Plural == "gitsources":
			refusals = append(refusals, fmt.Sprintf("%s: %s: a GitSource may not apply a GitSource (only an admin creates sources)", o.File, ref))
			continue
		case !slices.Contains(resources.PrunableKinds, k.Plural) && k.Plural != "hosts":
			refusals = append(refusals, fmt.Sprintf("%s: %s: kind %s is not applied from Git", o.File, ref, k.Name))
			continue
		}
		if other, ok := obs.OwnedBy[ref]; ok && other != source {
			refusals = append(refusals, fmt.Sprintf("%s: %s belongs to GitSource %q", o.File, ref, other))
			continue
		}
		if v, ok := md.GetLabels()[resources.GitSourceLabel]; ok && v != source {
			refusals = append(refusals, fmt.Sprintf("%s: %s: label %s: %q is not this source", o.File, ref, resources.GitSourceLabel, v))
			continue
		}
		named[ref] = true
		obj = proto.Clone(obj)
		md = resources.Meta(obj)
		labels := maps.Clone(md.GetLabels())
		if labels == nil {
			labels = map[string]string{}
		}
		labels[resources.GitSourceLabel] = source
		md.Labels = labels
		p.Apply = append(p.Apply, k.Wrap(obj))
		p.Files = append(p.Files, o.File)
	}
	if len(refusals) > 0 {
		return Plan{Refused: strings.Join(refusals, "; ")}
	}
	for _, r := range obs.Owned {
		if !named[r] && slices.Contains(resources.PrunableKinds, r.Kind) {
			p.Prune = append(p.Prune, r)
		}
	}
	slices.SortFunc(p.Prune, func(a, b resources.Ref) int { return strings.Compare(a.Kind+"/"+a.Name, b.Kind+"/"+b.Name) })
	return p
}

// Outcome is what became of one fetch.
type Outcome struct {
	// Commit is the fetched commit ("" when the fetch failed).
	Commit string
	// FetchError, RefusedError or ApplyError says what failed; all empty
	// when the revision was applied (Objects objects).
	FetchError, Refused, ApplyError string
	Objects                         int
}

// Status returns src's status after outcome at now, and whether it
// changed. The applied commit changes only when a revision was applied;
// a refused revision is recorded beside it, with Ready False saying that
// the applied commit stays.
func Status(src *typesv1.GitSource, out Outcome, now time.Time) (*typesv1.GitSourceStatus, bool) {
	old := src.GetStatus()
	st := &typesv1.GitSourceStatus{}
	if old != nil {
		st = proto.Clone(old).(*typesv1.GitSourceStatus)
	}
	st.LastFetchTime = timestamppb.New(now)
	st.ObservedGeneration = src.GetMetadata().GetGeneration()
	stays := "nothing applied yet"
	if c := st.GetAppliedCommit(); c != "" {
		stays = "commit " + short(c) + " stays applied"
	}
	var cond *typesv1.Condition
	switch {
	case out.FetchError != "":
		cond = conditions.New(Ready, "False", ReasonFetchFailed, fmt.Sprintf("fetch: %s; %s", out.FetchError, stays))
	case out.Refused != "":
		st.RefusedCommit, st.RefusedMessage = out.Commit, out.Refused
		cond = conditions.New(Ready, "False", ReasonRevisionRefused, fmt.Sprintf("commit %s refused, nothing of it applied: %s; %s", short(out.Commit), out.Refused, stays))
	case out.ApplyError != "":
		cond = conditions.New(Ready, "False", ReasonApplyFailed, fmt.Sprintf("commit %s: %s; %s", short(out.Commit), out.ApplyError, stays))
	default:
		if st.GetAppliedCommit() != out.Commit {
			st.AppliedCommit = out.Commit
			st.AppliedTime = timestamppb.New(now)
		}
		st.AppliedObjects = int32(out.Objects)
		st.RefusedCommit, st.RefusedMessage = "", ""
		cond = conditions.New(Ready, "True", ReasonApplied, fmt.Sprintf("commit %s applied (%d objects)", short(out.Commit), out.Objects))
	}
	cond.ObservedGeneration = st.ObservedGeneration
	st.Conditions, _ = conditions.Set(st.GetConditions(), cond, now)
	// The fetch time changes every round; a change worth a write is
	// anything else.
	cmp := proto.Clone(st).(*typesv1.GitSourceStatus)
	cmp.LastFetchTime = old.GetLastFetchTime()
	return st, !proto.Equal(cmp, old) || old.GetLastFetchTime() == nil
}

func short(commit string) string {
	if len(commit) > 12 {
		return commit[:12]
	}
	return commit
}
