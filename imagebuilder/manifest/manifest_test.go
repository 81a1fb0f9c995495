package manifest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
)

func sum(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// writeSparse makes a file of size bytes that holds data at the given
// offsets (each a run of bytes) and is a hole everywhere else.
func writeSparse(t *testing.T, size int64, runs map[int64][]byte) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "image.raw")
	f, err := os.Create(p)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, f.Truncate(size))
	for off, b := range runs {
		_, err := f.WriteAt(b, off)
		require.NoError(t, err)
	}
	return p
}

func fill(n int, c byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = c + byte(i%7)
	}
	return b
}

func TestBlockMap(t *testing.T) {
	const bs = 4096
	a := fill(3*bs, 1)      // three blocks of data
	z := make([]byte, 2*bs) // written zeros: not a hole to the FS, a hole to the map
	c := fill(bs+100, 9)    // data ending mid-block
	d := fill(10, 3)        // a few bytes at the tail, file ends mid-block
	size := int64(64*bs + 10)
	path := writeSparse(t, size, map[int64][]byte{
		0:       a,
		3 * bs:  z,
		5 * bs:  c,
		64 * bs: d,
	})
	ranges, err := BlockMap(context.Background(), path, bs)
	require.NoError(t, err)

	// c ends 100 bytes into its second block: that block is data, padded
	// with zeros to the block's end.
	cBlocks := make([]byte, 2*bs)
	copy(cBlocks, c)
	want := []Range{
		{Offset: 0, Length: 3 * bs, SHA256: sum(a)},
		{Offset: 5 * bs, Length: 2 * bs, SHA256: sum(cBlocks)},
		{Offset: 64 * bs, Length: 10, SHA256: sum(d)},
	}
	if len(ranges) != len(want) {
		t.Fatalf("BlockMap(%q) = %+v, want %+v", path, ranges, want)
	}
	for i := range want {
		if ranges[i] != want[i] {
			t.Errorf("BlockMap(%q)[%d] = %+v, want %+v", path, i, ranges[i], want[i])
		}
	}
	require.NoError(t, ValidateRanges(ranges, uint64(size)))
}

func TestBlockMapEdges(t *testing.T) {
	tests := []struct {
		name string
		size int64
		runs map[int64][]byte
		want int // number of ranges
	}{
		{"empty file", 0, nil, 0},
		{"all hole", 1 << 20, nil, 0},
		{"all zeros written", 1 << 16, map[int64][]byte{0: make([]byte, 1<<16)}, 0},
		{"dense", 1 << 16, map[int64][]byte{0: fill(1<<16, 1)}, 1},
		{"last byte only", 1 << 16, map[int64][]byte{1<<16 - 1: {7}}, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := writeSparse(t, tt.size, tt.runs)
			got, err := BlockMap(context.Background(), p, 4096)
			require.NoError(t, err)
			if len(got) != tt.want {
				t.Errorf("BlockMap(%q) = %+v, want %d ranges", tt.name, got, tt.want)
			}
		})
	}
}

