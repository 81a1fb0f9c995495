// Package store keeps the controller's state in etcd: resources as protobuf
// under /kiln/v1/<kind>/<name> with optimistic concurrency on the key's mod
// revision, watches that drive reconciles, and secrets sealed with AES-GCM
// under /kiln/v1/secrets/<path>. Concurrent single-object writes share
// etcd transactions, each keeping its own compares and outcome, and
// concurrent Gets share read-only ones (GroupCommit).
//
// One code path (clientv3) serves both the default single-member etcd
// embedded in the controller (StartEmbedded) and an external cluster given
// with --etcd-endpoints.
package store

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/seal"
)

// Prefix is the root of every key Kiln writes.
const Prefix = "/kiln/v1/"

// secretsKind is the key segment of sealed secrets; no resource kind may
// use it.
const secretsKind = "secrets"

// electionKind holds controller election keys (package election); no
// resource kind may use it.
const electionKind = "election"

// Store reads and writes Kiln's resources in etcd. It is safe for
// concurrent use.
type Store struct {
	client *clientv3.Client
	sealer *seal.Sealer
	log    *slog.Logger
	// fence, when set, is compared in every write (Fenced).
	fence *Fence
	// pauseChanges counts this process's changes of the pause
	// (PauseChanges); shared with Fenced copies.
	pauseChanges *atomic.Uint64
	// group groups concurrent writes (GroupCommit); shared with Fenced
	// copies. Nil when grouping is off.
	group    *committer
	groupCfg GroupCommit
	// reads groups concurrent Gets (GroupCommit); shared with Fenced
	// copies. Nil when read grouping is off.
	reads *reader
}

// Option configures a Store.
type Option func(*Store)

// WithSealer sets the Sealer that PutSecret and GetSecret use. Without
// one, they return FailedPrecondition.
func WithSealer(s *seal.Sealer) Option { return func(st *Store) { st.sealer = s } }

// WithLogger sets the logger.
func WithLogger(l *slog.Logger) Option { return func(st *Store) { st.log = l } }

// New returns a Store over client. The Store does not own client: close it
// yourself after the Store's last use.
func New(client *clientv3.Client, opts ...Option) *Store {
	s := &Store{client: client, pauseChanges: new(atomic.Uint64)}
	for _, o := range opts {
		o(s)
	}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	s.log = s.log.With("component", "store")
	if !s.groupCfg.Disabled {
		s.group = newCommitter(client, s.groupCfg)
	}
	if !s.groupCfg.Disabled && !s.groupCfg.DisableReads {
		s.reads = newReader(client, s.groupCfg)
	}
	return s
}

// Client returns the etcd client, for election and maintenance.
func (s *Store) Client() *clientv3.Client { return s.client }

// Key returns the etcd key of a resource: /kiln/v1/<kind>/<name>.
func Key(kind, name string) string { return Prefix + kind + "/" + name }

// Item is one resource returned by List.
type Item struct {
	Name string
	// Rev is the resource's mod revision, the value Update and Delete
	// expect.
	Rev int64
	Msg proto.Message
	// raw is the encoded resource as etcd returned it: set by listings,
	// and the only form an encoded Cache keeps (KeepEncoded).
	raw []byte
	// vals are the index values a Cache keeps the item under, so it
	// leaves them without being decoded again (an encoded Cache keeps no
	// decoded message).
	vals []indexVal
}

// ListOptions pages a List.
type ListOptions struct {
	// Limit is the most items to return; 0 means all.
	Limit int64
	// Continue is the token a previous List returned to get the next page.
	Continue string
	// MaxBytes, when > 0, ends the page after the item that brings the
	// stored size of the page's items to MaxBytes or more (a page holds at
	// least one item), with a continue token when more remain.
	MaxBytes int64
	// NamePrefix, when set, lists only the resources whose name starts
	// with it (one etcd range read of those keys, not of the whole kind).
	NamePrefix string
}

var marshal = proto.MarshalOptions{Deterministic: true}

// Create stores m as a new resource and returns its revision. It returns
// AlreadyExists when the resource exists.
func (s *Store) Create(ctx context.Context, kind, name string, m proto.Message) (int64, error) {
	return s.CreateAudited(ctx, kind, name, m, AuditRecord{})
}

