package store

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// GroupCommit configures how a Store groups concurrent single-object
// writes (Create, Update, Delete and their Audited and With forms) into
// one etcd transaction: a write is sent at once when fewer than
// MaxInFlight grouped transactions are in flight; the writes that arrive
// meanwhile wait and go together in the next one. There is no added
// delay.
//
// Each write of a group is a nested transaction of its own (its compares,
// among them its own pause and fence compares, its puts, its else reads),
// so each one holds or fails on its own, exactly as if it had been sent
// alone: a conflicting write gets its Conflict while the others of its
// group commit, all at the group's revision. Writes touching the same key
// never share a group.
//
// Concurrent Gets are grouped the same way, apart from the writes: a Get
// is sent at once when fewer than MaxInFlight read groups are in flight;
// the Gets that arrive meanwhile go together in the next one, one
// read-only transaction of one get per distinct key (at most MaxOps
// keys), as linearizable as a Get. Gets of the same key share its get.
// Only Store.Get is grouped: not List, GetUnpaused or other reads.
type GroupCommit struct {
	// Disabled sends every write in a transaction of its own and every
	// Get in a request of its own.
	Disabled bool
	// DisableReads sends every Get in a request of its own, leaving the
	// writes grouped.
	DisableReads bool
	// MaxInFlight is the most grouped transactions in flight at once, for
	// the writes and, apart, for the reads; 0 means DefaultGroupInFlight.
	MaxInFlight int
	// MaxOps bounds a grouped transaction by etcd's --max-txn-ops, which
	// counts the operations of each level of a transaction and of the
	// levels above it: a group of N writes whose widest write (compares,
	// puts or else reads) has W operations counts N + W. 0 means
	// DefaultGroupMaxOps, etcd's default, which any etcd takes; the
	// embedded etcd takes MaxBatchOps. A write wider than MaxOps goes
	// alone, as it would without grouping. A read group of K keys counts
	// K.
	MaxOps int
	// MaxBytes bounds the keys and values of a grouped transaction, under
	// etcd's --max-request-bytes (1.5 MiB by default); 0 means
	// DefaultGroupMaxBytes. A larger write goes alone.
	MaxBytes int
}

// Defaults of GroupCommit. Two in flight: fewer transactions carry more
// writes each, and etcd spends its time per transaction; with 256
// writers, 1 and 2 in flight commit the most writes per second, 8 the
// fewest (BenchmarkUpdateParallel, docs/scale.md "Group commit"), and a
// write that comes while one transaction is in flight goes at once.
const (
	DefaultGroupInFlight = 2
	DefaultGroupMaxOps   = 128
	DefaultGroupMaxBytes = 1 << 20
)

// WithGroupCommit configures the grouping of writes (GroupCommit). Without
// it a Store groups writes with the defaults.
func WithGroupCommit(g GroupCommit) Option { return func(st *Store) { st.groupCfg = g } }

// write is one single-object write: the transaction it would be alone.
// Its compares and else reads include the guard's (guard, orElse).
type write struct {
	// op names the write in errors ("update /kiln/v1/hosts/h1").
	op     string
	cmps   []clientv3.Cmp
	then   []clientv3.Op
	orElse []clientv3.Op
}

// commit runs w, grouped with other writes unless grouping is off, and
// returns the outcome of w's own transaction: Succeeded and Responses
// are w's, Header the transaction's. An etcd error comes back wrapped
// (etcdErr): Unavailable, or ctx's error once ctx is done. It blocks
// until etcd answers or ctx ends.
func (s *Store) commit(ctx context.Context, w write) (*clientv3.TxnResponse, error) {
	if s.group == nil {
		return w.alone(ctx, s.client)
	}
	return s.group.do(ctx, w)
}

// alone sends w as a transaction of its own under ctx.
func (w write) alone(ctx context.Context, client *clientv3.Client) (*clientv3.TxnResponse, error) {
	resp, err := client.Txn(ctx).If(w.cmps...).Then(w.then...).Else(w.orElse...).Commit()
	if err != nil {
		return nil, etcdErr(ctx, w.op, err)
	}
	return resp, nil
}

