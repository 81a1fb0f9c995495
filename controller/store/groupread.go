package store

import (
	"context"
	"sync"
	"sync/atomic"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// get reads key, grouped with other reads unless read grouping is off,
// and returns its key-value, nil when the key does not exist. The read
// is linearizable and began after the call did. An etcd error comes back
// wrapped (etcdErr): Unavailable, or ctx's error once ctx is done. It
// blocks until etcd answers or ctx ends.
func (s *Store) get(ctx context.Context, key string) (*mvccpb.KeyValue, error) {
	if s.reads == nil {
		resp, err := s.client.Get(ctx, key)
		if err != nil {
			return nil, etcdErr(ctx, "get "+key, err)
		}
		if len(resp.Kvs) == 0 {
			return nil, nil
		}
		return resp.Kvs[0], nil
	}
	return s.reads.do(ctx, key)
}

// reader groups the linearizable single-key reads (Store.Get) of a Store
// and of its Fenced copies, as the committer groups writes: a read is
// sent at once when fewer than MaxInFlight read groups are in flight; the
// reads that arrive meanwhile wait and go together in the next one, as
// one read-only etcd transaction of one get per distinct key. A
// read-only transaction is linearizable as a Get is, and a read joins
// only a group sent after it was queued, so each caller reads a state at
// least as new as any write completed before its call.
type reader struct {
	client   *clientv3.Client
	inFlight int // limit
	maxOps   int

	mu      sync.Mutex
	queue   []*readRequest
	sending int // groups in flight

	// txns counts the requests sent (a Get or a transaction), gets the
	// distinct keys read in them, reads the callers answered, for tests
	// and benchmarks.
	txns, gets, reads atomic.Uint64
}

func newReader(client *clientv3.Client, g GroupCommit) *reader {
	r := &reader{client: client, inFlight: g.MaxInFlight, maxOps: g.MaxOps}
	if r.inFlight <= 0 {
		r.inFlight = DefaultGroupInFlight
	}
	if r.maxOps <= 0 {
		r.maxOps = DefaultGroupMaxOps
	}
	// The answer carries every object read: a group of MaxBatchOps Hosts
	// would be megabytes in one response.
	r.maxOps = min(r.maxOps, MaxReadGroup)
	return r
}

// MaxReadGroup bounds the keys of one grouped read, whatever MaxOps
// allows: 256 objects of a few KiB are an answer of about 1 MiB.
const MaxReadGroup = 256

type readRequest struct {
	ctx   context.Context
	key   string
	state int             // queued, sent or dropped, under reader.mu
	done  chan readResult // buffered: the sender never blocks
}

type readResult struct {
	kv  *mvccpb.KeyValue
	err error
}

// do queues a read of key and waits for its answer (Store.get).
func (rd *reader) do(ctx context.Context, key string) (*mvccpb.KeyValue, error) {
	if err := ctx.Err(); err != nil {
		return nil, etcdErr(ctx, "get "+key, err)
	}
	r := &readRequest{ctx: ctx, key: key, done: make(chan readResult, 1)}
	rd.mu.Lock()
	rd.queue = append(rd.queue, r)
	if rd.sending < rd.inFlight {
		rd.sending++
		go rd.run()
	}
	rd.mu.Unlock()
	select {
	case res := <-r.done:
		return res.kv, res.err
	case <-ctx.Done():
	}
	rd.mu.Lock()
	if r.state == queued {
		r.state = dropped
	}
	rd.mu.Unlock()
	select {
	case res := <-r.done: // answered meanwhile
		return res.kv, res.err
	default:
		return nil, etcdErr(ctx, "get "+key, ctx.Err())
	}
}

// run sends groups while reads are queued; one run is one group in
// flight.
func (rd *reader) run() {
	for {
		rd.mu.Lock()
		g, keys := rd.take()
		if len(g) == 0 {
			rd.sending--
			rd.mu.Unlock()
			return
		}
		rd.mu.Unlock()
		rd.send(g, keys)
	}
}

// take removes from the queue, in order, the reads of the next group:
// up to maxOps distinct keys; reads of a key already in the group join
// its get. It drops the reads whose callers left. It returns the reads
// and the distinct keys, in the order of their first read. Call with mu
// held.
func (rd *reader) take() ([]*readRequest, []string) {
	var g []*readRequest
	var keys []string
	seen := map[string]bool{}
	rest := rd.queue[:0]
	for _, r := range rd.queue {
		if r.state == dropped || r.ctx.Err() != nil {
			r.state = dropped
			continue
		}
		if !seen[r.key] {
			if len(keys) >= rd.maxOps {
				rest = append(rest, r)
				continue
			}
			seen[r.key] = true
			keys = append(keys, r.key)
		}
		r.state = sent
		g = append(g, r)
	}
	clear(rd.queue[len(rest):])
	rd.queue = rest
	return g, keys
}

// send reads the keys of a group and answers each of its reads. A read
// alone goes as a Get under its caller's context, as without grouping;
// a group goes under a context that ends when every caller's has: one
// Get when all read one key, else one transaction of one get per key.
func (rd *reader) send(g []*readRequest, keys []string) {
	rd.txns.Add(1)
	rd.gets.Add(uint64(len(keys)))
	rd.reads.Add(uint64(len(g)))
	ctx := g[0].ctx
	if len(g) > 1 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithCancel(context.Background())
		defer cancel()
		var left atomic.Int64
		left.Store(int64(len(g)))
		for _, r := range g {
			stop := context.AfterFunc(r.ctx, func() {
				if left.Add(-1) == 0 {
					cancel()
				}
			})
			defer stop()
		}
	}
	answers := make(map[string]*mvccpb.KeyValue, len(keys))
	var err error
	if len(keys) == 1 {
		var resp *clientv3.GetResponse
		if resp, err = rd.client.Get(ctx, keys[0]); err == nil && len(resp.Kvs) > 0 {
			answers[keys[0]] = resp.Kvs[0]
		}
	} else {
		ops := make([]clientv3.Op, len(keys))
		for i, k := range keys {
			ops[i] = clientv3.OpGet(k)
		}
		var resp *clientv3.TxnResponse
		if resp, err = rd.client.Txn(ctx).Then(ops...).Commit(); err == nil {
			if len(resp.Responses) != len(keys) {
				for _, r := range g {
					r.done <- readResult{err: errdefs.Unavailable("get %s: etcd: %d answers to a grouped read of %d keys", r.key, len(resp.Responses), len(keys))}
				}
				return
			}
			for i, k := range keys {
				if kvs := resp.Responses[i].GetResponseRange().GetKvs(); len(kvs) > 0 {
					answers[k] = kvs[0]
				}
			}
		}
	}
	for _, r := range g {
		if err != nil {
			r.done <- readResult{err: etcdErr(r.ctx, "get "+r.key, err)}
			continue
		}
		r.done <- readResult{kv: answers[r.key]}
	}
}
