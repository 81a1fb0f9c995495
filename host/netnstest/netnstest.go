// Package netnstest gives tests a fresh, anonymous network namespace with
// its loopback up, and runs code inside it on a locked OS thread. The
// namespace disappears when the test ends. It needs root: New skips the
// test otherwise.
package netnstest

import (
	"os"
	"runtime"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/kilnhq/kiln/internal/testenv"
)

// NS is a network namespace owned by one test.
type NS struct {
	handle netns.NsHandle
	// Netlink is a netlink handle inside the namespace, usable from any
	// goroutine (create links, addresses and routes with it).
	Netlink *netlink.Handle
}

// New creates a network namespace for t, skipping t when not root.
func New(t testing.TB) *NS {
	t.Helper()
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root to create a network namespace")
	}
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		t.Fatalf("netns.Get() error = %v", err)
	}
	defer orig.Close()
	ns, err := netns.New() // unshares and moves this thread into it
	if err != nil {
		runtime.UnlockOSThread()
		testenv.Skipf(t, "cannot create a network namespace: %v", err)
	}
	if err := netns.Set(orig); err != nil {
		// Leave the thread locked: it dies with this goroutine instead of
		// running other code in the wrong namespace.
		ns.Close()
		t.Fatalf("netns.Set(original) error = %v", err)
	}
	runtime.UnlockOSThread()

	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		ns.Close()
		t.Fatalf("netlink.NewHandleAt() error = %v", err)
	}
	n := &NS{handle: ns, Netlink: h}
	t.Cleanup(func() {
		h.Close()
		ns.Close()
	})
	lo, err := h.LinkByName("lo")
	if err != nil {
		t.Fatalf("LinkByName(%q) error = %v", "lo", err)
	}
	if err := h.LinkSetUp(lo); err != nil {
		t.Fatalf("LinkSetUp(%q) error = %v", "lo", err)
	}
	return n
}

// Do runs fn on the calling goroutine with its OS thread inside the
// namespace: /proc/sys/net, netlink sockets, listening sockets and
// commands started by fn all see the namespace. fn must not hand work to
// other goroutines that expect the namespace.
func (n *NS) Do(t testing.TB, fn func()) {
	t.Helper()
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		t.Fatalf("netns.Get() error = %v", err)
	}
	defer orig.Close()
	if err := netns.Set(n.handle); err != nil {
		runtime.UnlockOSThread()
		t.Fatalf("netns.Set() error = %v", err)
	}
	defer func() {
		if err := netns.Set(orig); err != nil {
			// Keep the thread locked so that it is thrown away.
			t.Errorf("netns.Set(original) error = %v", err)
			return
		}
		runtime.UnlockOSThread()
	}()
	fn()
}

// Of returns the network namespace of process pid (for example a
// systemd-nspawn machine's init) for use with Do. The namespace belongs
// to that process: only the handles are closed when the test ends.
func Of(t testing.TB, pid int) *NS {
	t.Helper()
	ns, err := netns.GetFromPid(pid)
	if err != nil {
		t.Fatalf("netns.GetFromPid(%d) error = %v", pid, err)
	}
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		ns.Close()
		t.Fatalf("netlink.NewHandleAt() error = %v", err)
	}
	t.Cleanup(func() {
		h.Close()
		ns.Close()
	})
	return &NS{handle: ns, Netlink: h}
}
