package resources

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/audit"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/errdefs"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Pruned is the action of an object a batch deleted.
const Pruned = "pruned"

// Ref names one stored object: its kind (plural, "clusters") and name.
type Ref struct {
	Kind, Name string
}

func (r Ref) String() string {
	k, err := LookupKind(r.Kind)
	if err != nil {
		return r.Kind + "/" + r.Name
	}
	return strings.ToLower(k.Name) + "/" + r.Name
}

// ObjectError is an error of ApplyBatch about one object: Index is its
// place in the objects given. Its class is Err's.
type ObjectError struct {
	Index int
	Err   error
}

func (e *ObjectError) Error() string { return e.Err.Error() }
func (e *ObjectError) Unwrap() error { return e.Err }

// PrunableKinds are the kinds apply --prune and a GitSource delete when
// their files no longer name an object. Hosts are inventory (deleting one
// forgets a machine and its BMC password) and Machines belong to their
// deployments, so neither is pruned; GitSources are never applied by a
// GitSource.
var PrunableKinds = []string{"images", "clusters", "controlplanes", "machinedeployments", "healthchecks", "clusterclasses", "rollouts"}

// ApplyBatch applies objs and deletes prunes as one store transaction:
// every write happens or none does. Every object is validated first, as
// Apply does, and the results say what was (or, with dryRun, would be)
// created, configured, unchanged or pruned. A prune of an object that no
// longer exists is skipped. It returns InvalidArgument when an object is
// invalid or a Host carries a BMC password, Conflict when objects kept
// changing under it, and what the store returns otherwise; nothing is
// stored then. Audit entries (from the call in ctx) are stored in the
// same transaction.
func (s *Service) ApplyBatch(ctx context.Context, objs []*controllerv1.Resource, prunes []Ref, dryRun bool) ([]*controllerv1.ApplyResult, error) {
	kinds := make([]Kind, len(objs))
	parsed := make([]proto.Message, len(objs))
	seen := map[Ref]bool{}
	for i, r := range objs {
		if err := validation.Validate(r); err != nil {
			return nil, err
		}
		k, obj, err := Unwrap(r)
		if err != nil {
			return nil, err
		}
		ref := Ref{k.Plural, Meta(obj).GetName()}
		if seen[ref] {
			return nil, errdefs.InvalidArgument("%s is named twice", ref)
		}
		seen[ref] = true
		kinds[i], parsed[i] = k, obj
	}
	for _, p := range prunes {
		if seen[Ref{p.Kind, p.Name}] {
			return nil, errdefs.InvalidArgument("%s is both applied and pruned", p)
		}
		if !slices.Contains(PrunableKinds, p.Kind) {
			return nil, errdefs.InvalidArgument("%s: kind %s is not pruned", p, p.Kind)
		}
	}
	call := audit.CallFrom(ctx)
	var err error
	for attempt := 0; ; attempt++ {
		var results []*controllerv1.ApplyResult
		var ops []store.BatchOp
		var entries []*controllerv1.AuditEntry
		results, ops, entries, err = s.prepareBatch(ctx, call, kinds, parsed, prunes, dryRun)
		if err != nil {
			return nil, err
		}
		if dryRun {
			return results, nil
		}
		if _, err = s.store.Batch(ctx, ops); err == nil {
			for _, e := range entries {
				call.Committed(e)
			}
			for _, r := range results {
				switch r.GetAction() {
				case Created, Configured:
					s.events.Record(ctx, pluralOf(r.GetKind()), r.GetName(), events.Normal, "Applied", r.GetKind()+" "+r.GetAction())
				case Pruned:
					s.events.Record(ctx, pluralOf(r.GetKind()), r.GetName(), events.Normal, "Deleted", r.GetKind()+" pruned")
				}
			}
			return results, nil
		}
		if !errdefs.IsConflict(err) || attempt >= maxConflictRetries {
			return nil, fmt.Errorf("apply batch of %d objects and %d prunes: %w", len(objs), len(prunes), err)
		}
	}
}