// committer groups the writes of a Store and of its Fenced copies.
type committer struct {
	client   *clientv3.Client
	inFlight int // limit
	maxOps   int
	maxBytes int

	mu      sync.Mutex
	queue   []*request
	sending int // transactions in flight

	// txns and writes count the transactions sent and the writes in
	// them, for benchmarks.
	txns, writes atomic.Uint64
}

func newCommitter(client *clientv3.Client, g GroupCommit) *committer {
	c := &committer{client: client, inFlight: g.MaxInFlight, maxOps: g.MaxOps, maxBytes: g.MaxBytes}
	if c.inFlight <= 0 {
		c.inFlight = DefaultGroupInFlight
	}
	if c.maxOps <= 0 {
		c.maxOps = DefaultGroupMaxOps
	}
	if c.maxBytes <= 0 {
		c.maxBytes = DefaultGroupMaxBytes
	}
	return c
}

// The states of a request, under committer.mu.
const (
	queued = iota
	sent
	dropped // its caller left before it was sent
)

type request struct {
	ctx context.Context
	w   write
	// width is etcd's count of w's transaction: the most of its
	// compares, puts and else reads.
	width int
	size  int
	// writes are the keys w puts or deletes; reads the other keys it
	// compares or reads. alone: w has a range and goes in a transaction of
	// its own.
	writes, reads []string
	alone         bool

	state int
	done  chan result // buffered: the sender never blocks
}

type result struct {
	resp *clientv3.TxnResponse
	err  error
}

func newRequest(ctx context.Context, w write) *request {
	r := &request{ctx: ctx, w: w, width: max(len(w.cmps), len(w.then), len(w.orElse)), done: make(chan result, 1)}
	seen := map[string]bool{}
	for _, op := range w.then {
		r.addOp(op, op.IsPut() || op.IsDelete(), seen)
	}
	for _, op := range w.orElse {
		r.addOp(op, false, seen)
	}
	for _, cmp := range w.cmps {
		r.addCmp(cmp, seen)
	}
	return r
}

func (r *request) addCmp(cmp clientv3.Cmp, seen map[string]bool) {
	k := string(cmp.KeyBytes())
	r.size += len(k) + len(cmp.ValueBytes()) + 16
	if len(cmp.GetCompare().RangeEnd) > 0 {
		r.alone = true
	}
	if !seen[k] {
		seen[k] = true
		r.reads = append(r.reads, k)
	}
}

func (r *request) addOp(op clientv3.Op, isWrite bool, seen map[string]bool) {
	if op.IsTxn() {
		// A nested transaction (an event log's, events.Batch) joins a
		// group: etcd bounds the ops of each level, not their sum, and
		// either branch may run, so the keys both put or delete are
		// writes.
		cmps, thenOps, elseOps := op.Txn()
		r.width = max(r.width, len(cmps), len(thenOps), len(elseOps))
		for _, o := range slices.Concat(thenOps, elseOps) {
			r.addOp(o, o.IsPut() || o.IsDelete(), seen)
		}
		for _, cmp := range cmps {
			r.addCmp(cmp, seen)
		}
		return
	}
	k := string(op.KeyBytes())
	r.size += len(k) + len(op.ValueBytes()) + 16
	if len(op.RangeBytes()) > 0 {
		r.alone = true
	}
	if isWrite {
		r.writes = append(r.writes, k)
		seen[k] = true
	} else if !seen[k] {
		seen[k] = true
		r.reads = append(r.reads, k)
	}
}

// do queues w and waits for its outcome (Store.commit).
func (c *committer) do(ctx context.Context, w write) (*clientv3.TxnResponse, error) {
	if err := ctx.Err(); err != nil {
		return nil, etcdErr(ctx, w.op, err)
	}
	r := newRequest(ctx, w)
	c.mu.Lock()
	c.queue = append(c.queue, r)
	if c.sending < c.inFlight {
		c.sending++
		go c.run()
	}
	c.mu.Unlock()
	select {
	case res := <-r.done:
		return res.resp, res.err
	case <-ctx.Done():
	}
	c.mu.Lock()
	if r.state == queued {
		r.state = dropped
	}
	c.mu.Unlock()
	select {
	case res := <-r.done: // it was answered meanwhile
		return res.resp, res.err
	default:
		// Not sent: it never will be. Sent: it may commit, as a
		// transaction whose caller gives up may.
		return nil, etcdErr(ctx, w.op, ctx.Err())
	}
}