// CreateAudited is Create that stores rec, and the changes to sealed
// secrets, in the same etcd transaction: all are stored or none.
func (s *Store) CreateAudited(ctx context.Context, kind, name string, m proto.Message, rec AuditRecord, secrets ...SecretOp) (int64, error) {
	audit, err := s.extraOps(rec, secrets)
	if err != nil {
		return 0, err
	}
	key, err := resourceKey(kind, name)
	if err != nil {
		return 0, err
	}
	val, err := marshal.Marshal(m)
	if err != nil {
		return 0, errdefs.InvalidArgument("create %s: encode: %w", key, err)
	}
	resp, err := s.commit(ctx, write{
		op:     "create " + key,
		cmps:   s.guard(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)),
		then:   append([]clientv3.Op{clientv3.OpPut(key, string(val))}, audit...),
		orElse: s.orElse(),
	})
	if err != nil {
		return 0, err
	}
	if !resp.Succeeded {
		if err := s.broken(resp, "create "+key); err != nil {
			return 0, err
		}
		return 0, errdefs.AlreadyExists("%s %q already exists", kind, name)
	}
	return resp.Header.Revision, nil
}

// GetKey reads any key (not only a resource's: an event log, say) as Get
// reads a resource: linearizable, sharing etcd requests with concurrent
// Gets. It returns nil when the key does not exist.
func (s *Store) GetKey(ctx context.Context, key string) (*mvccpb.KeyValue, error) {
	return s.get(ctx, key)
}

// Get reads a resource into into and returns its revision. It returns
// NotFound when it does not exist. The read is linearizable: it sees
// every write completed before the call. Concurrent Gets share etcd
// requests (GroupCommit).
func (s *Store) Get(ctx context.Context, kind, name string, into proto.Message) (int64, error) {
	key, err := resourceKey(kind, name)
	if err != nil {
		return 0, err
	}
	kv, err := s.get(ctx, key)
	if err != nil {
		return 0, err
	}
	if kv == nil {
		return 0, errdefs.NotFound("%s %q not found", kind, name)
	}
	if err := proto.Unmarshal(kv.Value, into); err != nil {
		return 0, fmt.Errorf("get %s: decode: %w", key, err)
	}
	return kv.ModRevision, nil
}

// Update replaces a resource if its revision is still expectRev and
// returns the new revision. It returns NotFound when the resource does not
// exist and Conflict when it changed since expectRev was read. expectRev 0
// updates whatever revision is stored (the resource must still exist).
func (s *Store) Update(ctx context.Context, kind, name string, m proto.Message, expectRev int64) (int64, error) {
	return s.UpdateAudited(ctx, kind, name, m, expectRev, AuditRecord{})
}

// UpdateAudited is Update that stores rec, and the changes to sealed
// secrets, in the same etcd transaction: all are stored or none.
func (s *Store) UpdateAudited(ctx context.Context, kind, name string, m proto.Message, expectRev int64, rec AuditRecord, secrets ...SecretOp) (int64, error) {
	audit, err := s.extraOps(rec, secrets)
	if err != nil {
		return 0, err
	}
	return s.update(ctx, kind, name, m, expectRev, audit)
}

// UpdateWith is Update that runs ops (puts and deletes of keys that are
// no resource, such as the events of the change: events.Batch.Ops) in
// the same etcd transaction, one write: all happen or none. It returns
// the new revision and etcd's answers to ops, in their order (an
// events.Batch reads which branch of its transaction ran).
func (s *Store) UpdateWith(ctx context.Context, kind, name string, m proto.Message, expectRev int64, ops []clientv3.Op) (int64, []*etcdserverpb.ResponseOp, error) {
	rev, resp, err := s.updateResp(ctx, kind, name, m, expectRev, ops)
	if err != nil {
		return 0, nil, err
	}
	var answers []*etcdserverpb.ResponseOp
	if len(resp.Responses) > 1 {
		answers = resp.Responses[1:]
	}
	return rev, answers, nil
}

func (s *Store) update(ctx context.Context, kind, name string, m proto.Message, expectRev int64, audit []clientv3.Op) (int64, error) {
	rev, _, err := s.updateResp(ctx, kind, name, m, expectRev, audit)
	return rev, err
}

func (s *Store) updateResp(ctx context.Context, kind, name string, m proto.Message, expectRev int64, audit []clientv3.Op) (int64, *clientv3.TxnResponse, error) {
	key, err := resourceKey(kind, name)
	if err != nil {
		return 0, nil, err
	}
	if expectRev < 0 {
		return 0, nil, errdefs.InvalidArgument("update %s: negative revision %d", key, expectRev)
	}
	val, err := marshal.Marshal(m)
	if err != nil {
		return 0, nil, errdefs.InvalidArgument("update %s: encode: %w", key, err)
	}
	cmp := clientv3.Compare(clientv3.ModRevision(key), "=", expectRev)
	if expectRev == 0 {
		cmp = clientv3.Compare(clientv3.CreateRevision(key), ">", 0)
	}
	resp, err := s.commit(ctx, write{
		op:     "update " + key,
		cmps:   s.guard(cmp),
		then:   append([]clientv3.Op{clientv3.OpPut(key, string(val))}, audit...),
		orElse: s.orElse(clientv3.OpGet(key, clientv3.WithKeysOnly())),
	})
	if err != nil {
		return 0, nil, err
	}
	if !resp.Succeeded {
		if err := s.broken(resp, "update "+key); err != nil {
			return 0, nil, err
		}
		return 0, nil, mismatch(resp, kind, name, expectRev)
	}
	return resp.Header.Revision, resp, nil
}

