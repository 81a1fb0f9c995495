package manifest

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// isLowerHex reports whether s is 64 lowercase hex digits, the form
// hex.EncodeToString gives and the agent compares with.
func isLowerHex(s string) bool {
	if len(s) != 64 {
		return false
	}
	for _, c := range s {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// FuzzRead reads image manifests (image.json) of any content, as the
// controller does from an image server. Properties:
//   - a refusal is InvalidArgument;
//   - an accepted manifest's hashes are 64 lowercase hex digits (what the
//     agent compares a sha256 with) and its block map lies inside the
//     raw size, sorted and without overlaps;
//   - Write then Read gives the same manifest;
//   - LayRequest carries the block map range for range.
func FuzzRead(f *testing.F) {
	good, err := json.Marshal(validManifest())
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good)
	m := validManifest()
	m.Format, m.CompressedSHA256, m.BlockMap = FormatRaw, "", nil
	raw, _ := json.Marshal(m)
	f.Add(raw)
	f.Add([]byte(strings.Replace(string(good), strings.Repeat("a", 64), strings.Repeat("Z", 64), 1)))
	f.Add([]byte(`{"format":"raw","rawSize":18446744073709551615,"rawSha256":"` + strings.Repeat("0", 64) + `","blockMap":[{"offset":18446744073709551615,"length":2,"sha256":"` + strings.Repeat("0", 64) + `"}]}`))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, data []byte) {
		p := filepath.Join(dir, "image.json")
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		m, err := Read(p)
		if err != nil {
			if !errdefs.IsInvalidArgument(err) {
				t.Fatalf("Read(%q) = %v, want InvalidArgument", data, err)
			}
			return
		}
		hashes := []string{m.RawSHA256}
		if m.Format == FormatRawZst {
			hashes = append(hashes, m.CompressedSHA256)
		}
		var prevEnd uint64
		for i, r := range m.BlockMap {
			hashes = append(hashes, r.SHA256)
			if r.Length == 0 || r.Offset < prevEnd || r.Offset+r.Length < r.Offset || r.Offset+r.Length > m.RawSize {
				t.Fatalf("Read(%q) accepted block map range %d %+v (raw size %d)", data, i, r, m.RawSize)
			}
			prevEnd = r.End()
		}
		for _, h := range hashes {
			if !isLowerHex(h) {
				t.Fatalf("Read(%q) accepted sha256 %q: want 64 lowercase hex digits", data, h)
			}
		}
		out := filepath.Join(dir, "written.json")
		if err := Write(out, m); err != nil {
			t.Fatalf("Write(Read(%q)): %v", data, err)
		}
		back, err := Read(out)
		if err != nil {
			t.Fatalf("Read(Write(Read(%q))): %v", data, err)
		}
		if !back.BuildDate.Equal(m.BuildDate) {
			t.Fatalf("BuildDate %v after a round trip, want %v", back.BuildDate, m.BuildDate)
		}
		back.BuildDate = m.BuildDate
		// An empty list is written as none (omitempty): the same manifest.
		if diff := cmp.Diff(m, back, cmpopts.EquateEmpty()); diff != "" {
			t.Fatalf("Read(Write(m)) differs (-read +read back):\n%s", diff)
		}
		req := m.LayRequest("http://images.lab/x.raw", "/dev/sda", true)
		if len(req.BlockMap) != len(m.BlockMap) {
			t.Fatalf("LayRequest carries %d ranges, want %d", len(req.BlockMap), len(m.BlockMap))
		}
		for i, r := range req.BlockMap {
			if w := m.BlockMap[i]; r.Offset != w.Offset || r.Length != w.Length || r.Sha256 != w.SHA256 {
				t.Fatalf("LayRequest range %d = %v, want %+v", i, r, w)
			}
		}
	})
}

// FuzzBlockMap maps sparse files made of fuzzed runs of data at fuzzed
// offsets. Properties: the ranges are valid (ValidateRanges), at most
// MaxRangeLength long, start on a block boundary, hash to their sha256,
// and every byte outside them reads as zero; all-zero blocks are never in
// a range.
func FuzzBlockMap(f *testing.F) {
	f.Add([]byte{0, 0, 0, 0}, []byte("data"), uint16(0), uint8(1))
	f.Add([]byte{0x10, 0, 0x20, 0}, append(bytes.Repeat([]byte{0}, 600), 'x'), uint16(100), uint8(8))
	f.Add([]byte{}, []byte{}, uint16(4096), uint8(1))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, offsets, data []byte, tail uint16, bsSel uint8) {
		bs := 512 * (int(bsSel%8) + 1)
		if len(data) > 1<<16 || len(offsets) > 64 {
			return
		}
		p := filepath.Join(dir, "image.raw")
		fh, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		// Each pair of offset bytes places the data at a multiple of 512
		// plus the next pair's low byte, leaving holes between.
		var size int64
		for i := 0; i+1 < len(offsets); i += 2 {
			off := int64(binary.LittleEndian.Uint16(offsets[i:])) * 37
			if _, err := fh.WriteAt(data, off); err != nil {
				t.Fatal(err)
			}
			size = max(size, off+int64(len(data)))
		}
		size += int64(tail)
		if err := fh.Truncate(size); err != nil {
			t.Fatal(err)
		}
		fh.Close()
		content, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		ranges, err := BlockMap(context.Background(), p, bs)
		if err != nil {
			t.Fatalf("BlockMap(%d bytes, block %d): %v", size, bs, err)
		}
		if err := ValidateRanges(ranges, uint64(size)); err != nil {
			t.Fatalf("BlockMap gives ranges its own validation refuses: %v\n%+v", err, ranges)
		}
		covered := make([]bool, len(content))
		for _, r := range ranges {
			if r.Length > MaxRangeLength || r.Offset%uint64(bs) != 0 {
				t.Fatalf("range %+v: longer than %d or not on a %d-byte block", r, MaxRangeLength, bs)
			}
			chunk := content[r.Offset:r.End()]
			if sum(chunk) != r.SHA256 {
				t.Fatalf("range %+v: sha256 of its bytes is %s", r, sum(chunk))
			}
			for o := 0; o < len(chunk); o += bs {
				blk := chunk[o:min(o+bs, len(chunk))]
				if bytes.Count(blk, []byte{0}) == len(blk) {
					t.Fatalf("range %+v holds an all-zero block at %d", r, int(r.Offset)+o)
				}
			}
			for i := r.Offset; i < r.End(); i++ {
				covered[i] = true
			}
		}
		for i, c := range content {
			if c != 0 && !covered[i] {
				t.Fatalf("byte %d (0x%02x) is data outside every range: %+v", i, c, ranges)
			}
		}
	})
}