// run sends groups while writes are queued; one run is one transaction
// in flight.
func (c *committer) run() {
	for {
		c.mu.Lock()
		g := c.take()
		if len(g) == 0 {
			c.sending--
			c.mu.Unlock()
			return
		}
		c.mu.Unlock()
		c.send(g)
	}
}

// take removes from the queue, in order, the writes of the next group:
// up to the op and byte bounds, and no two writes where one writes a key
// the other touches (those wait for a later group, in their order). It
// drops the writes whose callers left. Call with mu held.
func (c *committer) take() []*request {
	var g []*request
	writes, reads := map[string]bool{}, map[string]bool{}
	width, size := 0, 0
	full := false
	rest := c.queue[:0]
	for _, r := range c.queue {
		if r.state == dropped || r.ctx.Err() != nil {
			r.state = dropped
			continue
		}
		if full || !c.fits(g, r, width, size) || clashes(r, writes, reads) {
			rest = append(rest, r)
			continue
		}
		if len(g) > 0 && r.alone {
			rest = append(rest, r)
			continue
		}
		r.state = sent
		g = append(g, r)
		width, size = max(width, r.width), size+r.size
		for _, k := range r.writes {
			writes[k] = true
		}
		for _, k := range r.reads {
			reads[k] = true
		}
		full = r.alone
	}
	clear(c.queue[len(rest):])
	c.queue = rest
	return g
}

// fits reports whether r joins g within the bounds; the first write of
// a group always does.
func (c *committer) fits(g []*request, r *request, width, size int) bool {
	if len(g) == 0 {
		return true
	}
	return len(g)+1+max(width, r.width) <= c.maxOps && size+r.size <= c.maxBytes
}

// clashes reports whether r writes a key the group touches or touches a
// key the group writes: etcd refuses a transaction that puts a key twice,
// and a compare must not depend on which write of a group runs first.
func clashes(r *request, writes, reads map[string]bool) bool {
	for _, k := range r.writes {
		if writes[k] || reads[k] {
			return true
		}
	}
	for _, k := range r.reads {
		if writes[k] {
			return true
		}
	}
	return false
}

// send commits a group and answers each of its writes. A write alone goes
// as its own transaction under its caller's context, as without grouping.
// A group goes as one transaction of nested ones, under a context that
// ends when every caller's has.
func (c *committer) send(g []*request) {
	c.txns.Add(1)
	c.writes.Add(uint64(len(g)))
	if len(g) == 1 {
		r := g[0]
		resp, err := r.w.alone(r.ctx, c.client)
		r.done <- result{resp: resp, err: err}
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var left atomic.Int64
	left.Store(int64(len(g)))
	ops := make([]clientv3.Op, len(g))
	for i, r := range g {
		ops[i] = clientv3.OpTxn(r.w.cmps, r.w.then, r.w.orElse)
		stop := context.AfterFunc(r.ctx, func() {
			if left.Add(-1) == 0 {
				cancel()
			}
		})
		defer stop()
	}
	resp, err := c.client.Txn(ctx).Then(ops...).Commit()
	for i, r := range g {
		if err != nil {
			r.done <- result{err: etcdErr(r.ctx, r.w.op, err)}
			continue
		}
		var sub *clientv3.TxnResponse
		if i < len(resp.Responses) {
			if t := resp.Responses[i].GetResponseTxn(); t != nil {
				sub = &clientv3.TxnResponse{Header: resp.Header, Succeeded: t.Succeeded, Responses: t.Responses}
			}
		}
		if sub == nil {
			r.done <- result{err: errdefs.Unavailable("%s: etcd: no answer for the write in a grouped transaction of %d answers", r.w.op, len(resp.Responses))}
			continue
		}
		r.done <- result{resp: sub}
	}
}
