// Package shard partitions the hosts among several active controller
// replicas: N fixed shards, each owned by exactly one live replica through
// a key on that replica's etcd lease (/kiln/v1/shards/<n>). A host belongs
// to shard Of(name, N); the replica that holds the shard runs the host's
// lifecycle, and every write it makes for the host is fenced on the shard
// key's create revision (store.Fenced), so a replica that lost the shard
// writes nothing more.
//
// Deciding is separate from doing: Assign and PlanFor are pure (who should
// own what, given the live members and the current owners); Manager claims
// and releases shard keys in etcd and runs the work of the shards it holds.
package shard

import (
	"hash/fnv"
	"slices"
)

// Of returns the shard, in [0, n), of the object called name: the FNV-1a
// 32-bit hash of the name modulo n. It is stable across releases and
// replicas (every replica must agree). Hosts map by their own name, also
// when bound to a cluster; clusters map by the cluster name. It returns 0
// when n < 1.
func Of(name string, n int) int {
	if n < 1 {
		return 0
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(name))
	return int(h.Sum32() % uint32(n))
}

// Assign returns the wanted owner of each of n shards, given the live
// members and the current owner of each shard whose key exists (owners
// may name members that are no longer live: their shards are reassigned).
// The assignment is balanced (every member gets n/len(members) shards, the
// remainder going to the members that already hold the most, ties by
// name) and moves as few shards as it can: a live owner keeps its shards
// up to its quota (the lowest-numbered first), and only the rest are
// given, lowest-numbered first, to members under their quota, in name
// order. With no members every shard is wanted by nobody (""). Every
// replica computes the same assignment from the same observation.
func Assign(n int, members []string, owners map[int]string) []string {
	want := make([]string, n)
	ms := slices.Clone(members)
	slices.Sort(ms)
	ms = slices.Compact(ms)
	if len(ms) == 0 || n < 1 {
		return want
	}
	live := make(map[string]bool, len(ms))
	for _, m := range ms {
		live[m] = true
	}
	held := map[string]int{}
	for s := 0; s < n; s++ {
		if o := owners[s]; live[o] {
			held[o]++
		}
	}
	// The remainder's extra shard goes to those holding the most already.
	byHeld := slices.Clone(ms)
	slices.SortStableFunc(byHeld, func(a, b string) int { return held[b] - held[a] })
	quota := make(map[string]int, len(ms))
	base, extra := n/len(ms), n%len(ms)
	for i, m := range byHeld {
		quota[m] = base
		if i < extra {
			quota[m]++
		}
	}
	count := map[string]int{}
	for s := 0; s < n; s++ {
		if o := owners[s]; live[o] && count[o] < quota[o] {
			want[s] = o
			count[o]++
		}
	}
	next := 0
	for s := 0; s < n; s++ {
		if want[s] != "" {
			continue
		}
		for count[ms[next]] >= quota[ms[next]] {
			next++
		}
		want[s] = ms[next]
		count[ms[next]]++
	}
	return want
}

// Plan is what one member should do with the shard keys.
type Plan struct {
	// Claim are the shards assigned to the member that it does not hold:
	// it creates their keys once they are free (a claim succeeds only on
	// an absent key, so a shard still held by another member, live or
	// not yet expired, is claimed only after that member lets it go).
	Claim []int
	// Release are the shards the member holds that are assigned to
	// another: it stops their work and deletes their keys.
	Release []int
}

// PlanFor returns self's plan for n shards given the live members and the
// current owners (see Assign).
func PlanFor(self string, n int, members []string, owners map[int]string) Plan {
	var p Plan
	for s, w := range Assign(n, members, owners) {
		switch {
		case w == self && owners[s] != self:
			p.Claim = append(p.Claim, s)
		case w != self && owners[s] == self:
			p.Release = append(p.Release, s)
		}
	}
	return p
}
