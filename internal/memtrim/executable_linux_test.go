package memtrim

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// smapsOf returns the /proc/self/smaps entry that holds addr.
func smapsOf(t *testing.T, addr uintptr) mapping {
	t.Helper()
	smaps, err := os.ReadFile("/proc/self/smaps")
	require.NoError(t, err)
	for _, m := range parseSmaps(smaps) {
		if m.start <= uint64(addr) && uint64(addr) < m.end {
			return m
		}
	}
	t.Fatalf("no mapping in /proc/self/smaps holds %#x", addr)
	return mapping{}
}

// executableRSS is how much of this test binary is resident, summed over
// its read-only mappings.
func executableRSS(t *testing.T) uint64 {
	t.Helper()
	smaps, err := os.ReadFile("/proc/self/smaps")
	require.NoError(t, err)
	code := smapsOf(t, reflect.ValueOf(ReleaseExecutable).Pointer())
	var rss uint64
	for _, m := range parseSmaps(smaps) {
		if m.dev == code.dev && m.inode == code.inode && m.perms[1] == '-' {
			rss += m.rss
		}
	}
	return rss
}

// TestReleaseExecutable: the test binary's resident read-only pages drop by
// what ReleaseExecutable reports, and the program goes on running (it
// faults back what it uses).
func TestReleaseExecutable(t *testing.T) {
	before := executableRSS(t)
	released, err := ReleaseExecutable()
	require.NoError(t, err)
	after := executableRSS(t)
	t.Logf("executable resident: %d KiB before, released %d KiB, %d KiB after", before>>10, released>>10, after>>10)
	require.NotZero(t, released, "ReleaseExecutable released nothing of a running test binary")
	// What the test runs next (reading smaps, the runtime) comes back
	// at once: 1.9 of 4.1 MiB here.
	require.Less(t, after, before, "the executable's resident pages did not drop")

	// Still runs: the collector walks stacks with the function tables,
	// formatting runs code the test has not run since.
	runtime.GC()
	var buf bytes.Buffer
	buf.WriteString(filepath.Join("a", "b"))
	require.Equal(t, "a/b", buf.String())
}

var readSink byte

// TestReleaseFileKeepsPrivateCopies: of a file's private mappings, only
// the clean read-only ones are dropped; a read-only mapping with a private
// copy (as a PIE's relocated read-only data has) and a writable one keep
// their contents.
func TestReleaseFileKeepsPrivateCopies(t *testing.T) {
	const size = 1 << 20
	path := filepath.Join(t.TempDir(), "file")
	require.NoError(t, os.WriteFile(path, bytes.Repeat([]byte{0xab}, size), 0o600))
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	mmap := func(prot int) []byte {
		b, err := unix.Mmap(int(f.Fd()), 0, size, prot, unix.MAP_PRIVATE)
		require.NoError(t, err)
		t.Cleanup(func() { _ = unix.Munmap(b) })
		return b
	}

	clean := mmap(unix.PROT_READ)
	for i := 0; i < size; i += os.Getpagesize() {
		readSink += clean[i]
	}
	copied := mmap(unix.PROT_READ | unix.PROT_WRITE)
	copied[0] = 0xcd
	require.NoError(t, unix.Mprotect(copied, unix.PROT_READ))
	writable := mmap(unix.PROT_READ | unix.PROT_WRITE)
	writable[0] = 0xef

	m := smapsOf(t, uintptr(unsafe.Pointer(&clean[0])))
	require.Equal(t, uint64(size), m.rss, "all pages of the clean mapping are resident after reading them")
	smaps, err := os.ReadFile("/proc/self/smaps")
	require.NoError(t, err)
	released, err := releaseFile(smaps, m.dev, m.inode)
	require.NoError(t, err)

	require.Equal(t, uint64(size), released, "released = the clean mapping's resident bytes")
	require.Zero(t, smapsOf(t, uintptr(unsafe.Pointer(&clean[0]))).rss, "the clean mapping is still resident")
	require.Equal(t, byte(0xcd), copied[0], "the read-only mapping's private copy was dropped")
	require.Equal(t, byte(0xef), writable[0], "the writable mapping's private copy was dropped")
	require.Equal(t, byte(0xab), clean[0], "the clean mapping reads the file again")
}
