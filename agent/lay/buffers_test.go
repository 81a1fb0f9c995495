package lay

import (
	"testing"
	"unsafe"
)

// The arena's buffers are usable for O_DIRECT (4096-aligned), distinct,
// span several slabs, and come back after put.
func TestArena(t *testing.T) {
	for _, size := range []int{1 << 20, 64<<10 + 7, 4096} {
		a := newArena(size)
		n := 3*slabSize/size + 5 // beyond three slabs
		seen := map[uintptr]bool{}
		var bufs []*[]byte
		for i := range n {
			b := a.get()
			if len(*b) != size {
				t.Fatalf("arena(%d).get() #%d: %d bytes", size, i, len(*b))
			}
			p := uintptr(unsafe.Pointer(unsafe.SliceData(*b)))
			if p%directAlign != 0 {
				t.Errorf("arena(%d).get() #%d at %#x: not aligned to %d", size, i, p, directAlign)
			}
			if seen[p] {
				t.Errorf("arena(%d).get() #%d at %#x: handed out twice", size, i, p)
			}
			seen[p] = true
			for j := range *b { // writable, and not shared with another buffer
				(*b)[j] = byte(i)
			}
			bufs = append(bufs, b)
		}
		for i, b := range bufs {
			if (*b)[0] != byte(i) || (*b)[size-1] != byte(i) {
				t.Errorf("arena(%d): buffer %d was overwritten by another", size, i)
			}
		}
		a.put(bufs[7])
		if b := a.get(); b != bufs[7] {
			t.Errorf("arena(%d).get() after put = a new buffer, want the one put back", size)
		}
		if len(a.slabs) == 0 {
			t.Logf("arena(%d) fell back to the heap", size)
		}
		a.release()
	}
}
