//go:build !amd64 || !gc || purego

package sha256x16

const hasKernel = false

var table [512]uint64

func sha256X16Avx512(digests *[512]byte, scratch *[512]byte, table *[512]uint64, mask []uint64, inputs [16][]byte) {
	panic("sha256x16: no AVX-512 kernel on this platform")
}
