package kubetools

import (
	"context"
	"path/filepath"
	"testing"
)

// BenchmarkCacheVerify measures the warm path of Ensure: hashing every
// cached binary against the manifest. Ten binaries of 16 MiB each here;
// reported as MB/s, so the real cache (about 700 MB) takes 700/rate seconds.
func BenchmarkCacheVerify(b *testing.B) {
	fake := newFakeGo(b)
	fake.pad = make([]byte, 16<<20)
	for i := range fake.pad {
		fake.pad[i] = byte(i * 13)
	}
	bld := &Builder{Release: Pinned(), Cache: Cache{Dir: filepath.Join(b.TempDir(), "kube-tools")}, Runner: fake, Env: []string{}}
	m, err := bld.Ensure(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	var total int64
	for _, bin := range m.Binaries {
		total += bin.Size
	}
	b.SetBytes(total)
	b.ResetTimer()
	for b.Loop() {
		if _, err := bld.Cache.Verify(bld.Release); err != nil {
			b.Fatal(err)
		}
	}
}
