package lay

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// mapSlab maps n bytes of anonymous memory aligned to a huge page and
// asks for transparent huge pages (honoured when
// /sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise").
func mapSlab(n int) ([]byte, error) {
	p, err := unix.MmapPtr(-1, 0, nil, uintptr(n+hugePage), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, err
	}
	// Unmap the unaligned head and the tail beyond n.
	skip := (hugePage - uintptr(p)%hugePage) % hugePage
	if skip > 0 {
		unix.MunmapPtr(p, skip)
	}
	start := unsafe.Add(p, skip)
	if tail := uintptr(hugePage) - skip; tail > 0 {
		unix.MunmapPtr(unsafe.Add(start, n), tail)
	}
	slab := unsafe.Slice((*byte)(start), n)
	unix.Madvise(slab, unix.MADV_HUGEPAGE) // best effort
	return slab, nil
}

func unmapSlab(s []byte) { unix.MunmapPtr(unsafe.Pointer(unsafe.SliceData(s)), uintptr(len(s))) }
