package clusterexec

import (
	"context"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"
	"k8s.io/client-go/util/workqueue"

	"github.com/kilnhq/kiln/controller/store"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// clusterQueue holds the names of the clusters to reconcile, and
// collectKey. client-go's work queue never hands one key to two workers
// at once, and a key added while it is worked on is worked on again after.
type clusterQueue = workqueue.TypedRateLimitingInterface[string]

// collectKey is the queue's key of the fleet-wide clean-up
// (Collect); no cluster is named "" (the
// store refuses empty names).
const collectKey = ""

// Run reconciles every cluster, ClusterWorkers at a time, until ctx ends:
// each Interval every cluster is queued, and a cluster whose long action
// ended is queued at once. A slow cluster holds up one worker for one
// pass at most: its long actions run in the background (startLong). Run
// blocks, and returns once the bootstraps and long actions it started
// have ended too.
func (e *Executor) Run(ctx context.Context) error {
	qcfg := workqueue.TypedRateLimitingQueueConfig[string]{Name: "clusterexec"}
	if e.cfg.QueueClock != nil {
		qcfg.Clock = e.cfg.QueueClock
	}
	q := workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[string](), qcfg)
	e.mu.Lock()
	e.queue = q
	e.mu.Unlock()
	defer e.Wait()
	defer func() {
		e.mu.Lock()
		e.queue = nil
		e.mu.Unlock()
	}()

	var workers sync.WaitGroup
	for range e.cfg.ClusterWorkers {
		workers.Go(func() {
			for e.work(ctx, q) {
			}
		})
	}
	t := time.NewTicker(e.cfg.Interval)
	defer t.Stop()
	for {
		e.enqueueAll(ctx, q)
		select {
		case <-ctx.Done():
			q.ShutDown()
			workers.Wait()
			return nil
		case <-t.C:
		}
	}
}

// Wait blocks until the bootstraps and long actions started so far have
// ended (they end when their ctx does).
func (e *Executor) Wait() {
	e.longs.Wait()
	e.boots.Wait()
}

// enqueueAll queues every cluster and the clean-up.
func (e *Executor) enqueueAll(ctx context.Context, q clusterQueue) {
	items, err := store.ListAll(ctx, e.deps.Store, ClustersKind, func() proto.Message { return &typesv1.Cluster{} })
	if err != nil {
		if ctx.Err() == nil {
			e.log.Warn("list clusters", "err", err)
		}
		return
	}
	for _, it := range items {
		q.Add(it.Name)
	}
	q.Add(collectKey)
}

// work reconciles one key of q; false once q is shut down.
func (e *Executor) work(ctx context.Context, q clusterQueue) bool {
	key, shutdown := q.Get()
	if shutdown {
		return false
	}
	defer q.Done(key)
	var (
		err     error
		requeue time.Duration
	)
	if key == collectKey {
		err = e.collect(ctx)
	} else {
		start := e.cfg.Clock()
		requeue, err = e.reconcile(ctx, key)
		if o := e.deps.Observer; o != nil && ctx.Err() == nil {
			o.ObserveReconcile("clusters", err, e.cfg.Clock().Sub(start), q.Len())
		}
	}
	if err != nil && ctx.Err() == nil {
		e.log.Warn("reconcile cluster", "cluster", key, "err", err)
		q.AddRateLimited(key)
		return true
	}
	q.Forget(key)
	if requeue > 0 && ctx.Err() == nil {
		// A planner asked to look again then (a backoff that ends, a
		// timeout that runs out, certificates that enter their renewal
		// window), sooner than the next Interval may come.
		q.AddAfter(key, requeue)
	}
	return true
}

// collect is the fleet-wide clean-up.
func (e *Executor) collect(ctx context.Context) error {
	if err := e.Collect(ctx); err != nil && ctx.Err() == nil {
		e.log.Warn("clean up after deleted clusters and machines", "err", err)
	}
	return nil
}

// startLong runs action (described by what) for cluster in the background
// under ctx, once a LongActions slot is free, unless the cluster runs a
// long action already: then it returns false and starts nothing (the
// planners plan the action again next pass). When the action ends, its
// outcome is in the store (conditions, events) and the cluster is queued
// again, so the next pass sees it at once.
func (e *Executor) startLong(ctx context.Context, cluster, what string, action func(context.Context) error) bool {
	e.mu.Lock()
	if _, busy := e.running[cluster]; busy {
		e.mu.Unlock()
		return false
	}
	e.running[cluster] = what
	e.longs.Add(1)
	e.mu.Unlock()
	go func() {
		defer e.longs.Done()
		defer func() {
			e.mu.Lock()
			delete(e.running, cluster)
			q := e.queue
			e.mu.Unlock()
			if q != nil {
				q.Add(cluster)
			}
		}()
		select {
		case e.longSem <- struct{}{}:
			defer func() { <-e.longSem }()
		case <-ctx.Done():
			return
		}
		if err := action(ctx); err != nil && ctx.Err() == nil {
			e.log.Warn("action failed", "cluster", cluster, "action", what, "err", err)
		}
	}()
	return true
}
