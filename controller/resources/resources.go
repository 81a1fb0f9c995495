// Package resources is the domain behind the Resources API: apply with
// created/configured/unchanged results, get, list with label selectors and
// paging, delete and watch, over the store. It owns the rules every kind
// shares: apiVersion and kind are set by the controller, generation bumps
// only when spec changes, status is the controller's, and a Host's BMC
// password is moved into a sealed secret and never returned.
package resources

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/audit"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/errdefs"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Store is what the service needs of the store.
type Store interface {
	Create(ctx context.Context, kind, name string, m proto.Message) (int64, error)
	Get(ctx context.Context, kind, name string, into proto.Message) (int64, error)
	Update(ctx context.Context, kind, name string, m proto.Message, expectRev int64) (int64, error)
	Delete(ctx context.Context, kind, name string, expectRev int64) error
	List(ctx context.Context, kind string, newMsg func() proto.Message, opts store.ListOptions) ([]store.Item, string, error)
	Watch(ctx context.Context, kind string, fromRev int64) <-chan store.WatchEvent
	PutSecret(ctx context.Context, path string, plaintext []byte) error
	GetSecret(ctx context.Context, path string) ([]byte, error)
	DeleteSecret(ctx context.Context, path string) error
	CreateAudited(ctx context.Context, kind, name string, m proto.Message, rec store.AuditRecord, secrets ...store.SecretOp) (int64, error)
	UpdateAudited(ctx context.Context, kind, name string, m proto.Message, expectRev int64, rec store.AuditRecord, secrets ...store.SecretOp) (int64, error)
	DeleteAudited(ctx context.Context, kind, name string, expectRev int64, rec store.AuditRecord, secrets ...store.SecretOp) error
	Batch(ctx context.Context, ops []store.BatchOp) (int64, error)
}

var _ Store = (*store.Store)(nil)

// Recorder records events.
type Recorder interface {
	Record(ctx context.Context, kind, name, typ, reason, message string)
}

var _ Recorder = (*events.Recorder)(nil)

// Action is the result of applying one resource.
const (
	Created    = "created"
	Configured = "configured"
	Unchanged  = "unchanged"
)

// BMCSecretPath is the sealed secret holding a host's BMC password.
func BMCSecretPath(host string) string { return "bmc/" + host }

// Service implements the Resources API's domain.
type Service struct {
	store  Store
	events Recorder
	clock  func() time.Time
	log    *slog.Logger
	// own are the networks the controller itself is attached to (see
	// SetOwnNetworks).
	own []netip.Prefix
	// caches, when set, serve List (UseCaches).
	caches *Caches
}

// SetOwnNetworks adds networks a Cluster's pod and service CIDRs must not
// overlap besides the agents' reports: the controller's own (its API and
// boot server addresses' subnets, such as a provisioning network or a lab
// bridge), known before any agent has reported. Call before serving.
func (s *Service) SetOwnNetworks(nets []netip.Prefix) { s.own = nets }

// New returns a Service.
func New(st Store, rec Recorder, clock func() time.Time, log *slog.Logger) *Service {
	if clock == nil {
		clock = time.Now
	}
	return &Service{store: st, events: rec, clock: clock, log: log.With("component", "resources")}
}

// maxConflictRetries bounds Apply's retries when a reconciler writes the
// same object between Apply's read and write.
const maxConflictRetries = 5

// applyWorkers bounds how many resources of one Apply are written at
// once. Concurrent writes let etcd batch them into fewer fsyncs.
const applyWorkers = 8

// independentKinds are the kinds whose validation reads no other object,
// so resources of them can be applied in any order.
var independentKinds = map[string]bool{"hosts": true, "images": true}

