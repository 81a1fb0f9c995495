package topologyexec

import (
	"context"
	"log/slog"
	"sort"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"k8s.io/client-go/util/workqueue"

	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/topologyplan"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// A cluster's status writes queue the cluster; its class only when what
// the class plans from changes (class, pin, reconciled), since a class
// reconcile reads every cluster.
func TestRouteQueuesClassOnlyWhenItsViewChanges(t *testing.T) {
	e := New(nil, nil, Config{}, slog.New(slog.DiscardHandler))
	cluster := func(class string, pin int64, phase string) store.WatchEvent {
		c := &typesv1.Cluster{Metadata: &typesv1.ObjectMeta{Name: "c1", Generation: 1},
			Spec:   &typesv1.ClusterSpec{Topology: &typesv1.ClusterTopology{Class: class}},
			Status: &typesv1.ClusterStatus{Phase: phase, Topology: &typesv1.ClusterTopologyStatus{ClassRevision: pin, ReconciledRevision: pin}}}
		if pin > 0 {
			c.Status.Conditions = []*typesv1.Condition{{Type: topologyplan.ConditionTopologyReconciled, Status: "True", ObservedGeneration: 1}}
		}
		b, err := proto.Marshal(c)
		require.NoError(t, err)
		return store.WatchEvent{Type: store.EventPut, Name: "c1", Value: b}
	}
	for _, step := range []struct {
		name string
		ev   store.WatchEvent
		want []string
	}{
		{"first seen", cluster("a", 0, ""), []string{"class/a", "cluster/c1"}},
		{"status write", cluster("a", 0, "Provisioning"), []string{"cluster/c1"}},
		{"pinned and reconciled", cluster("a", 1, "Provisioning"), []string{"class/a", "cluster/c1"}},
		{"phase only", cluster("a", 1, "Ready"), []string{"cluster/c1"}},
		{"moved to class b", cluster("b", 1, "Ready"), []string{"class/a", "class/b", "cluster/c1"}},
		{"deleted", store.WatchEvent{Type: store.EventDelete, Name: "c1"}, []string{"class/b", "cluster/c1"}},
	} {
		q := workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]())
		e.route(context.Background(), q, ClustersKind, step.ev)
		var got []string
		for q.Len() > 0 {
			k, _ := q.Get()
			got = append(got, k)
			q.Done(k)
		}
		q.ShutDown()
		sort.Strings(got)
		require.Equal(t, step.want, got, step.name)
	}
}