// Delete removes a resource if its revision is still expectRev (0 deletes
// any revision). It returns NotFound when the resource does not exist and
// Conflict when it changed since expectRev was read.
func (s *Store) Delete(ctx context.Context, kind, name string, expectRev int64) error {
	return s.DeleteAudited(ctx, kind, name, expectRev, AuditRecord{})
}

// DeleteAudited is Delete that stores rec, and the changes to sealed
// secrets, in the same etcd transaction: all happen or none.
func (s *Store) DeleteAudited(ctx context.Context, kind, name string, expectRev int64, rec AuditRecord, secrets ...SecretOp) error {
	audit, err := s.extraOps(rec, secrets)
	if err != nil {
		return err
	}
	key, err := resourceKey(kind, name)
	if err != nil {
		return err
	}
	cmp := clientv3.Compare(clientv3.ModRevision(key), "=", expectRev)
	if expectRev == 0 {
		cmp = clientv3.Compare(clientv3.CreateRevision(key), ">", 0)
	}
	resp, err := s.commit(ctx, write{
		op:     "delete " + key,
		cmps:   s.guard(cmp),
		then:   append([]clientv3.Op{clientv3.OpDelete(key)}, audit...),
		orElse: s.orElse(clientv3.OpGet(key, clientv3.WithKeysOnly())),
	})
	if err != nil {
		return err
	}
	if !resp.Succeeded {
		if err := s.broken(resp, "delete "+key); err != nil {
			return err
		}
		return mismatch(resp, kind, name, expectRev)
	}
	return nil
}

// mismatch explains a failed compare: the key is absent, or its revision
// differs.
func mismatch(resp *clientv3.TxnResponse, kind, name string, expectRev int64) error {
	if len(resp.Responses) == 0 || len(resp.Responses[0].GetResponseRange().Kvs) == 0 {
		return errdefs.NotFound("%s %q not found", kind, name)
	}
	got := resp.Responses[0].GetResponseRange().Kvs[0].ModRevision
	return errdefs.Conflict("%s %q was modified: stored revision %d, expected %d; read it again and retry", kind, name, got, expectRev)
}

// List returns the resources of a kind in name order, decoding each with a
// message from newMsg. With opts.Limit > 0 it returns at most that many and
// a non-empty next token while more remain; pass it as opts.Continue.
// Every page of one listing reads the same revision, so a listing is a
// consistent snapshot; a token older than the compaction window fails with
// FailedPrecondition (start the listing again).
func (s *Store) List(ctx context.Context, kind string, newMsg func() proto.Message, opts ListOptions) ([]Item, string, error) {
	items, next, _, err := s.list(ctx, kind, newMsg, opts)
	return items, next, err
}

// ListAllAt is ListAll that also returns the store revision the listing
// read: a Watch from that revision + 1 sees every change after it.
func (s *Store) ListAllAt(ctx context.Context, kind string, newMsg func() proto.Message) ([]Item, int64, error) {
	var out []Item
	opts := ListOptions{Limit: 1000}
	for {
		items, next, rev, err := s.list(ctx, kind, newMsg, opts)
		if err != nil {
			return nil, 0, fmt.Errorf("list %s: %w", kind, err)
		}
		out = append(out, items...)
		if next == "" {
			return out, rev, nil
		}
		opts.Continue = next
	}
}

