package provision

import (
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/clock"
)

// hostQueue is the Executor's per-host work queue, client-go's delaying
// workqueue: a host is queued at most once, is handed to one worker at a
// time (a host queued while being worked on is handed out again after
// Done), and AddAfter keeps only the earliest pending time of a host.
//
// Unlike the queue it replaces, a pending AddAfter cannot be dropped: the
// AddAfter of a host deleted meanwhile still fires, and Reconcile finds no
// host and forgets it. After ShutDown, Get hands out what is still queued
// before it reports the shutdown; workers skip those (their ctx is done).
type hostQueue = workqueue.TypedDelayingInterface[string]

// newHostQueue returns an empty hostQueue whose delays run on clk (the
// real clock when nil).
func newHostQueue(clk clock.WithTicker) hostQueue {
	return workqueue.NewTypedDelayingQueueWithConfig(workqueue.TypedDelayingQueueConfig[string]{
		Name:  "provision",
		Clock: clk,
	})
}
