package liveness

import (
	"context"
	"fmt"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/controller/store"
)

// ReplicasPrefix is where live controller replicas are registered: one
// key per replica, bound to an etcd lease the replica keeps alive. Lease
// keep-alives are not raft writes, so a registered replica costs one
// write when it starts and none while it runs.
const ReplicasPrefix = store.ReplicasPrefix

// Register records replica id as live until ctx ends or the process dies
// (then after ttl). The returned stop revokes the registration at once.
// It blocks only for the two calls that create it.
func Register(ctx context.Context, client *clientv3.Client, id string, ttl time.Duration) (stop func(), err error) {
	secs := int64(ttl / time.Second)
	if secs < 2 {
		secs = 2
	}
	lease, err := client.Grant(ctx, secs)
	if err != nil {
		return nil, fmt.Errorf("register replica %q: grant lease: %w", id, err)
	}
	if _, err := client.Put(ctx, ReplicasPrefix+id, time.Now().UTC().Format(time.RFC3339), clientv3.WithLease(lease.ID)); err != nil {
		return nil, fmt.Errorf("register replica %q: %w", id, err)
	}
	kctx, cancel := context.WithCancel(ctx)
	ch, err := client.KeepAlive(kctx, lease.ID)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("register replica %q: keep alive: %w", id, err)
	}
	go func() {
		// Drain the keep-alive answers; the channel closes with kctx.
		for range ch {
		}
	}()
	return func() {
		cancel()
		rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer rcancel()
		_, _ = client.Revoke(rctx, lease.ID)
	}, nil
}

// LiveReplicas lists the IDs of the registered replicas.
func LiveReplicas(ctx context.Context, client *clientv3.Client) (map[string]bool, error) {
	resp, err := client.Get(ctx, ReplicasPrefix, clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return nil, fmt.Errorf("list live replicas: %w", err)
	}
	live := make(map[string]bool, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		live[strings.TrimPrefix(string(kv.Key), ReplicasPrefix)] = true
	}
	return live, nil
}
