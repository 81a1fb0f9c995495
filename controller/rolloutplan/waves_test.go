package rolloutplan

import (
	"slices"
	"testing"
)

// Waves are ordered by the label's value: numbers as numbers, then text,
// then the clusters without the label.
func TestGroupWaves(t *testing.T) {
	got := groupWaves(map[string]string{
		"a": "10", "b": "2", "c": "canary", "d": NoWave, "e": "2", "f": "1.5", "g": "beta",
	})
	var values []string
	for _, w := range got {
		values = append(values, w.value)
	}
	want := []string{"1.5", "2", "10", "beta", "canary", NoWave}
	if !slices.Equal(values, want) {
		t.Errorf("groupWaves order = %v, want %v", values, want)
	}
	if !slices.Equal(got[1].clusters, []string{"b", "e"}) {
		t.Errorf("wave 2 clusters = %v, want [b e] (name order)", got[1].clusters)
	}
}