func (s *Store) list(ctx context.Context, kind string, newMsg func() proto.Message, opts ListOptions) ([]Item, string, int64, error) {
	if err := checkKind(kind); err != nil {
		return nil, "", 0, err
	}
	if strings.Contains(opts.NamePrefix, "/") {
		return nil, "", 0, errdefs.InvalidArgument("name prefix %q: character '/' not allowed", opts.NamePrefix)
	}
	prefix := Prefix + kind + "/"
	start := prefix + opts.NamePrefix
	end := clientv3.GetPrefixRangeEnd(start)
	var rev int64
	if opts.Continue != "" {
		r, after, err := decodeContinue(opts.Continue)
		if err != nil {
			return nil, "", 0, err
		}
		rev = r
		if after >= opts.NamePrefix {
			start = prefix + after + "\x00"
		}
	}
	getOpts := []clientv3.OpOption{
		clientv3.WithRange(end),
		clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend),
	}
	if opts.Limit > 0 {
		getOpts = append(getOpts, clientv3.WithLimit(opts.Limit))
	}
	if rev > 0 {
		getOpts = append(getOpts, clientv3.WithRev(rev))
	}
	resp, err := s.client.Get(ctx, start, getOpts...)
	if err != nil {
		if errors.Is(err, rpctypes.ErrCompacted) {
			return nil, "", 0, errdefs.FailedPrecondition("list %s: continue token expired (revision %d compacted); list again from the start", kind, rev)
		}
		return nil, "", 0, etcdErr(ctx, "list "+prefix, err)
	}
	if rev == 0 {
		rev = resp.Header.Revision
	}
	items := make([]Item, 0, len(resp.Kvs))
	more := resp.More
	var size int64
	for i, kv := range resp.Kvs {
		name := strings.TrimPrefix(string(kv.Key), prefix)
		m := newMsg()
		if err := proto.Unmarshal(kv.Value, m); err != nil {
			return nil, "", 0, fmt.Errorf("list %s: decode %q: %w", kind, name, err)
		}
		items = append(items, Item{Name: name, Rev: kv.ModRevision, Msg: m, raw: kv.Value})
		if size += int64(len(kv.Value)); opts.MaxBytes > 0 && size >= opts.MaxBytes && i < len(resp.Kvs)-1 {
			more = true
			break
		}
	}
	var next string
	if more && len(items) > 0 {
		next = encodeContinue(rev, items[len(items)-1].Name)
	}
	return items, next, rev, nil
}

// A continue token is base64url("<rev>/<last name>").
func encodeContinue(rev int64, after string) string {
	return base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(rev, 10) + "/" + after))
}

func decodeContinue(tok string) (int64, string, error) {
	b, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil {
		return 0, "", errdefs.InvalidArgument("malformed continue token")
	}
	revs, after, ok := strings.Cut(string(b), "/")
	rev, err := strconv.ParseInt(revs, 10, 64)
	if !ok || err != nil || rev <= 0 || after == "" {
		return 0, "", errdefs.InvalidArgument("malformed continue token")
	}
	return rev, after, nil
}

// resourceKey validates kind and name and returns the key.
func resourceKey(kind, name string) (string, error) {
	if err := checkKind(kind); err != nil {
		return "", err
	}
	if err := checkName(name); err != nil {
		return "", err
	}
	return Key(kind, name), nil
}

// checkKind accepts lower-case kinds of letters, digits and '-'.
func checkKind(kind string) error {
	if kind == "" {
		return errdefs.InvalidArgument("empty kind")
	}
	if kind == secretsKind || kind == electionKind || kind == auditKind || kind == maintenanceKind {
		return errdefs.InvalidArgument("kind %q is reserved", kind)
	}
	for _, r := range kind {
		if (r < 'a' || r > 'z') && (r < '0' || r > '9') && r != '-' {
			return errdefs.InvalidArgument("kind %q: character %q not allowed (want a-z, 0-9, -)", kind, r)
		}
	}
	return nil
}

// checkName accepts names of 1 to 253 printable ASCII characters without
// '/' or spaces.
func checkName(name string) error {
	if name == "" {
		return errdefs.InvalidArgument("empty name")
	}
	if len(name) > 253 {
		return errdefs.InvalidArgument("name of %d bytes is too long (max 253)", len(name))
	}
	for _, r := range name {
		if r <= ' ' || r > '~' || r == '/' {
			return errdefs.InvalidArgument("name %q: character %q not allowed", name, r)
		}
	}
	return nil
}

// etcdErr classifies an etcd client error: the caller's own cancellation
// passes through; everything else means etcd could not answer.
func etcdErr(ctx context.Context, op string, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%s: %w", op, ctx.Err())
	}
	return errdefs.Unavailable("%s: etcd: %w", op, err)
}

// Lister is the List of a Store (or of what stands in for one in tests).
type Lister interface {
	List(ctx context.Context, kind string, newMsg func() proto.Message, opts ListOptions) ([]Item, string, error)
}

// ListAll lists every resource of kind, in name order, a page of 1,000 at
// a time from one consistent snapshot (List).
func ListAll(ctx context.Context, l Lister, kind string, newMsg func() proto.Message) ([]Item, error) {
	return ListPrefix(ctx, l, kind, "", newMsg)
}

// ListPrefix is ListAll of the resources whose name starts with prefix
// (ListOptions.NamePrefix): its cost is that of the names it matches, not
// of the whole kind.
func ListPrefix(ctx context.Context, l Lister, kind, prefix string, newMsg func() proto.Message) ([]Item, error) {
	var out []Item
	cont := ""
	for {
		items, next, err := l.List(ctx, kind, newMsg, ListOptions{Limit: 1000, Continue: cont, NamePrefix: prefix})
		if err != nil {
			return nil, fmt.Errorf("list %s: %w", kind, err)
		}
		out = append(out, items...)
		if next == "" {
			return out, nil
		}
		cont = next
	}
}