// prepareBatch reads and checks every object of a batch and returns the
// results, the writes and the audit entries stored with them.
func (s *Service) prepareBatch(ctx context.Context, call *audit.Call, kinds []Kind, parsed []proto.Message, prunes []Ref, dryRun bool) ([]*controllerv1.ApplyResult, []store.BatchOp, []*controllerv1.AuditEntry, error) {
	var results []*controllerv1.ApplyResult
	var ops []store.BatchOp
	var entries []*controllerv1.AuditEntry
	// The batch is one transaction: its clusters are checked against its
	// classes, wherever they stand in it (a Git revision that adds a class
	// and its clusters is applied whole).
	classes := map[string]*typesv1.ClusterClass{}
	for _, obj := range parsed {
		if c, ok := obj.(*typesv1.ClusterClass); ok {
			classes[c.GetMetadata().GetName()] = c
		}
	}
	for i, k := range kinds {
		name := Meta(parsed[i]).GetName()
		var entry *controllerv1.AuditEntry
		if call != nil && !dryRun {
			entry = call.Entry(k.Name, name)
		}
		n := len(ops)
		action, warnings, err := s.applyOne(ctx, k, proto.Clone(parsed[i]), dryRun, entry, &ops, classes)
		if err != nil {
			return nil, nil, nil, &ObjectError{Index: i, Err: fmt.Errorf("apply %s %q: %w", k.Name, name, err)}
		}
		if entry != nil && len(ops) > n {
			entries = append(entries, entry)
		}
		results = append(results, &controllerv1.ApplyResult{Kind: k.Name, Name: name, Action: action, Warnings: warnings})
	}
	for _, p := range prunes {
		k, err := LookupKind(p.Kind)
		if err != nil {
			return nil, nil, nil, err
		}
		cur := k.New()
		rev, err := s.store.Get(ctx, k.Plural, p.Name, cur)
		if errdefs.IsNotFound(err) {
			continue
		}
		if err != nil {
			return nil, nil, nil, err
		}
		op := store.BatchOp{Kind: k.Plural, Name: p.Name, Rev: rev, Delete: true}
		if call != nil && !dryRun {
			e := call.Entry(k.Name, p.Name)
			e.Verb = "delete"
			e.GenerationBefore = Meta(cur).GetGeneration()
			e.Result = audit.OK
			op.Audit = audit.Record(e)
			entries = append(entries, e)
		}
		ops = append(ops, op)
		results = append(results, &controllerv1.ApplyResult{Kind: k.Name, Name: p.Name, Action: Pruned})
	}
	return results, ops, entries, nil
}

func pluralOf(kind string) string {
	k, err := LookupKind(kind)
	if err != nil {
		return kind
	}
	return k.Plural
}

// GitSourceLabel marks the objects a GitSource applied, with its name as
// the value: a later revision prunes those it no longer holds.
const GitSourceLabel = "kiln.dev/gitsource"

// PruneCandidates lists the objects of the prunable kinds whose labels
// match every key=value of selector and that objs do not name, sorted by
// kind then name: what apply --prune deletes. Objects a GitSource applied
// (label kiln.dev/gitsource) are left to their source. It returns
// InvalidArgument for an empty selector.
func (s *Service) PruneCandidates(ctx context.Context, selector map[string]string, objs []*controllerv1.Resource) ([]Ref, error) {
	if len(selector) == 0 {
		return nil, errdefs.InvalidArgument("prune needs a label selector: without one every object of the prunable kinds that the files do not name would be deleted")
	}
	named := map[Ref]bool{}
	for _, r := range objs {
		k, obj, err := Unwrap(r)
		if err != nil {
			return nil, err
		}
		named[Ref{k.Plural, Meta(obj).GetName()}] = true
	}
	var out []Ref
	for _, kind := range PrunableKinds {
		items, err := s.listAll(ctx, kind, selector)
		if err != nil {
			return nil, err
		}
		for _, it := range items {
			md := Meta(it)
			ref := Ref{kind, md.GetName()}
			if named[ref] {
				continue
			}
			if _, owned := md.GetLabels()[GitSourceLabel]; owned && selector[GitSourceLabel] == "" {
				continue
			}
			out = append(out, ref)
		}
	}
	return out, nil
}

// listAll lists every object of kind whose labels match selector.
func (s *Service) listAll(ctx context.Context, kind string, selector map[string]string) ([]proto.Message, error) {
	k, err := LookupKind(kind)
	if err != nil {
		return nil, err
	}
	var out []proto.Message
	cont := ""
	for {
		items, next, err := s.store.List(ctx, k.Plural, k.New, store.ListOptions{Limit: maxPage, Continue: cont})
		if err != nil {
			return nil, err
		}
		for _, it := range items {
			if matches(Meta(it.Msg).GetLabels(), selector) {
				out = append(out, it.Msg)
			}
		}
		if next == "" {
			return out, nil
		}
		cont = next
	}
}
