package provision

import (
	"testing"

	"github.com/stretchr/testify/require"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

const (
	stAvailable    = typesv1.HostState_HOST_STATE_AVAILABLE
	stProvisioning = typesv1.HostState_HOST_STATE_PROVISIONING
	stProvisioned  = typesv1.HostState_HOST_STATE_PROVISIONED
)

// TestAdmissionLine walks admission through what the executor does: a
// slot reserved before the write, hosts refused and lined up in order,
// each freed slot waking the next host and keeping the slot for it,
// and stale observations (a listing older than a write) freeing nothing.
func TestAdmissionLine(t *testing.T) {
	var woken []string
	a := newAdmission(2, func(n string) { woken = append(woken, n) })

	d, _, _ := a.admit("h1")
	require.Equal(t, notSynced, d, "admit before the first listing")
	a.observe("p1", 10, stProvisioning) // found in flight by the listing
	a.sync()
	require.Equal(t, []string{"h1"}, woken, "hosts deferred until the listing are queued again")
	woken = nil

	d, n, _ := a.admit("h1")
	require.Equal(t, slotTaken, d)
	require.Equal(t, 2, n, "p1 and h1 in flight")
	// A listing older than h1's write sees it Available: its reserved
	// slot stays taken.
	a.observe("h1", 11, stAvailable)
	a.stored("h1", 12, stProvisioning)
	a.observe("h1", 11, stAvailable)

	d, n, first := a.admit("h2")
	require.Equal(t, slotRefused, d)
	require.Equal(t, 2, n)
	require.True(t, first, "the first refusal is logged")
	a.wait("h2")
	d, _, first = a.admit("h3")
	require.Equal(t, slotRefused, d)
	require.False(t, first)
	a.wait("h3")
	require.True(t, a.waiting("h2"))
	require.True(t, a.waiting("h3"))
	require.Empty(t, woken)

	// p1 ends: h2, first in line, is woken and its slot kept from h4.
	a.observe("p1", 13, stProvisioned)
	require.Equal(t, []string{"h2"}, woken)
	require.False(t, a.waiting("h2"))
	d, _, _ = a.admit("h4")
	require.Equal(t, slotRefused, d, "a newcomer does not take the slot kept for h2")
	a.wait("h4")
	a.begin("h2")
	d, _, _ = a.admit("h2")
	require.Equal(t, slotTaken, d)
	a.settle("h2")
	a.stored("h2", 14, stProvisioning)
	woken = nil

	// h1's write fails after all: nothing is freed (it was stored). h2
	// is deleted: h3 is woken; it no longer wants an image (it never
	// asks for its slot): settle passes the slot to h4.
	a.release("h1")
	require.Empty(t, woken)
	a.forget("h2")
	require.Equal(t, []string{"h3"}, woken)
	a.begin("h3")
	a.settle("h3")
	require.Equal(t, []string{"h3", "h4"}, woken)
	inflight, waiting := a.counts()
	require.Equal(t, 1, inflight, "h1")
	require.Zero(t, waiting)
	// A later listing, older than the writes that ended p1, does not
	// count it again.
	a.listed("p1", 10, stProvisioning)
	inflight, _ = a.counts()
	require.Equal(t, 1, inflight, "a stale listing after the first counts nothing")

	// A reservation whose write fails is given back.
	a.begin("h4")
	d, _, _ = a.admit("h4")
	require.Equal(t, slotTaken, d)
	a.release("h4")
	inflight, _ = a.counts()
	require.Equal(t, 1, inflight, "h4's failed write gave its slot back")
}

// TestAdmissionNoLimit: a negative limit admits every host.
func TestAdmissionNoLimit(t *testing.T) {
	a := newAdmission(-1, func(string) { t.Fatal("nothing waits without a limit") })
	for _, n := range []string{"a", "b", "c"} {
		if d, _, _ := a.admit(n); d != slotTaken {
			t.Errorf("admit(%q) without a limit = %v, want slotTaken", n, d)
		}
	}
}