// Apply creates or updates the resources and reports what it did to each,
// in request order. Every resource is validated before anything is
// stored: one invalid resource refuses the whole request with
// InvalidArgument. Then they are applied in order (concurrently when all
// are Hosts or Images with distinct names). A request is not one
// transaction: on the first failed write no further write starts, and
// Apply returns the error (Conflict when metadata.resourceVersion is set
// and stale, Unavailable when etcd cannot answer, ...) wrapped with what
// the request did store before it stopped, by name, so the caller never
// has to guess (applying the same request again is safe: stored resources
// report unchanged). With dryRun nothing is stored and the results say
// what would happen.
func (s *Service) Apply(ctx context.Context, objs []*controllerv1.Resource, dryRun bool) ([]*controllerv1.ApplyResult, error) {
	kinds := make([]Kind, len(objs))
	parsed := make([]proto.Message, len(objs))
	parallel := len(objs) > 1
	seen := make(map[string]bool, len(objs))
	for i, r := range objs {
		if err := validation.Validate(r); err != nil {
			return nil, err
		}
		k, obj, err := Unwrap(r)
		if err != nil {
			return nil, err
		}
		kinds[i], parsed[i] = k, obj
		id := k.Plural + "/" + Meta(obj).GetName()
		if seen[id] || !independentKinds[k.Plural] {
			parallel = false
		}
		seen[id] = true
	}
	results := make([]*controllerv1.ApplyResult, len(objs))
	errs := make([]error, len(objs))
	var failed atomic.Bool
	apply := func(i int) {
		if failed.Load() {
			return // a write failed: start no more
		}
		if results[i], errs[i] = s.applyWithRetry(ctx, kinds[i], parsed[i], dryRun); errs[i] != nil {
			failed.Store(true)
		}
	}
	if parallel {
		var g errgroup.Group
		g.SetLimit(applyWorkers)
		for i := range objs {
			g.Go(func() error { apply(i); return nil })
		}
		_ = g.Wait()
	} else {
		for i := range objs {
			apply(i)
		}
	}
	for i, err := range errs {
		if err != nil {
			return nil, partialApply(err, i, objs, results, dryRun)
		}
	}
	return results, nil
}

// partialApply wraps the error of the first failed resource (index first)
// with what the request stored before it stopped: with concurrent writes
// that may include resources after it.
func partialApply(err error, first int, objs []*controllerv1.Resource, results []*controllerv1.ApplyResult, dryRun bool) error {
	if dryRun {
		return err
	}
	var written, unchanged []string
	for _, r := range results {
		switch {
		case r == nil:
		case r.GetAction() == Unchanged:
			unchanged = append(unchanged, strings.ToLower(r.GetKind())+"/"+r.GetName())
		default:
			written = append(written, strings.ToLower(r.GetKind())+"/"+r.GetName()+" "+r.GetAction())
		}
	}
	notStored := len(objs) - len(written) - len(unchanged)
	if len(objs) == 1 {
		return err
	}
	msg := fmt.Sprintf("%d of %d resources of this request stored before it stopped", len(written), len(objs))
	if len(written) > 0 {
		msg += " (" + joinAtMost(written, 5) + ")"
	}
	if len(unchanged) > 0 {
		msg += fmt.Sprintf(", %d unchanged", len(unchanged))
	}
	msg += fmt.Sprintf(", %d not applied (resource %d of the request failed); fix it and apply the same request again: stored resources report unchanged", notStored, first+1)
	return fmt.Errorf("%w; %s", err, msg)
}

// joinAtMost joins the first n of items with ", " and says how many more.
func joinAtMost(items []string, n int) string {
	if len(items) <= n {
		return strings.Join(items, ", ")
	}
	return strings.Join(items[:n], ", ") + fmt.Sprintf(" and %d more", len(items)-n)
}

