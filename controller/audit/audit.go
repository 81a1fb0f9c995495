// Package audit records who changed what through the controller's API:
// each write (apply, delete, token creation, kubeconfig fetch,
// enrollment, certificate issue) and each refused call becomes an entry
// naming the caller from its certificate, the verb, the object, its
// generation before and after, the names of the fields it changed (never
// their values) and the result.
//
// The gRPC edge (package api) opens a Call for each RPC and puts it in the
// context; the domain (package resources) fills in per object what only it
// knows and stores the entry in the same etcd transaction as the write
// (store.CreateAudited and friends), marking it committed. When the RPC
// returns, the edge appends whatever the domain did not commit: refused
// and failed calls, unchanged applies, and the verbs whose write is not
// one store transaction.
package audit

import (
	"context"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/authz"
	"github.com/kilnhq/kiln/controller/store"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// Results of an entry.
const (
	OK        = "ok"
	Unchanged = "unchanged"
	Refused   = "refused"
	Failed    = "failed"
)

// Retention defaults: how long and how many entries the controller keeps.
const (
	DefaultMaxAge     = 30 * 24 * time.Hour
	DefaultMaxEntries = 100_000
)

// maxMessage bounds the error message kept in an entry.
const maxMessage = 512

// Call is one API call being audited. It is safe for concurrent use (an
// Apply writes its objects in parallel).
type Call struct {
	caller authz.Caller
	verb   string
	clock  func() time.Time

	mu      sync.Mutex
	entries []noted
}

type noted struct {
	e         *controllerv1.AuditEntry
	committed bool
}

// NewCall starts auditing a call of verb by caller.
func NewCall(caller authz.Caller, verb string, clock func() time.Time) *Call {
	if clock == nil {
		clock = time.Now
	}
	return &Call{caller: caller, verb: verb, clock: clock}
}

type callKey struct{}

// WithCall returns ctx carrying c.
func WithCall(ctx context.Context, c *Call) context.Context {
	return context.WithValue(ctx, callKey{}, c)
}

// CallFrom returns the call in ctx, nil when the context is not an audited
// API call (a reconciler's own writes).
func CallFrom(ctx context.Context) *Call {
	c, _ := ctx.Value(callKey{}).(*Call)
	return c
}

// Entry returns a new entry about kind/name with the call's caller, verb
// and the time now; it is not noted until Note or Committed.
func (c *Call) Entry(kind, name string) *controllerv1.AuditEntry {
	return &controllerv1.AuditEntry{
		Time:   timestamppb.New(c.clock()),
		User:   c.caller.Name,
		Role:   c.caller.Role,
		Serial: c.caller.Serial,
		Verb:   c.verb,
		Kind:   kind,
		Name:   name,
	}
}

// Record wraps e for a store write.
func Record(e *controllerv1.AuditEntry) store.AuditRecord {
	if e == nil {
		return store.AuditRecord{}
	}
	return store.AuditRecord{Time: e.GetTime().AsTime(), Msg: e}
}

// Committed notes that e was stored with its write.
func (c *Call) Committed(e *controllerv1.AuditEntry) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.entries = append(c.entries, noted{e: e, committed: true})
}

// Note notes e to be appended when the call ends; an empty Result is set
// from the call's error then.
func (c *Call) Note(e *controllerv1.AuditEntry) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.entries = append(c.entries, noted{e: e})
}

// Noted reports whether any entry was noted or committed.
func (c *Call) Noted() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.entries) > 0
}

// Pending returns the entries noted but not committed.
func (c *Call) Pending() []*controllerv1.AuditEntry {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*controllerv1.AuditEntry
	for _, n := range c.entries {
		if !n.committed {
			out = append(out, n.e)
		}
	}
	return out
}

// SetResult sets an entry's result and message from err: OK for nil,
// Refused for refusals (permission, limits), Failed otherwise. The
// message is the error's, truncated; errors never quote secrets (house
// rule), so neither does the entry.
func SetResult(e *controllerv1.AuditEntry, err error, refused bool) {
	switch {
	case err == nil:
		if e.Result == "" {
			e.Result = OK
		}
		return
	case refused:
		e.Result = Refused
	default:
		e.Result = Failed
	}
	msg := err.Error()
	if len(msg) > maxMessage {
		msg = msg[:maxMessage] + "..."
	}
	e.Message = msg
}

