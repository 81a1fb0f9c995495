package dashboard

import (
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func hostAt(name, rv string, state typesv1.HostState, op *typesv1.OperationStatus) *controllerv1.Resource {
	return &controllerv1.Resource{Kind: &controllerv1.Resource_Host{Host: &typesv1.Host{
		Metadata: &typesv1.ObjectMeta{Name: name, ResourceVersion: rv},
		Status:   &typesv1.HostStatus{State: state, LastOperation: op},
	}}}
}

// TestCacheApply folds a transcript of watch events into the cache: an
// event older than what the cache holds (a list saw the newer object
// first) changes nothing, a delete removes the host and its journal, and
// an operation replaced while Running is journalled as Ended at the start
// of the next one.
func TestCacheApply(t *testing.T) {
	c := newCache(nil, time.Second, time.Minute, slog.New(slog.DiscardHandler))
	t0 := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	op := func(id, state string, at time.Duration) *typesv1.OperationStatus {
		return &typesv1.OperationStatus{Id: id, Kind: id, State: state, Started: timestamppb.New(t0.Add(at))}
	}
	state := func() typesv1.HostState {
		h, _, _ := c.host("h1")
		return h.GetStatus().GetState()
	}
	gen0, changed := c.changes()

	c.apply("Host", &controllerv1.WatchEvent{Type: "ADDED", Resource: hostAt("h1", "10", typesv1.HostState_HOST_STATE_PROVISIONING, op("PowerOff", "Running", 0))})
	require.Equal(t, typesv1.HostState_HOST_STATE_PROVISIONING, state())
	select {
	case <-changed:
	default:
		t.Fatal("apply did not signal a change")
	}

	c.apply("Host", &controllerv1.WatchEvent{Type: "MODIFIED", Resource: hostAt("h1", "9", typesv1.HostState_HOST_STATE_AVAILABLE, nil)})
	require.Equal(t, typesv1.HostState_HOST_STATE_PROVISIONING, state(), "an older event replaced a newer object")

	c.apply("Host", &controllerv1.WatchEvent{Type: "MODIFIED", Resource: hostAt("h1", "12", typesv1.HostState_HOST_STATE_PROVISIONING, op("PowerOn", "Running", 5*time.Second))})
	c.apply("Host", &controllerv1.WatchEvent{Type: "MODIFIED", Resource: hostAt("h1", "13", typesv1.HostState_HOST_STATE_PROVISIONING, op("PowerOn", "Succeeded", 5*time.Second))})
	_, j, _ := c.host("h1")
	require.Len(t, j, 2)
	require.Equal(t, "PowerOff", j[0].GetId())
	require.Equal(t, stateEnded, j[0].GetState())
	require.Equal(t, t0.Add(5*time.Second), j[0].GetFinished().AsTime(), "ended when the next started")
	require.Equal(t, "Succeeded", j[1].GetState(), "the same id updates its entry")

	c.apply("Host", &controllerv1.WatchEvent{Type: "DELETED", Resource: hostAt("h1", "", 0, nil)})
	_, j, ok := c.host("h1")
	require.False(t, ok)
	require.Empty(t, j)
	gen, _ := c.changes()
	require.Equal(t, gen0+4, gen, "generations: added, two modified, deleted (the stale event changed nothing)")
}
