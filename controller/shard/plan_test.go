package shard

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestOf(t *testing.T) {
	// Pinned: every replica, of any release, must compute these; a change
	// of the hash would move hosts to other shards across an upgrade.
	for _, tc := range []struct {
		name string
		n    int
		want int
	}{
		{"sim-00001", 12, 2},
		{"sim-00002", 12, 3},
		{"rack1-h07", 12, 1},
		{"lab", 12, 8},
		{"sim-00001", 1000, 758},
		{"lab", 1000, 244},
		{"anything", 1, 0},
		{"anything", 0, 0},
	} {
		if got := Of(tc.name, tc.n); got != tc.want {
			t.Errorf("Of(%q, %d) = %d, want %d", tc.name, tc.n, got, tc.want)
		}
	}
	// Spread: 3,000 simulated host names over 12 shards, none far from 250.
	counts := make([]int, 12)
	for i := 1; i <= 3000; i++ {
		counts[Of(fmt.Sprintf("sim-%05d", i), 12)]++
	}
	for s, c := range counts {
		if c < 150 || c > 350 {
			t.Errorf("shard %d has %d of 3000 hosts, want about 250: %v", s, c, counts)
		}
	}
}

func TestAssign(t *testing.T) {
	for _, tc := range []struct {
		name    string
		n       int
		members []string
		owners  map[int]string
		want    []string
	}{
		{name: "no members", n: 3, want: []string{"", "", ""}},
		{name: "one member takes all", n: 3, members: []string{"a"}, want: []string{"a", "a", "a"}},
		{name: "fresh start, balanced in name order", n: 6, members: []string{"c", "a", "b"},
			want: []string{"a", "a", "b", "b", "c", "c"}},
		{name: "remainder to the first names when nobody holds", n: 7, members: []string{"a", "b", "c"},
			want: []string{"a", "a", "a", "b", "b", "c", "c"}},
		{name: "owners keep what they hold", n: 6, members: []string{"a", "b", "c"},
			owners: map[int]string{0: "c", 1: "b", 2: "a", 3: "c", 4: "b", 5: "a"},
			want:   []string{"c", "b", "a", "c", "b", "a"}},
		{name: "a joiner takes one from each over quota, highest-numbered", n: 6, members: []string{"a", "b", "c"},
			owners: map[int]string{0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "b"},
			want:   []string{"a", "a", "c", "b", "b", "c"}},
		{name: "a dead owner's shards go to the live ones", n: 6, members: []string{"a", "c"},
			owners: map[int]string{0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"},
			want:   []string{"a", "a", "a", "c", "c", "c"}},
		{name: "remainder stays with the one holding most", n: 7, members: []string{"a", "b", "c"},
			owners: map[int]string{0: "c", 1: "c", 2: "c", 3: "a", 4: "a", 5: "b", 6: "b"},
			want:   []string{"c", "c", "c", "a", "a", "b", "b"}},
		{name: "duplicate members count once", n: 2, members: []string{"a", "a", "b"},
			want: []string{"a", "b"}},
		{name: "more members than shards", n: 2, members: []string{"a", "b", "c"},
			owners: map[int]string{0: "c"},
			want:   []string{"c", "a"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Assign(tc.n, tc.members, tc.owners)
			require.Equal(t, tc.want, got, "Assign(%d, %v, %v)", tc.n, tc.members, tc.owners)
		})
	}
}

// TestAssignMovesLittle checks the properties over many shapes: every
// shard has a live owner, loads differ by at most one, and a member
// joining or leaving a balanced assignment moves only the shards it must.
func TestAssignMovesLittle(t *testing.T) {
	for _, n := range []int{1, 5, 12, 64} {
		for m := 1; m <= 6; m++ {
			members := make([]string, m)
			for i := range members {
				members[i] = fmt.Sprintf("c%d", i)
			}
			stable := toOwners(Assign(n, members, nil))
			checkBalanced(t, n, members, stable)
			// Join: only the joiner's share moves.
			joined := append(append([]string{}, members...), "new")
			after := Assign(n, joined, stable)
			checkBalanced(t, n, joined, toOwners(after))
			if moved, want := movedCount(stable, after), n/(m+1); moved != want {
				t.Errorf("n=%d m=%d: a joiner moved %d shards, want %d", n, m, moved, want)
			}
			// Leave: only the leaver's shards move.
			if m > 1 {
				left := members[1:]
				after := Assign(n, left, stable)
				checkBalanced(t, n, left, toOwners(after))
				lost := 0
				for _, o := range stable {
					if o == members[0] {
						lost++
					}
				}
				if moved := movedCount(stable, after); moved != lost {
					t.Errorf("n=%d m=%d: a leaver holding %d moved %d shards", n, m, lost, moved)
				}
			}
		}
	}
}

func TestPlanFor(t *testing.T) {
	owners := map[int]string{0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "b"}
	members := []string{"a", "b", "c"}
	for _, tc := range []struct {
		self string
		want Plan
	}{
		{"a", Plan{Release: []int{2}}},
		{"b", Plan{Release: []int{5}}},
		{"c", Plan{Claim: []int{2, 5}}},
		{"z", Plan{}}, // not a member: claims nothing
	} {
		if got := PlanFor(tc.self, 6, members, owners); !equalPlan(got, tc.want) {
			t.Errorf("PlanFor(%q) = %+v, want %+v", tc.self, got, tc.want)
		}
	}
}

func equalPlan(a, b Plan) bool {
	return fmt.Sprint(a.Claim) == fmt.Sprint(b.Claim) && fmt.Sprint(a.Release) == fmt.Sprint(b.Release)
}

func toOwners(want []string) map[int]string {
	o := map[int]string{}
	for s, w := range want {
		o[s] = w
	}
	return o
}

func movedCount(before map[int]string, after []string) int {
	n := 0
	for s, w := range after {
		if before[s] != w {
			n++
		}
	}
	return n
}

func checkBalanced(t *testing.T, n int, members []string, owners map[int]string) {
	t.Helper()
	load := map[string]int{}
	for s := 0; s < n; s++ {
		if owners[s] == "" {
			t.Fatalf("shard %d of %d has no owner among %v", s, n, members)
		}
		load[owners[s]]++
	}
	lo, hi := n, 0
	for _, m := range members {
		lo, hi = min(lo, load[m]), max(hi, load[m])
	}
	if hi-lo > 1 {
		t.Errorf("n=%d members=%v: loads %v differ by more than one", n, members, load)
	}
}
