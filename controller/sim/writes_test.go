package sim_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// writeCounter watches every key under /kiln/ from a revision on and
// sorts each object's write by what it touched: a Host (with or without
// events riding along), events alone, or anything else. An object's
// write is what one store write did to one object: without group commit
// an etcd revision holds one, with it a revision may hold the writes of
// several objects.
type writeCounter struct {
	cancel context.CancelFunc
	done   chan struct{}

	mu sync.Mutex
	// Object writes: with a Host put, with event puts only, other.
	hostWrites, eventOnlyWrites, otherWrites int
	// eventPuts counts event keys put; eventOnly the reasons of the events
	// written alone.
	eventPuts int
	eventOnly map[string]int
	lastRev   int64
}

func (w *world) countWrites(fromRev int64) *writeCounter {
	ctx, cancel := context.WithCancel(w.ctx)
	c := &writeCounter{cancel: cancel, done: make(chan struct{}), eventOnly: map[string]int{}}
	go func() {
		defer close(c.done)
		for resp := range w.client.Watch(ctx, "/kiln/", clientv3.WithPrefix(), clientv3.WithRev(fromRev+1)) {
			c.add(resp.Events)
		}
	}()
	return c
}

func (c *writeCounter) add(evs []*clientv3.Event) {
	c.mu.Lock()
	defer c.mu.Unlock()
	byRev := map[int64][]*clientv3.Event{}
	var revs []int64
	for _, ev := range evs {
		rev := ev.Kv.ModRevision
		if _, ok := byRev[rev]; !ok {
			revs = append(revs, rev)
		}
		byRev[rev] = append(byRev[rev], ev)
		c.lastRev = max(c.lastRev, rev)
	}
	for _, rev := range revs {
		// One etcd write may carry the writes of several objects (group
		// commit puts each in a nested transaction of its own): count
		// each object's write, its resource put or its events alone.
		type objWrite struct {
			host, resource, event bool
			reasons               []string
		}
		objs := map[string]*objWrite{}
		var order []string
		other := false
		for _, ev := range byRev[rev] {
			obj, isEvent, ok := objectOf(string(ev.Kv.Key))
			if !ok {
				other = true
				continue
			}
			o := objs[obj]
			if o == nil {
				o = &objWrite{}
				objs[obj] = o
				order = append(order, obj)
			}
			switch {
			case isEvent:
				if ev.Type == clientv3.EventTypePut {
					o.event = true
					c.eventPuts++
					e := &typesv1.Event{}
					if proto.Unmarshal(ev.Kv.Value, e) == nil {
						o.reasons = append(o.reasons, e.GetReason())
					}
				}
			case strings.HasPrefix(obj, "hosts/") && ev.Type == clientv3.EventTypePut:
				o.host = true
			default:
				o.resource = true
			}
		}
		for _, obj := range order {
			switch o := objs[obj]; {
			case o.host:
				c.hostWrites++
			case o.event && !o.resource:
				c.eventOnlyWrites++
				for _, r := range o.reasons {
					c.eventOnly[r]++
				}
			default:
				c.otherWrites++
			}
		}
		if len(objs) == 0 && other {
			c.otherWrites++
		}
	}
}

// objectOf names the object a key belongs to ("hosts/rack-0001"): a
// resource's key, or an event's about it. ok is false for other keys
// (audit records, secrets, election and lease keys).
func objectOf(key string) (obj string, isEvent, ok bool) {
	if rest, found := strings.CutPrefix(key, events.Prefix); found {
		kind, rest, _ := strings.Cut(rest, "/")
		name, _, _ := strings.Cut(rest, "/")
		return kind + "/" + name, true, true
	}
	rest, found := strings.CutPrefix(key, store.Prefix)
	if !found || strings.Count(rest, "/") != 1 || strings.HasPrefix(rest, "audit/") {
		return "", false, false
	}
	return rest, false, true
}

// waitSeen waits until the watch saw revision upTo, then ends it.
func (c *writeCounter) waitSeen(t testing.TB, upTo int64) {
	require.Eventually(t, func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.lastRev >= upTo
	}, time.Minute, 10*time.Millisecond, "the watch did not see revision %d", upTo)
	c.cancel()
	<-c.done
}

// TestWritesPerHost provisions hosts through the real executor and
// store and counts the writes of each on its way (a store write to the
// host: with group commit several hosts' writes may share one etcd
// revision, and each still counts for its host): the lifecycle's
// events ride in the transaction of the status they go with, and an
// agent's AgentReachable in the heartbeat's Host write, so no event is a
// write of its own, and CheckBMC and BootAgentMedia
// (no power, no lay) are stored with the next step's status.
func TestWritesPerHost(t *testing.T) {
	w := newWorld(t, fastSim)
	names, err := sim.Populate(w.ctx, w.st, 10, "writes")
	require.NoError(t, err)
	rev0 := w.revision()
	wc := w.countWrites(rev0)
	stop := w.start()
	defer stop()
	w.waitFor(names, "Provisioned", provisioned)
	stop()
	w.checkProvisionedOnce(names)
	end := w.revision()
	wc.waitSeen(t, end)

	n := float64(len(names))
	t.Logf("per host: %.1f etcd revisions; object writes: %.1f with a Host (status, heartbeats, progress), %.1f events alone %v, %.1f other; %.1f event puts",
		float64(end-rev0)/n, float64(wc.hostWrites)/n, float64(wc.eventOnlyWrites)/n, wc.eventOnly, float64(wc.otherWrites)/n, float64(wc.eventPuts)/n)
	for _, r := range []string{"Registering", "Inspecting", "Available", "Provisioning", "ImageLaid", "Provisioned", "AgentReachable"} {
		if wc.eventOnly[r] > 0 {
			t.Errorf("%d %s events were written alone, want each in its status write", wc.eventOnly[r], r)
		}
	}
	// A Redfish host's status writes: PowerOff (with Registering ...
	// Provisioning), PowerOn, WaitBootAgent, LayImage, WriteIdentity,
	// BootDisk, WaitInstalledAgent, Provisioned: 8; heartbeats that
	// changed something: the boot agent's and the installed agent's
	// first, and one per wait step; the lay's progress reports. Before
	// coalescing a host cost 10 status writes and 7 event writes.
	if per := float64(wc.hostWrites) / n; per > 16 {
		t.Errorf("writes with a Host per host = %.1f, want at most 16", per)
	}
}
