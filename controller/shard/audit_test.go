package shard

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestCheck(t *testing.T) {
	claim := func(s int, m string, rev int64) Record {
		return Record{Shard: s, Kind: KindClaim, Member: m, Held: rev, Rev: rev}
	}
	end := func(s int, kind, m string, held, rev int64) Record {
		return Record{Shard: s, Kind: kind, Member: m, Held: held, Rev: rev}
	}
	for _, tc := range []struct {
		name     string
		recs     []Record
		overlaps int
		err      bool
	}{
		{name: "empty"},
		{name: "claim, release, claim", recs: []Record{claim(0, "a", 5), end(0, KindRelease, "a", 5, 9), claim(0, "b", 10)}},
		{name: "claim, lost, claim, held now", recs: []Record{claim(0, "a", 5), claim(1, "a", 6), end(0, KindLost, "a", 5, 20), claim(0, "b", 21)}},
		{name: "any order", recs: []Record{claim(0, "b", 21), end(0, KindLost, "a", 5, 20), claim(0, "a", 5)}},
		{name: "second claim before the first ended", recs: []Record{claim(0, "a", 5), claim(0, "b", 8), end(0, KindRelease, "a", 5, 9)}, overlaps: 1},
		{name: "no end before the next claim", recs: []Record{claim(0, "a", 5), claim(0, "b", 8)}, overlaps: 1},
		{name: "end without claim", recs: []Record{end(0, KindLost, "a", 5, 9)}, err: true},
		{name: "ended twice", recs: []Record{claim(0, "a", 5), end(0, KindLost, "a", 5, 9), end(0, KindRelease, "a", 5, 9)}, err: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Check(tc.recs)
			require.Equal(t, tc.err, err != nil, "Check error = %v", err)
			require.Len(t, got, tc.overlaps, "Check overlaps = %v", got)
		})
	}
}
