package sha256x16

import (
	"crypto/sha256"
	"fmt"
	"math/rand/v2"
	"testing"
)

func randomBytes(r *rand.ChaCha8, n int) []byte {
	b := make([]byte, n)
	r.Read(b)
	return b
}

// lengths covers the padding's edge cases (55/56 bytes: one or two
// padding blocks; 63/64/65: around a whole block) and large messages.
var lengths = []int{0, 1, 55, 56, 63, 64, 65, 119, 120, 127, 128, 1 << 20, 1<<20 + 7, 16 << 20}

func needKernel(t testing.TB) {
	if !hasKernel {
		// Deliberate, not testenv: a CPU feature no package installs; the
		// crypto/sha256 path still runs and is what such machines use.
		t.Skip("this CPU (or OS) lacks AVX-512F/BW/DQ/VL: only the crypto/sha256 path can run here")
	}
}

// TestSum16MatchesCryptoSHA256 drives the kernel directly with messages of
// unequal lengths in one batch, including empty and unused lanes.
func TestSum16MatchesCryptoSHA256(t *testing.T) {
	needKernel(t)
	r := rand.NewChaCha8([32]byte{7})
	var msgs [Lanes][]byte
	for lane, n := range lengths {
		msgs[lane] = randomBytes(r, n)
	}
	// Lane len(lengths) is an empty message, the rest are unused (nil).
	msgs[len(lengths)] = []byte{}
	got := sum16(&msgs)
	for lane, m := range msgs {
		if m == nil {
			continue
		}
		if want := sha256.Sum256(m); got[lane] != want {
			t.Errorf("sum16 lane %d (%d bytes) = %x, want %x", lane, len(m), got[lane], want)
		}
	}
}

// TestSum16EveryTailLength runs all 16 lanes full, with every length of
// the last partial block (0 to 63 bytes) over two batches.
func TestSum16EveryTailLength(t *testing.T) {
	needKernel(t)
	r := rand.NewChaCha8([32]byte{8})
	for base := 0; base < 64; base += Lanes {
		var msgs [Lanes][]byte
		for lane := range Lanes {
			msgs[lane] = randomBytes(r, 4096+base+lane)
		}
		got := sum16(&msgs)
		for lane, m := range msgs {
			if want := sha256.Sum256(m); got[lane] != want {
				t.Errorf("sum16 lane %d (%d bytes) = %x, want %x", lane, len(m), got[lane], want)
			}
		}
	}
}

// TestSum compares Sum with crypto/sha256 through both paths, for batches
// smaller than, equal to and larger than 16 messages, mixed lengths, and
// groups that the threshold sends to crypto/sha256.
func TestSum(t *testing.T) {
	r := rand.NewChaCha8([32]byte{9})
	batches := map[string][][]byte{}
	var mixed [][]byte
	for _, n := range lengths {
		mixed = append(mixed, randomBytes(r, n))
	}
	batches["mixed lengths"] = mixed
	var equal [][]byte
	for range 37 {
		equal = append(equal, randomBytes(r, 1<<20))
	}
	batches["37 x 1 MiB"] = equal
	var some [][]byte
	for i := range 21 {
		some = append(some, randomBytes(r, rand.New(r).IntN(3<<20)+i))
	}
	batches["21 random lengths"] = some
	batches["one message"] = [][]byte{randomBytes(r, 1000)}
	batches["none"] = nil
	// One long message and 15 short ones: under the threshold.
	lopsided := [][]byte{randomBytes(r, 4<<20)}
	for range 15 {
		lopsided = append(lopsided, randomBytes(r, 100))
	}
	batches["lopsided"] = lopsided

	for _, kernel := range []bool{false, true} {
		for name, msgs := range batches {
			t.Run(fmt.Sprintf("kernel=%v/%s", kernel, name), func(t *testing.T) {
				if kernel {
					needKernel(t)
				}
				defer func(old bool) { useKernel = old }(useKernel)
				useKernel = kernel
				out := make([][sha256.Size]byte, len(msgs))
				Sum(msgs, out)
				for i, m := range msgs {
					if want := sha256.Sum256(m); out[i] != want {
						t.Errorf("Sum: message %d (%d bytes) = %x, want %x", i, len(m), out[i], want)
					}
				}
			})
		}
	}
}

// TestSumDetectsOneBitFlip: a digest computed in a batch changes when one
// bit of its message does, and only that message's digest changes.
func TestSumDetectsOneBitFlip(t *testing.T) {
	r := rand.NewChaCha8([32]byte{10})
	msgs := make([][]byte, Lanes)
	for i := range msgs {
		msgs[i] = randomBytes(r, 1<<20)
	}
	before := make([][sha256.Size]byte, Lanes)
	Sum(msgs, before)
	msgs[5][123456] ^= 0x10
	after := make([][sha256.Size]byte, Lanes)
	Sum(msgs, after)
	for i := range msgs {
		if changed := before[i] != after[i]; changed != (i == 5) {
			t.Errorf("Sum after flipping a bit of message 5: digest %d changed = %v, want %v", i, changed, i == 5)
		}
	}
}

// BenchmarkSum16x1MiB: 16 messages of 1 MiB (a batch of a sparse image's
// ranges), with the kernel and with crypto/sha256.
func BenchmarkSum16x1MiB(b *testing.B) {
	r := rand.NewChaCha8([32]byte{11})
	msgs := make([][]byte, Lanes)
	for i := range msgs {
		msgs[i] = randomBytes(r, 1<<20)
	}
	out := make([][sha256.Size]byte, Lanes)
	for _, kernel := range []bool{true, false} {
		b.Run(fmt.Sprintf("kernel=%v", kernel), func(b *testing.B) {
			if kernel {
				needKernel(b)
			}
			defer func(old bool) { useKernel = old }(useKernel)
			useKernel = kernel
			b.SetBytes(Lanes << 20)
			for b.Loop() {
				Sum(msgs, out)
			}
		})
	}
}
