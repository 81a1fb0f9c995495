// Package sha256x16 computes the SHA-256 digests of many independent
// messages at once: on CPUs with AVX-512 it hashes 16 messages in the 16
// lanes of one AVX-512 computation (about twice the throughput of one
// core's SHA-NI on the machines kiln is measured on); elsewhere, and where
// batching would not pay, it uses crypto/sha256 one message at a time.
// Either way Sum gives exactly crypto/sha256's digests.
//
// agent/lay uses it to verify a block map's small ranges in batches. The
// AVX-512 kernel is minio/sha256-simd's (Apache 2.0, see LICENSE here),
// called directly: that module's exported API runs a server goroutine
// that never ends and wakes every microsecond, and fills its lanes only
// from 16 concurrent writers.
package sha256x16

import (
	"crypto/sha256"
	"encoding/binary"
	"slices"
)

// Lanes is how many messages one multi-buffer computation hashes.
const Lanes = 16

// minLanes is the batching threshold: a group of messages goes through the
// kernel only if their lengths add up to at least minLanes times the
// longest one. The kernel's cost follows the longest lane (shorter lanes
// are masked, not skipped) and, on the CPUs measured, its 16 lanes hash
// about 2.1x as fast as SHA-NI on one core: below about 8 full lanes
// crypto/sha256 is cheaper.
const minLanes = 8

// useKernel is whether the AVX-512 kernel is used; tests turn it off to
// compare both paths.
var useKernel = hasKernel

// Accelerated reports whether this CPU hashes with the multi-buffer
// kernel (AVX-512F, BW, DQ and VL enabled by the OS).
func Accelerated() bool { return useKernel }

// Sum sets out[i] to the SHA-256 digest of msgs[i]. out must be at least
// as long as msgs. It is safe for concurrent use.
func Sum(msgs [][]byte, out [][sha256.Size]byte) {
	if !useKernel || len(msgs) < minLanes {
		for i, m := range msgs {
			out[i] = sha256.Sum256(m)
		}
		return
	}
	// Sort by length, so that each group of 16 holds messages of similar
	// length and masked lanes waste little.
	idx := make([]int, len(msgs))
	for i := range idx {
		idx[i] = i
	}
	slices.SortStableFunc(idx, func(a, b int) int { return len(msgs[a]) - len(msgs[b]) })
	for start := 0; start < len(idx); start += Lanes {
		group := idx[start:min(start+Lanes, len(idx))]
		var sum, longest int
		for _, i := range group {
			sum += len(msgs[i])
			longest = max(longest, len(msgs[i]))
		}
		if sum < minLanes*longest {
			for _, i := range group {
				out[i] = sha256.Sum256(msgs[i])
			}
			continue
		}
		var in [Lanes][]byte
		for lane, i := range group {
			in[lane] = msgs[i]
		}
		digests := sum16(&in)
		for lane, i := range group {
			out[i] = digests[lane]
		}
	}
}

// The initial hash value of SHA-256 (FIPS 180-4, 5.3.3).
var initState = [8]uint32{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19}

// sum16 hashes up to 16 messages (nil lanes are unused) with the kernel:
// first every lane's whole 64-byte blocks, then every lane's last partial
// block with SHA-256's padding (one or two blocks), continuing each lane's
// state.
func sum16(msgs *[Lanes][]byte) [Lanes][sha256.Size]byte {
	// The kernel's state: word j of lane i is the little-endian uint32
	// at (i + j*16) * 4.
	var state [512]byte
	for lane := range Lanes {
		for j, w := range initState {
			binary.LittleEndian.PutUint32(state[(lane+j*Lanes)*4:], w)
		}
	}
	var bulk, tails [Lanes][]byte
	var pad [Lanes][2 * 64]byte
	for lane, m := range msgs {
		whole := len(m) &^ 63
		if whole > 0 {
			bulk[lane] = m[:whole]
		}
		if m == nil {
			continue
		}
		// Padding: 0x80, zeros to 56 mod 64, the length in bits.
		n := copy(pad[lane][:], m[whole:])
		pad[lane][n] = 0x80
		padded := 64
		if n >= 56 {
			padded = 128
		}
		binary.BigEndian.PutUint64(pad[lane][padded-8:], uint64(len(m))*8)
		tails[lane] = pad[lane][:padded]
	}
	blocks(&state, &bulk)
	blocks(&state, &tails)
	var out [Lanes][sha256.Size]byte
	for lane := range Lanes {
		for j := range 8 {
			binary.BigEndian.PutUint32(out[lane][j*4:], binary.LittleEndian.Uint32(state[(lane+j*Lanes)*4:]))
		}
	}
	return out
}

// blocks runs the kernel over inputs (each a whole number of 64-byte
// blocks; empty lanes are left as they are), updating state.
func blocks(state *[512]byte, inputs *[Lanes][]byte) {
	mask := laneMasks(inputs)
	if len(mask) == 0 {
		return // the kernel reads mask[0] unconditionally
	}
	var scratch [512]byte
	sha256X16Avx512(state, &scratch, &table, mask, *inputs)
}

// laneMasks returns, for each 64-byte block round, the bit set of lanes
// that still have a block in that round (the kernel updates only those).
// The set changes at most 16 times: it is filled run by run.
func laneMasks(inputs *[Lanes][]byte) []uint64 {
	var blocks [Lanes]int
	rounds := 0
	for lane, in := range inputs {
		blocks[lane] = len(in) / 64
		rounds = max(rounds, blocks[lane])
	}
	mask := make([]uint64, rounds)
	for r := 0; r < rounds; {
		var m uint64
		next := rounds // the next round at which a lane runs out
		for lane, n := range blocks {
			if n > r {
				m |= 1 << lane
				next = min(next, n)
			}
		}
		for ; r < next; r++ {
			mask[r] = m
		}
	}
	return mask
}