// Changed names the fields that differ between before and after, two
// messages of one type, as dotted paths of JSON field names from the root
// ("spec.bmc.address", "metadata.labels"). Messages are compared field by
// field down to their leaves; lists and maps are named as a whole. Only
// paths under the given roots are compared ("spec", "metadata.labels"); a
// nil before (a creation) names every field set in after. Values are never
// part of the result.
func Changed(before, after proto.Message, roots ...string) []string {
	var out []string
	var a, b protoreflect.Message
	if after != nil {
		b = after.ProtoReflect()
	}
	if before != nil {
		a = before.ProtoReflect()
	}
	if b == nil && a == nil {
		return nil
	}
	desc := b
	if desc == nil {
		desc = a
	}
	for _, root := range roots {
		fa, fb, fd := walk(a, b, desc.Descriptor(), root)
		if fd == nil {
			continue
		}
		diff(&out, root, fd, fa, fb)
	}
	sort.Strings(out)
	return out
}

// walk follows a dotted path of JSON names from the messages a and b (a
// may be nil) and returns the values and descriptor of the last field.
func walk(a, b protoreflect.Message, md protoreflect.MessageDescriptor, path string) (protoreflect.Value, protoreflect.Value, protoreflect.FieldDescriptor) {
	var va, vb protoreflect.Value
	var fd protoreflect.FieldDescriptor
	for i, seg := range strings.Split(path, ".") {
		if i > 0 {
			if fd.Kind() != protoreflect.MessageKind || fd.IsList() || fd.IsMap() {
				return va, vb, nil
			}
			md = fd.Message()
			a, b = msgOf(va), msgOf(vb)
		}
		fd = md.Fields().ByJSONName(seg)
		if fd == nil {
			return va, vb, nil
		}
		va, vb = get(a, fd), get(b, fd)
	}
	return va, vb, fd
}

func msgOf(v protoreflect.Value) protoreflect.Message {
	if !v.IsValid() {
		return nil
	}
	return v.Message()
}

func get(m protoreflect.Message, fd protoreflect.FieldDescriptor) protoreflect.Value {
	if m == nil || !m.Has(fd) {
		return protoreflect.Value{}
	}
	return m.Get(fd)
}

// diff appends path when the values of field fd differ, descending into
// singular messages.
func diff(out *[]string, path string, fd protoreflect.FieldDescriptor, a, b protoreflect.Value) {
	if !a.IsValid() && !b.IsValid() {
		return
	}
	if fd.Kind() == protoreflect.MessageKind && !fd.IsList() && !fd.IsMap() {
		ma, mb := msgOf(a), msgOf(b)
		fields := fd.Message().Fields()
		n := len(*out)
		for i := range fields.Len() {
			f := fields.Get(i)
			diff(out, path+"."+f.JSONName(), f, get(ma, f), get(mb, f))
		}
		if len(*out) == n && (a.IsValid() != b.IsValid()) && fields.Len() == 0 {
			*out = append(*out, path)
		}
		return
	}
	if !a.IsValid() || !b.IsValid() || !equal(fd, a, b) {
		*out = append(*out, path)
	}
}

// equal compares two set values of fd.
func equal(fd protoreflect.FieldDescriptor, a, b protoreflect.Value) bool {
	switch {
	case fd.IsList():
		la, lb := a.List(), b.List()
		if la.Len() != lb.Len() {
			return false
		}
		for i := range la.Len() {
			if !scalarEqual(fd, la.Get(i), lb.Get(i)) {
				return false
			}
		}
		return true
	case fd.IsMap():
		ma, mb := a.Map(), b.Map()
		if ma.Len() != mb.Len() {
			return false
		}
		same := true
		ma.Range(func(k protoreflect.MapKey, v protoreflect.Value) bool {
			w := mb.Get(k)
			if !w.IsValid() || !scalarEqual(fd.MapValue(), v, w) {
				same = false
			}
			return same
		})
		return same
	}
	return scalarEqual(fd, a, b)
}

func scalarEqual(fd protoreflect.FieldDescriptor, a, b protoreflect.Value) bool {
	if fd.Kind() == protoreflect.MessageKind || fd.Kind() == protoreflect.GroupKind {
		return proto.Equal(a.Message().Interface(), b.Message().Interface())
	}
	return a.Equal(b)
}