func TestBlockMapErrors(t *testing.T) {
	p := writeSparse(t, 4096, nil)
	_, err := BlockMap(context.Background(), p, 1000)
	if !errdefs.IsInvalidArgument(err) {
		t.Errorf("BlockMap(bs=1000) = %v, want InvalidArgument", err)
	}
	_, err = BlockMap(context.Background(), filepath.Join(t.TempDir(), "nope"), 4096)
	if !os.IsNotExist(errorsUnwrapAll(err)) {
		t.Errorf("BlockMap(missing) = %v, want not-exist", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	p = writeSparse(t, 1<<16, map[int64][]byte{0: fill(10, 1)})
	if _, err := BlockMap(ctx, p, 4096); err != context.Canceled {
		t.Errorf("BlockMap(cancelled) = %v, want %v", err, context.Canceled)
	}
}

func errorsUnwrapAll(err error) error {
	for {
		u, ok := err.(interface{ Unwrap() error })
		if !ok || u.Unwrap() == nil {
			return err
		}
		err = u.Unwrap()
	}
}

func validManifest() *Manifest {
	return &Manifest{
		Tag:               "debian12-k8s1.34.4-20261202",
		Format:            FormatRawZst,
		RawSize:           1 << 20,
		RawSHA256:         strings.Repeat("a", 64),
		CompressedSize:    1000,
		CompressedSHA256:  strings.Repeat("b", 64),
		BlockSize:         4096,
		BlockMap:          []Range{{0, 4096, strings.Repeat("c", 64)}, {8192, 4096, strings.Repeat("d", 64)}},
		OSVersion:         "debian 12.12",
		KernelVersion:     "6.1.0-41-amd64",
		KubernetesVersion: "v1.34.4",
		AgentVersion:      "v0.1.0",
		Packages:          []Package{{"containerd", "1.6.20~ds1-1"}},
		BuildDate:         time.Date(2026, 12, 2, 13, 0, 0, 0, time.UTC),
	}
}

func TestWriteRead(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "image.json")
	m := validManifest()
	require.NoError(t, Write(p, m))
	m2 := validManifest()
	m2.Tag = "debian12-k8s1.34.5-20261203"
	require.NoError(t, Write(p, m2)) // replaces the first

	got, err := Read(p)
	require.NoError(t, err)
	require.Equal(t, m2, got)
	if got.DataSize() != 8192 {
		t.Errorf("DataSize() = %d, want 8192", got.DataSize())
	}
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	if len(entries) != 1 {
		t.Errorf("Write left %d files in its directory, want 1 (no temporaries)", len(entries))
	}
}

func TestReadErrors(t *testing.T) {
	dir := t.TempDir()
	if _, err := Read(filepath.Join(dir, "missing.json")); !errdefs.IsNotFound(err) {
		t.Errorf("Read(missing) = %v, want NotFound", err)
	}
	p := filepath.Join(dir, "bad.json")
	require.NoError(t, os.WriteFile(p, []byte("{not json"), 0o644))
	if _, err := Read(p); !errdefs.IsInvalidArgument(err) {
		t.Errorf("Read(bad json) = %v, want InvalidArgument", err)
	}
}

func TestValidate(t *testing.T) {
	h := strings.Repeat("e", 64)
	tests := []struct {
		name   string
		mutate func(*Manifest)
		ok     bool
	}{
		{"valid", func(*Manifest) {}, true},
		{"raw without compressed hash", func(m *Manifest) { m.Format = FormatRaw; m.CompressedSHA256 = "" }, true},
		{"unknown format", func(m *Manifest) { m.Format = "qcow2" }, false},
		{"no raw hash", func(m *Manifest) { m.RawSHA256 = "" }, false},
		{"zst without compressed hash", func(m *Manifest) { m.CompressedSHA256 = "" }, false},
		{"overlap", func(m *Manifest) { m.BlockMap = []Range{{0, 8192, h}, {4096, 4096, h}} }, false},
		{"out of order", func(m *Manifest) { m.BlockMap = []Range{{8192, 10, h}, {0, 10, h}} }, false},
		{"beyond size", func(m *Manifest) { m.BlockMap = []Range{{1 << 20, 1, h}} }, false},
		{"empty range", func(m *Manifest) { m.BlockMap = []Range{{0, 0, h}} }, false},
		{"bad hash", func(m *Manifest) { m.BlockMap = []Range{{0, 1, "xyz"}} }, false},
		// Found by FuzzRead: 64 characters were enough, hex or not; an
		// agent never matches such a sum.
		{"raw hash not hex", func(m *Manifest) { m.RawSHA256 = strings.Repeat("Z", 64) }, false},
		{"compressed hash upper case", func(m *Manifest) { m.CompressedSHA256 = strings.Repeat("B", 64) }, false},
		{"range hash not hex", func(m *Manifest) { m.BlockMap = []Range{{0, 1, strings.Repeat("g", 64)}} }, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := validManifest()
			tt.mutate(m)
			err := m.Validate()
			if (err == nil) != tt.ok {
				t.Errorf("Validate(%q) = %v, want ok=%v", tt.name, err, tt.ok)
			}
			if err != nil && !errdefs.IsInvalidArgument(err) {
				t.Errorf("Validate(%q) = %v, want InvalidArgument", tt.name, err)
			}
		})
	}
}

func TestLayRequest(t *testing.T) {
	m := validManifest()
	tests := []struct {
		name       string
		format     string
		useMap     bool
		wantFormat string
		wantSha    string
		wantRanges int
	}{
		{"zst", FormatRawZst, false, FormatRawZst, m.CompressedSHA256, 0},
		{"raw", FormatRaw, false, FormatRaw, m.RawSHA256, 0},
		{"block map", FormatRawZst, true, FormatRaw, "", 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := validManifest()
			m.Format = tt.format
			r := m.LayRequest("http://images/x", "/dev/sda", tt.useMap)
			if r.GetFormat() != tt.wantFormat || r.GetSha256() != tt.wantSha || len(r.GetBlockMap()) != tt.wantRanges {
				t.Errorf("LayRequest(%q) = %v, want format %q sha256 %q and %d ranges", tt.name, r, tt.wantFormat, tt.wantSha, tt.wantRanges)
			}
			if r.GetRawSize() != m.RawSize || r.GetRawSha256() != m.RawSHA256 || r.GetTarget() != "/dev/sda" {
				t.Errorf("LayRequest(%q) = %v, want raw size, raw sha256 and target set", tt.name, r)
			}
		})
	}
}

func TestBlockMapSplitsLongRuns(t *testing.T) {
	data := fill(MaxRangeLength+3*4096, 5)
	p := writeSparse(t, int64(len(data)), map[int64][]byte{0: data})
	got, err := BlockMap(context.Background(), p, 4096)
	require.NoError(t, err)
	want := []Range{
		{Offset: 0, Length: MaxRangeLength, SHA256: sum(data[:MaxRangeLength])},
		{Offset: MaxRangeLength, Length: 3 * 4096, SHA256: sum(data[MaxRangeLength:])},
	}
	require.Equal(t, want, got, "BlockMap of a %d-byte dense file", len(data))
}
