package shard

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/controller/store"
)

// Load is one controller replica in an Overview.
type Load struct {
	ID string
	// Leader: it holds the election.
	Leader bool
	// Registered: it is in the replicas registry.
	Registered bool
	// Member: it takes part in sharding.
	Member bool
	// Shards it holds, ascending, and the hosts mapping to them.
	Shards []int
	Hosts  int
}

// Overview is who holds which shard and the hosts each carries, for
// `kilnctl get controllers`.
type Overview struct {
	// Shards is the members' shard count (0: no member, not sharded).
	Shards   int
	Replicas []Load // by ID
	// Unowned are the shards no key holds now, UnownedHosts their hosts.
	Unowned      []int
	UnownedHosts int
	Hosts        int
}

// Observe reads the shard members and keys and the host names (keys
// only) at one etcd revision and returns the overview, with the
// registered replicas and the leader ("" when none) given by the caller.
// It returns etcd's errors wrapped.
func Observe(ctx context.Context, client *clientv3.Client, registered map[string]bool, leader string) (Overview, error) {
	resp, err := client.Txn(ctx).Then(
		clientv3.OpGet(MembersPrefix, clientv3.WithPrefix()),
		clientv3.OpGet(KeyPrefix, clientv3.WithPrefix()),
		clientv3.OpGet(store.Prefix+"hosts/", clientv3.WithPrefix(), clientv3.WithKeysOnly()),
	).Commit()
	if err != nil {
		return Overview{}, fmt.Errorf("controllers: read shards: %w", err)
	}
	loads := map[string]*Load{}
	get := func(id string) *Load {
		if l := loads[id]; l != nil {
			return l
		}
		l := &Load{ID: id}
		loads[id] = l
		return l
	}
	for id := range registered {
		get(id).Registered = true
	}
	if leader != "" {
		get(leader).Leader = true
	}
	var ov Overview
	for _, kv := range resp.Responses[0].GetResponseRange().Kvs {
		var m Member
		if json.Unmarshal(kv.Value, &m) != nil {
			continue
		}
		get(strings.TrimPrefix(string(kv.Key), MembersPrefix)).Member = true
		ov.Shards = max(ov.Shards, m.Shards)
	}
	owner := map[int]string{}
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		if s, ok := parseShardKey(string(kv.Key)); ok {
			owner[s] = string(kv.Value)
			l := get(string(kv.Value))
			l.Shards = append(l.Shards, s)
		}
	}
	for s := 0; s < ov.Shards; s++ {
		if _, ok := owner[s]; !ok {
			ov.Unowned = append(ov.Unowned, s)
		}
	}
	for _, kv := range resp.Responses[2].GetResponseRange().Kvs {
		ov.Hosts++
		if ov.Shards == 0 {
			continue
		}
		if o, ok := owner[Of(strings.TrimPrefix(string(kv.Key), store.Prefix+"hosts/"), ov.Shards)]; ok {
			loads[o].Hosts++
		} else {
			ov.UnownedHosts++
		}
	}
	for _, id := range slices.Sorted(maps.Keys(loads)) {
		l := loads[id]
		slices.Sort(l.Shards)
		ov.Replicas = append(ov.Replicas, *l)
	}
	return ov, nil
}