// applyWithRetry applies one resource, retrying when a reconciler wrote it
// between read and write (unless the user pinned a resourceVersion).
func (s *Service) applyWithRetry(ctx context.Context, k Kind, obj proto.Message, dryRun bool) (*controllerv1.ApplyResult, error) {
	name := Meta(obj).GetName()
	call := audit.CallFrom(ctx)
	var action string
	var warnings []string
	var err error
	var entry *controllerv1.AuditEntry
	for attempt := 0; ; attempt++ {
		entry = nil
		if call != nil && !dryRun {
			entry = call.Entry(k.Name, name)
		}
		action, warnings, err = s.applyOne(ctx, k, proto.Clone(obj), dryRun, entry, nil, nil)
		if !errdefs.IsConflict(err) || Meta(obj).GetResourceVersion() != "" || attempt >= maxConflictRetries {
			break
		}
	}
	if entry != nil {
		// A write that stored its entry with it is committed; anything
		// else (unchanged, an error) is appended when the call ends.
		if err == nil && action != Unchanged {
			call.Committed(entry)
		} else {
			if err == nil {
				entry.Result = audit.Unchanged
			}
			call.Note(entry)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("apply %s %q: %w", k.Name, name, err)
	}
	if !dryRun && action != Unchanged {
		s.events.Record(ctx, k.Plural, name, events.Normal, "Applied", k.Name+" "+action)
	}
	if !dryRun {
		for _, w := range warnings {
			s.log.Warn("applied with a warning", "kind", k.Name, "name", name, "warning", w)
			s.events.Record(ctx, k.Plural, name, events.Warning, "AppliedWithWarning", w)
		}
	}
	return &controllerv1.ApplyResult{Kind: k.Name, Name: name, Action: action, Warnings: warnings}, nil
}

// applyOne applies one resource. With a non-nil entry it fills in the
// generations and changed fields and stores the entry in the write's
// transaction (Result OK), so the write and its audit record are stored
// together or not at all.
//
// With a non-nil batch it writes nothing: it appends the write to batch
// (for ApplyBatch's one transaction) and refuses a Host that carries a
// BMC password, whose sealed secret a batch does not store. batchClasses
// are the ClusterClasses the batch applies, by name: a topology Cluster
// is checked against its class as the batch leaves it.
func (s *Service) applyOne(ctx context.Context, k Kind, obj proto.Message, dryRun bool, entry *controllerv1.AuditEntry, batch *[]store.BatchOp, batchClasses map[string]*typesv1.ClusterClass) (action string, warnings []string, err error) {
	if entry == nil {
		entry = &controllerv1.AuditEntry{} // filled and dropped
	}
	record := func() store.AuditRecord {
		if entry.GetTime() == nil {
			return store.AuditRecord{}
		}
		entry.Result = audit.OK
		return audit.Record(entry)
	}
	md := Meta(obj)
	name := md.GetName()
	wantRV := md.GetResourceVersion()
	clearStatus(obj)
	password, err := s.takeBMCPassword(obj)
	if err != nil {
		return "", nil, err
	}
	if batch != nil && password != "" {
		return "", nil, errdefs.InvalidArgument("host %q: spec.bmc.password is refused in a batch apply (a Git revision or apply --prune): apply the host's password alone with kilnctl apply", name)
	}

	cur := k.New()
	rev, err := s.store.Get(ctx, k.Plural, name, cur)
	exists := err == nil
	if err != nil && !errdefs.IsNotFound(err) {
		return "", nil, err
	}
	if wantRV != "" {
		if !exists {
			return "", nil, errdefs.NotFound("%s %q does not exist but metadata.resourceVersion %s was given", k.Name, name, wantRV)
		}
		if wantRV != strconv.FormatInt(rev, 10) {
			return "", nil, errdefs.Conflict("%s %q was modified: resourceVersion is %d, not %s; get it again and retry", k.Name, name, rev, wantRV)
		}
	}
	var observed validation.Observed
	if exists {
		observed.Current = k.Wrap(cur)
	}
	observed.ControlPlaneVersion = s.controlPlaneVersion(ctx, obj)
	if _, ok := obj.(*typesv1.Cluster); ok {
		if observed.Networks, observed.AgentNetworks, err = s.hostNetworks(ctx); err != nil {
			return "", nil, err
		}
	}
	if err := s.observeTopology(ctx, obj, &observed, batchClasses); err != nil {
		return "", nil, err
	}
	if c, ok := obj.(*typesv1.Cluster); ok && c.GetSpec().GetTopology() != nil {
		// Check the fields the class filled in as if the user had.
		if err := validation.Validate(k.Wrap(obj)); err != nil {
			return "", nil, err
		}
	}
	if err := validation.ValidateAgainst(k.Wrap(obj), observed); err != nil {
		return "", nil, err
	}
	warnings = validation.WarnAgainst(k.Wrap(obj), observed)

	if !exists {
		setHeader(obj, k)
		md.ResourceVersion = ""
		md.Generation = 1
		md.Uid = newUID()
		md.CreationTimestamp = timestamppb.New(s.clock())
		md.DeletionTimestamp = nil
		markPasswordSet(obj, password != "")
		entry.GenerationAfter = 1
		entry.Changed = audit.Changed(nil, obj, "spec", "metadata.labels", "metadata.annotations")
		if password != "" {
			entry.Changed = addField(entry.Changed, "spec.bmc.password")
		}
		if dryRun {
			return Created, warnings, nil
		}
		if batch != nil {
			*batch = append(*batch, store.BatchOp{Kind: k.Plural, Name: name, Msg: obj, Audit: record()})
			return Created, warnings, nil
		}
		// The password is sealed in the Host's own transaction: a crash
		// leaves both or neither.
		var secrets []store.SecretOp
		if password != "" {
			secrets = append(secrets, store.PutSecretOp(BMCSecretPath(name), []byte(password)))
		}
		if _, err := s.store.CreateAudited(ctx, k.Plural, name, obj, record(), secrets...); err != nil {
			if errdefs.IsAlreadyExists(err) {
				// Created meanwhile (an agent enrolled it): read it again.
				return "", nil, errdefs.Conflict("%s %q was created concurrently", k.Name, name)
			}
			return "", nil, err
		}
		return Created, warnings, nil
	}

	if err := checkBMCMove(cur, obj, password); err != nil {
		return "", nil, err
	}
	pwChanged, err := s.passwordChanged(ctx, k, name, password)
	if err != nil {
		return "", nil, err
	}
	// The stored object keeps its identity, status and bookkeeping; only
	// spec, labels and annotations come from the user.
	next := proto.Clone(cur)
	nmd := Meta(next)
	markPasswordSet(obj, password != "" || passwordSet(cur))
	specChanged := !specEqual(cur, obj)
	metaChanged := !maps.Equal(nmd.GetLabels(), md.GetLabels()) || !maps.Equal(nmd.GetAnnotations(), md.GetAnnotations())
	headerChanged := !headerOK(cur, k)
	entry.GenerationBefore = Meta(cur).GetGeneration()
	entry.GenerationAfter = entry.GenerationBefore
	if !specChanged && !metaChanged && !pwChanged && !headerChanged {
		return Unchanged, warnings, nil
	}
	setHeader(next, k)
	setSpec(next, obj)
	nmd.Labels = md.GetLabels()
	nmd.Annotations = md.GetAnnotations()
	nmd.ResourceVersion = ""
	if specChanged || pwChanged {
		nmd.Generation++
	}
	entry.GenerationAfter = nmd.GetGeneration()
	entry.Changed = audit.Changed(cur, next, "spec", "metadata.labels", "metadata.annotations")
	if pwChanged {
		entry.Changed = addField(entry.Changed, "spec.bmc.password")
	}
	if dryRun {
		return Configured, warnings, nil
	}
	if batch != nil {
		*batch = append(*batch, store.BatchOp{Kind: k.Plural, Name: name, Rev: rev, Msg: next, Audit: record()})
		return Configured, warnings, nil
	}
	var secrets []store.SecretOp
	if pwChanged {
		secrets = append(secrets, store.PutSecretOp(BMCSecretPath(name), []byte(password)))
	}
	if _, err := s.store.UpdateAudited(ctx, k.Plural, name, next, rev, record(), secrets...); err != nil {
		if errdefs.IsNotFound(err) && wantRV == "" {
			// Deleted meanwhile: read it again (and create it).
			return "", nil, errdefs.Conflict("%s %q was deleted concurrently", k.Name, name)
		}
		return "", nil, err
	}
	return Configured, warnings, nil
}

// addField adds a field name to a sorted list of changed fields.
func addField(fields []string, f string) []string {
	if slices.Contains(fields, f) {
		return fields
	}
	fields = append(fields, f)
	slices.Sort(fields)
	return fields
}

// takeBMCPassword removes the write-only password from a Host and returns
// it.
func (s *Service) takeBMCPassword(obj proto.Message) (string, error) {
	h, ok := obj.(*typesv1.Host)
	if !ok || h.GetSpec().GetBmc() == nil {
		return "", nil
	}
	pw := h.Spec.Bmc.Password
	h.Spec.Bmc.Password = ""
	h.Spec.Bmc.PasswordSet = false
	return pw, nil
}

// passwordChanged reports whether password differs from the one stored
// for a Host ("" never counts as a change: applying a Host without a
// password keeps the stored one).
func (s *Service) passwordChanged(ctx context.Context, k Kind, name, password string) (bool, error) {
	if k.Plural != "hosts" || password == "" {
		return false, nil
	}
	old, err := s.store.GetSecret(ctx, BMCSecretPath(name))
	if errdefs.IsNotFound(err) || errdefs.IsPermissionDenied(err) {
		// Unreadable under this key (a key file was replaced): overwrite.
		return true, nil
	}
	if err != nil {
		return false, err
	}
	return !bytes.Equal(old, []byte(password)), nil
}

// checkBMCMove refuses a Host whose BMC protocol, address or username
// changes while the stored password would be kept (password ""): the
// stored password is sent only to the BMC it was given for, or an
// operator, who may not read it, could point the host at a server of
// their own and collect it (issue 12). It returns InvalidArgument.
func checkBMCMove(cur, next proto.Message, password string) error {
	ch, ok1 := cur.(*typesv1.Host)
	nh, ok2 := next.(*typesv1.Host)
	if !ok1 || !ok2 || password != "" || !ch.GetSpec().GetBmc().GetPasswordSet() {
		return nil
	}
	cb, nb := ch.GetSpec().GetBmc(), nh.GetSpec().GetBmc()
	for _, f := range []struct{ field, was, is string }{
		{"protocol", cb.GetProtocol(), nb.GetProtocol()},
		{"address", cb.GetAddress(), nb.GetAddress()},
		{"username", cb.GetUsername(), nb.GetUsername()},
	} {
		if f.was != f.is {
			return errdefs.InvalidArgument("host %q: spec.bmc.%s changes from %q to %q without spec.bmc.password: give the password again (the stored one is only sent to the BMC it was given for)",
				ch.GetMetadata().GetName(), f.field, f.was, f.is)
		}
	}
	return nil
}

func markPasswordSet(obj proto.Message, set bool) {
	if h, ok := obj.(*typesv1.Host); ok && h.GetSpec().GetBmc() != nil {
		h.Spec.Bmc.PasswordSet = set
	}
}

func passwordSet(obj proto.Message) bool {
	h, ok := obj.(*typesv1.Host)
	return ok && h.GetSpec().GetBmc().GetPasswordSet()
}

func headerOK(obj proto.Message, k Kind) bool {
	r := obj.ProtoReflect()
	return r.Get(field(obj, "api_version")).String() == APIVersion && r.Get(field(obj, "kind")).String() == k.Name
}

// controlPlaneVersion finds the control plane version of the cluster a
// MachineDeployment or Machine belongs to, for the version skew rules.
// Lookup failures leave it empty (the rule is skipped), never fail Apply.
func (s *Service) controlPlaneVersion(ctx context.Context, obj proto.Message) string {
	var cluster string
	switch o := obj.(type) {
	case *typesv1.MachineDeployment:
		cluster = o.GetSpec().GetCluster()
	case *typesv1.Machine:
		if o.GetSpec().GetRole() == "control-plane" {
			return ""
		}
		cluster = o.GetSpec().GetCluster()
	default:
		return ""
	}
	if cluster == "" {
		return ""
	}
	items, _, err := s.store.List(ctx, "controlplanes", func() proto.Message { return &typesv1.ControlPlane{} }, store.ListOptions{})
	if err == nil {
		for _, it := range items {
			if cp := it.Msg.(*typesv1.ControlPlane); cp.GetSpec().GetCluster() == cluster && cp.GetSpec().GetVersion() != "" {
				return cp.GetSpec().GetVersion()
			}
		}
	}
	c := &typesv1.Cluster{}
	if _, err := s.store.Get(ctx, "clusters", cluster, c); err == nil {
		return c.GetSpec().GetKubernetesVersion()
	}
	return ""
}

// hostNetworks collects the networks a new Cluster's pod and service CIDRs
// are checked against: own, which refuse (the controller's own subnets and
// the operator's reserved networks, SetOwnNetworks), and the networks the
// agents report (NIC addresses and route destinations, without default
// routes, loopback, link-local and the clusters' own ranges), which only
// warn: an agent may report anything, and what it reports must not refuse
// an operator's apply (issue 12, hole 6).
func (s *Service) hostNetworks(ctx context.Context) (own []netip.Prefix, agents []validation.HostNetwork, err error) {
	seen := map[netip.Prefix]bool{}
	for _, p := range s.own {
		if p = p.Masked(); !seen[p] {
			seen[p] = true
			own = append(own, p)
		}
	}
	// The clusters' own pod and service ranges are not host networks: a
	// node's CNI bridge and the routes to other nodes' pod subnets lie
	// inside them, and clusters may reuse a range (each is its own
	// network). Without this, one running cluster made every later Cluster
	// with the same conventional pod range warn.
	var clusterNets []netip.Prefix
	cc := ""
	for {
		items, next, err := s.store.List(ctx, "clusters", func() proto.Message { return &typesv1.Cluster{} }, store.ListOptions{Limit: maxPage, Continue: cc})
		if err != nil {
			return nil, nil, fmt.Errorf("host networks: %w", err)
		}
		for _, it := range items {
			sp := it.Msg.(*typesv1.Cluster).GetSpec()
			for _, c := range []string{sp.GetPodCidr(), sp.GetServiceCidr()} {
				if p, err := netip.ParsePrefix(c); err == nil {
					clusterNets = append(clusterNets, p.Masked())
				}
			}
		}
		if next == "" {
			break
		}
		cc = next
	}
	inCluster := func(p netip.Prefix) bool {
		for _, c := range clusterNets {
			if c.Bits() <= p.Bits() && c.Contains(p.Addr()) {
				return true
			}
		}
		return false
	}
	type hostNet struct {
		host string
		p    netip.Prefix
	}
	seenAgent := map[hostNet]bool{}
	add := func(host, str string) {
		p, err := netip.ParsePrefix(str)
		if err != nil {
			return
		}
		p = p.Masked()
		k := hostNet{host, p}
		if p.Bits() == 0 || p.Addr().IsLoopback() || p.Addr().IsLinkLocalUnicast() || seen[p] || seenAgent[k] || inCluster(p) {
			return
		}
		seenAgent[k] = true
		agents = append(agents, validation.HostNetwork{Host: host, Prefix: p})
	}
	cont := ""
	for {
		items, next, err := s.store.List(ctx, "hosts", func() proto.Message { return &typesv1.Host{} }, store.ListOptions{Limit: maxPage, Continue: cont})
		if err != nil {
			return nil, nil, fmt.Errorf("host networks: %w", err)
		}
		for _, it := range items {
			h := it.Msg.(*typesv1.Host)
			name := h.GetMetadata().GetName()
			f := h.GetStatus().GetFacts()
			for _, nic := range f.GetNics() {
				for _, a := range nic.GetAddresses() {
					add(name, a)
				}
			}
			for _, r := range f.GetRoutes() {
				add(name, r.GetDestination())
			}
		}
		if next == "" {
			return own, agents, nil
		}
		cont = next
	}
}

// Get returns one resource. It returns NotFound when there is none and
// InvalidArgument for an unknown kind.
func (s *Service) Get(ctx context.Context, kind, name string) (*controllerv1.Resource, error) {
	k, err := LookupKind(kind)
	if err != nil {
		return nil, err
	}
	if name == "" {
		return nil, errdefs.InvalidArgument("get %s: name is required", k.Plural)
	}
	obj := k.New()
	rev, err := s.store.Get(ctx, k.Plural, name, obj)
	if err != nil {
		return nil, err
	}
	finish(obj, k, rev)
	return k.Wrap(obj), nil
}

// finish prepares a stored object for the API: header, resource version,
// and never a password.
func finish(obj proto.Message, k Kind, rev int64) {
	setHeader(obj, k)
	Meta(obj).ResourceVersion = strconv.FormatInt(rev, 10)
	if h, ok := obj.(*typesv1.Host); ok && h.GetSpec().GetBmc() != nil {
		h.Spec.Bmc.Password = ""
	}
}

// maxPage is the most items one List call reads from etcd at a time.
const maxPage = 500

// maxListBytes bounds one List response: past it the response ends with a
// continue token, whatever the limit, so that a few large objects cannot
// push a listing past the 4 MiB a gRPC client accepts by default and make
// `kilnctl get` fail for everyone (issue 12, hole 6). One object larger
// than this is still returned, alone.
const maxListBytes = 2 << 20

// List returns resources of kind whose labels match every key=value of
// selector, in name order. With limit > 0 it returns at most limit and a
// continue token while more may remain. A response also ends, with a
// continue token, once its items' size reaches maxListBytes: callers page
// whatever limit they ask for. With caches (UseCaches) the pages come
// from the kind's watch cache, as consistent as etcd's (a listing holds
// every write that completed before it began, and its pages are one
// snapshot), and from etcd where the cache cannot serve them.
func (s *Service) List(ctx context.Context, kind string, selector map[string]string, limit int64, cont string) ([]*controllerv1.Resource, string, error) {
	k, err := LookupKind(kind)
	if err != nil {
		return nil, "", err
	}
	if limit < 0 {
		return nil, "", errdefs.InvalidArgument("list %s: negative limit %d", k.Plural, limit)
	}
	if out, next, served, err := s.listCached(ctx, k, selector, limit, cont); err != nil || served {
		return out, next, err
	}
	var out []*controllerv1.Resource
	var size int64
	for {
		// A page never reaches past the limit or the size bound, so a
		// listing that fills up does so at a page's end, where the store's
		// token resumes.
		page := int64(maxPage)
		if limit > 0 {
			page = min(page, limit-int64(len(out)))
		}
		items, next, err := s.store.List(ctx, k.Plural, k.New, store.ListOptions{Limit: page, Continue: cont, MaxBytes: maxListBytes - size})
		if err != nil {
			return nil, "", err
		}
		for _, it := range items {
			if !matches(Meta(it.Msg).GetLabels(), selector) {
				continue
			}
			finish(it.Msg, k, it.Rev)
			r := k.Wrap(it.Msg)
			size += int64(proto.Size(r))
			out = append(out, r)
		}
		if next == "" || (limit > 0 && int64(len(out)) >= limit) || size >= maxListBytes {
			return out, next, nil
		}
		cont = next
	}
}

func matches(labels, selector map[string]string) bool {
	for k, v := range selector {
		got, ok := labels[k]
		if !ok || got != v {
			return false
		}
	}
	return true
}

// Delete removes a resource (and a Host's sealed BMC password). It returns
// NotFound when there is none.
func (s *Service) Delete(ctx context.Context, kind, name string) error {
	k, err := LookupKind(kind)
	if err != nil {
		return err
	}
	if name == "" {
		return errdefs.InvalidArgument("delete %s: name is required", k.Plural)
	}
	// A Host's sealed password goes in the Host's own transaction.
	var secrets []store.SecretOp
	if k.Plural == "hosts" {
		secrets = append(secrets, store.DeleteSecretOp(BMCSecretPath(name)))
	}
	if call := audit.CallFrom(ctx); call != nil {
		if err := s.deleteAudited(ctx, call, k, name, secrets); err != nil {
			return err
		}
	} else if err := s.store.DeleteAudited(ctx, k.Plural, name, 0, store.AuditRecord{}, secrets...); err != nil {
		return err
	}
	s.events.Record(ctx, k.Plural, name, events.Normal, "Deleted", k.Name+" deleted")
	return nil
}

// deleteAudited deletes a resource with its audit entry in the same
// transaction: it reads the generation for the entry and deletes exactly
// what it read, reading again when a reconciler wrote in between.
func (s *Service) deleteAudited(ctx context.Context, call *audit.Call, k Kind, name string, secrets []store.SecretOp) error {
	var err error
	for attempt := 0; ; attempt++ {
		e := call.Entry(k.Name, name)
		cur := k.New()
		var rev int64
		if rev, err = s.store.Get(ctx, k.Plural, name, cur); err == nil {
			e.GenerationBefore = Meta(cur).GetGeneration()
			e.Result = audit.OK
			if err = s.store.DeleteAudited(ctx, k.Plural, name, rev, audit.Record(e), secrets...); err == nil {
				call.Committed(e)
				return nil
			}
		}
		if !errdefs.IsConflict(err) || attempt >= maxConflictRetries {
			e.Result = ""
			call.Note(e)
			return err
		}
	}
}

// Watch calls fn for every change of resources of kind (only name, when
// set) from now on, until ctx ends or fn returns an error. Type is
// "ADDED", "MODIFIED" or "DELETED"; a deleted resource carries only its
// kind and name. With caches (UseCaches) the changes come from the kind's
// watch cache: one etcd watch per kind, however many watch the API.
func (s *Service) Watch(ctx context.Context, kind, name string, fn func(*controllerv1.WatchEvent) error) error {
	k, err := LookupKind(kind)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// The store reports puts without saying whether they created the
	// object: a put is ADDED when its object was created after the watch
	// began and is seen here for the first time.
	start := s.clock()
	seen := map[string]bool{}
	for ev := range s.watch(ctx, k) {
		if ev.Err != nil {
			return ev.Err
		}
		if name != "" && ev.Name != name {
			continue
		}
		obj := k.New()
		typ := "DELETED"
		if ev.Type == store.EventPut {
			if err := proto.Unmarshal(ev.Value, obj); err != nil {
				return fmt.Errorf("watch %s: decode %q: %w", k.Plural, ev.Name, err)
			}
			typ = "MODIFIED"
			if !seen[ev.Name] && !Meta(obj).GetCreationTimestamp().AsTime().Before(start) {
				typ = "ADDED"
			}
			seen[ev.Name] = true
			finish(obj, k, ev.Rev)
		} else {
			delete(seen, ev.Name)
			Meta(obj).Name = ev.Name
			setHeader(obj, k)
		}
		if err := fn(&controllerv1.WatchEvent{Type: typ, Resource: k.Wrap(obj)}); err != nil {
			return err
		}
	}
	if err := ctx.Err(); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

func newUID() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b)
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}
