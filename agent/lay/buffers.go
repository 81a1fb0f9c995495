package lay

import "sync"

// buffers hands out the pipeline's buffers and takes them back.
type buffers interface {
	get() *[]byte
	put(*[]byte)
}

// poolBuffers are the Layer's pooled heap buffers (the streaming paths).
type poolBuffers struct{ l *Layer }

func (p poolBuffers) get() *[]byte  { return p.l.getBuf() }
func (p poolBuffers) put(b *[]byte) { p.l.putBuf(b) }

// slabSize is how much memory an arena maps at a time: eight 2 MiB huge
// pages.
const slabSize = 16 << 20

// hugePage is the size and alignment of an x86-64 (and arm64 4K-granule)
// transparent huge page.
const hugePage = 2 << 20

// arena hands out the buffers of one block-map lay from memory it maps
// itself, 16 MiB at a time, aligned to 2 MiB and marked for transparent
// huge pages (madvise MADV_HUGEPAGE), and unmaps it all when the lay ends
// (release). A 1 MiB buffer then lies in one huge page: the kernel faults
// in 2 MiB at once instead of 256 pages of 4 KiB, and an O_DIRECT write
// from it is one contiguous segment instead of 256, which the disk is
// sent as fewer, larger requests. Where mapping fails, or off Linux, it
// falls back to the heap. Buffers must not be used after release.
type arena struct {
	size  int // of a buffer
	mu    sync.Mutex
	free  []*[]byte
	cur   []byte   // unused rest of the newest slab
	slabs [][]byte // to unmap
}

func newArena(size int) *arena { return &arena{size: size} }

func (a *arena) get() *[]byte {
	a.mu.Lock()
	defer a.mu.Unlock()
	if n := len(a.free); n > 0 {
		b := a.free[n-1]
		a.free = a.free[:n-1]
		return b
	}
	// Buffers start at multiples of 4096, as O_DIRECT needs.
	stride := (a.size + directAlign - 1) / directAlign * directAlign
	if len(a.cur) < stride && stride <= slabSize {
		if slab, err := mapSlab(slabSize); err == nil {
			a.slabs = append(a.slabs, slab)
			a.cur = slab
		}
	}
	if len(a.cur) < stride {
		b := make([]byte, a.size)
		return &b
	}
	b := a.cur[:a.size:a.size]
	a.cur = a.cur[stride:]
	return &b
}

func (a *arena) put(b *[]byte) {
	a.mu.Lock()
	a.free = append(a.free, b)
	a.mu.Unlock()
}

// release unmaps the arena's memory: every goroutine that used its
// buffers must have ended.
func (a *arena) release() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, s := range a.slabs {
		unmapSlab(s)
	}
	a.slabs, a.cur, a.free = nil, nil, nil
}
