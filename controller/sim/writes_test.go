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
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// writeCounter watches every key under /kiln/ from a revision on and
// sorts each etcd write (a revision) by what it touched: a Host (with or
// without events riding along), events alone, or anything else.
type writeCounter struct {
	cancel context.CancelFunc
	done   chan struct{}

	mu sync.Mutex
	// Revisions: with a Host put, with event puts only, other.
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
		host, event, other := false, false, false
		var reasons []string
		for _, ev := range byRev[rev] {
			key := string(ev.Kv.Key)
			switch {
			case strings.HasPrefix(key, "/kiln/v1/hosts/") && ev.Type == clientv3.EventTypePut:
				host = true
			case strings.HasPrefix(key, events.Prefix):
				if ev.Type == clientv3.EventTypePut {
					event = true
					c.eventPuts++
					e := &typesv1.Event{}
					if proto.Unmarshal(ev.Kv.Value, e) == nil {
						reasons = append(reasons, e.GetReason())
					}
				}
			default:
				other = true
			}
		}
		switch {
		case host:
			c.hostWrites++
		case event && !other:
			c.eventOnlyWrites++
			for _, r := range reasons {
				c.eventOnly[r]++
			}
		default:
			c.otherWrites++
		}
	}
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
// store and counts the etcd writes of each on its way: the lifecycle's
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
	t.Logf("per host: %.1f etcd writes: %.1f with a Host (status, heartbeats, progress), %.1f events alone %v, %.1f other; %.1f event puts",
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
