package memtrim

import (
	"bytes"
	"fmt"
	"os"
	"reflect"
	"strconv"

	"golang.org/x/sys/unix"
)

// ReleaseExecutable drops this process's mappings of the clean, read-only
// pages of its own executable: machine code, read-only data and the
// runtime's function tables. It is madvise(MADV_DONTNEED) on each read-only
// private mapping of the executable file that holds no private copies.
//
// A Go program's start-up (every package's init function) touches nearly
// all of its executable, and the kernel maps 64 KiB around each touched page
// (fault-around), so a mostly idle daemon keeps its whole binary resident
// although it runs a small part of it. The dropped pages stay in the page
// cache, so nothing is read from disk again while memory is plentiful: the
// pages the program runs again are mapped back on their next use (a minor
// fault), and the rest no longer count in its resident set and are the
// first the kernel reclaims under memory pressure.
//
// Writable mappings (data, bss), mappings holding private copies of pages
// (relocated read-only data of a position-independent executable,
// breakpoints set by a debugger) and locked mappings are never touched:
// dropping those would lose their contents. It returns how many resident
// bytes it dropped.
func ReleaseExecutable() (uint64, error) {
	smaps, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		return 0, fmt.Errorf("release executable pages: %w", err)
	}
	code := uint64(reflect.ValueOf(ReleaseExecutable).Pointer())
	var file *mapping
	for _, m := range parseSmaps(smaps) {
		if m.start <= code && code < m.end {
			file = &m
			break
		}
	}
	if file == nil {
		return 0, fmt.Errorf("release executable pages: no mapping in /proc/self/smaps holds this program's code (%#x)", code)
	}
	return releaseFile(smaps, file.dev, file.inode)
}

// releaseFile drops the clean read-only private mappings of the file dev,
// inode listed in smaps (see ReleaseExecutable).
func releaseFile(smaps []byte, dev, inode string) (uint64, error) {
	var released uint64
	for _, m := range parseSmaps(smaps) {
		if m.dev != dev || m.inode != inode || !m.releasable() {
			continue
		}
		if _, _, errno := unix.Syscall(unix.SYS_MADVISE, uintptr(m.start), uintptr(m.end-m.start), unix.MADV_DONTNEED); errno != 0 {
			return released, fmt.Errorf("release executable pages: madvise %x-%x: %w", m.start, m.end, errno)
		}
		released += m.rss
	}
	return released, nil
}

// mapping is one entry of /proc/PID/smaps.
type mapping struct {
	start, end        uint64
	perms, dev, inode string
	// rss, anonymous and locked are in bytes.
	rss, anonymous, locked uint64
}

// releasable reports whether dropping m's pages loses nothing: it is
// read-only, private, holds no private copies and is not locked.
func (m mapping) releasable() bool {
	return len(m.perms) == 4 && m.perms[1] == '-' && m.perms[3] == 'p' &&
		m.anonymous == 0 && m.locked == 0 && m.rss > 0
}

// parseSmaps reads the mappings of a /proc/PID/smaps file: a header line
// "start-end perms offset dev inode [path]" followed by "Key: N kB" lines.
func parseSmaps(smaps []byte) []mapping {
	var ms []mapping
	for line := range bytes.Lines(smaps) {
		f := bytes.Fields(line)
		if len(f) == 0 {
			continue
		}
		if lo, hi, ok := bytes.Cut(f[0], []byte("-")); ok && len(f) >= 5 {
			start, err1 := strconv.ParseUint(string(lo), 16, 64)
			end, err2 := strconv.ParseUint(string(hi), 16, 64)
			if err1 == nil && err2 == nil {
				ms = append(ms, mapping{start: start, end: end, perms: string(f[1]), dev: string(f[3]), inode: string(f[4])})
				continue
			}
		}
		if len(ms) == 0 || len(f) != 3 || string(f[2]) != "kB" {
			continue
		}
		kb, err := strconv.ParseUint(string(f[1]), 10, 64)
		if err != nil {
			continue
		}
		m := &ms[len(ms)-1]
		switch string(f[0]) {
		case "Rss:":
			m.rss = kb << 10
		case "Anonymous:":
			m.anonymous = kb << 10
		case "Locked:":
			m.locked = kb << 10
		}
	}
	return ms
}
