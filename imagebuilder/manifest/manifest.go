// Package manifest describes a built golden image: the Manifest written next
// to it (sizes, hashes, versions, packages) and the block map of its raw
// form, the ranges that hold data, so that laying can fetch and write only
// those (like bmaptool's .bmap).
package manifest

import (
	"encoding/json"
	"fmt"
	"os"
	"time"

	"github.com/kilnhq/kiln/internal/atomicfile"
	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// Formats of the image file a manifest points at.
const (
	FormatRaw    = "raw"
	FormatRawZst = "raw.zst"
)

// Range is a run of bytes of the raw image that holds data. Everything
// outside the ranges of a block map reads as zero.
type Range struct {
	Offset uint64 `json:"offset"`
	Length uint64 `json:"length"`
	// SHA256 is the lowercase hex sha256 of the Length bytes at Offset.
	SHA256 string `json:"sha256"`
}

// End returns the offset one past the range's last byte.
func (r Range) End() uint64 { return r.Offset + r.Length }

// Manifest is the description of one golden image, stored as JSON next to
// it (image.json).
type Manifest struct {
	// Tag is <os><ver>-k8s<ver>-<yyyymmdd>, e.g. debian12-k8s1.34.4-20261202.
	Tag string `json:"tag"`
	// Format of the published file: "raw" or "raw.zst".
	Format string `json:"format"`

	RawSize   uint64 `json:"rawSize"`
	RawSHA256 string `json:"rawSha256"`
	// CompressedSize and CompressedSHA256 describe the raw.zst file, when
	// one was produced.
	CompressedSize   uint64 `json:"compressedSize,omitempty"`
	CompressedSHA256 string `json:"compressedSha256,omitempty"`

	// BlockSize is the granularity of BlockMap.
	BlockSize int     `json:"blockSize,omitempty"`
	BlockMap  []Range `json:"blockMap,omitempty"`

	OSVersion         string    `json:"osVersion,omitempty"`
	KernelVersion     string    `json:"kernelVersion,omitempty"`
	KubernetesVersion string    `json:"kubernetesVersion,omitempty"`
	AgentVersion      string    `json:"agentVersion,omitempty"`
	Packages          []Package `json:"packages,omitempty"`
	BuildDate         time.Time `json:"buildDate"`

	// PatchLevel is the date (yyyymmdd) of the image's OS packages.
	PatchLevel string `json:"patchLevel,omitempty"`
	// SourceDateEpoch is the Unix time every timestamp in the image is
	// clamped to; a rebuild with it gives the same bytes, except for what
	// NonReproducible lists.
	SourceDateEpoch int64 `json:"sourceDateEpoch,omitempty"`
	// Partitions are the partitions of the raw image.
	Partitions []Partition `json:"partitions,omitempty"`
	// NonReproducible says what a rebuild may change, and why.
	NonReproducible []NonReproducible `json:"nonReproducible,omitempty"`
	// Addons are the addon image tags the image's kubeadm pins for
	// KubernetesVersion: the recipe the controller applies when a cluster
	// is upgraded to this image. Nil for an image without Kubernetes.
	Addons *Addons `json:"addons,omitempty"`
}

// Addons are image tags (without repository) of one Kubernetes version's
// addons and static pods, as `kubeadm config images list
// --kubernetes-version <v>` prints them.
type Addons struct {
	KubeProxy string `json:"kubeProxy"`
	CoreDNS   string `json:"coreDNS"`
	Etcd      string `json:"etcd"`
	Pause     string `json:"pause"`
}

// Complete reports whether every tag is set.
func (a *Addons) Complete() bool {
	return a != nil && a.KubeProxy != "" && a.CoreDNS != "" && a.Etcd != "" && a.Pause != ""
}

// Partition is one partition of the raw image.
type Partition struct {
	Name   string `json:"name"`
	Type   string `json:"type"`
	UUID   string `json:"uuid"`
	Offset uint64 `json:"offset"`
	Size   uint64 `json:"size"`
}

// NonReproducible is one part of an image that a rebuild from the same
// spec and SOURCE_DATE_EPOCH does not reproduce bit for bit.
type NonReproducible struct {
	What   string `json:"what"`
	Reason string `json:"reason"`
}

// Package is one installed OS package of the image.
type Package struct {
	Name    string `json:"name"`
	Version string `json:"version"`
}

// DataSize returns the number of bytes the block map covers.
func (m *Manifest) DataSize() uint64 {
	var n uint64
	for _, r := range m.BlockMap {
		n += r.Length
	}
	return n
}

// Validate checks that the manifest is self-consistent: a known format, a
// raw size and hash, and a block map of sorted, non-overlapping ranges
// inside the raw size. It returns an errdefs.InvalidArgument error.
func (m *Manifest) Validate() error {
	switch m.Format {
	case FormatRaw, FormatRawZst:
	default:
		return errdefs.InvalidArgument("manifest %q: format %q: want %q or %q", m.Tag, m.Format, FormatRaw, FormatRawZst)
	}
	if m.RawSize == 0 || m.RawSHA256 == "" {
		return errdefs.InvalidArgument("manifest %q: raw size and sha256 are required", m.Tag)
	}
	if !sha256Hex(m.RawSHA256) {
		return errdefs.InvalidArgument("manifest %q: rawSha256 %q is not 64 lowercase hex digits", m.Tag, m.RawSHA256)
	}
	if m.Format == FormatRawZst && !sha256Hex(m.CompressedSHA256) {
		return errdefs.InvalidArgument("manifest %q: format raw.zst needs compressedSha256, 64 lowercase hex digits", m.Tag)
	}
	return ValidateRanges(m.BlockMap, m.RawSize)
}

// ValidateRanges checks that ranges are sorted, non-empty, non-overlapping,
// carry a sha256 and end within size. It returns an errdefs.InvalidArgument
// error naming the first bad range.
func ValidateRanges(ranges []Range, size uint64) error {
	var prevEnd uint64
	for i, r := range ranges {
		switch {
		case r.Length == 0:
			return errdefs.InvalidArgument("block map range %d (offset %d): empty", i, r.Offset)
		case i > 0 && r.Offset < prevEnd:
			return errdefs.InvalidArgument("block map range %d (offset %d): overlaps or is out of order", i, r.Offset)
		case r.End() < r.Offset || r.End() > size:
			return errdefs.InvalidArgument("block map range %d (offset %d, length %d): beyond image size %d", i, r.Offset, r.Length, size)
		case !sha256Hex(r.SHA256):
			return errdefs.InvalidArgument("block map range %d (offset %d): sha256 %q is not 64 lowercase hex digits", i, r.Offset, r.SHA256)
		}
		prevEnd = r.End()
	}
	return nil
}

// sha256Hex reports whether s is a sha256 as hex.EncodeToString writes
// it, 64 lowercase hex digits: the form the agent compares sums with.
func sha256Hex(s string) bool {
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

// Write stores m as indented JSON at path (mode 0644) with
// internal/atomicfile, so a reader sees the old manifest or the new one,
// never a part, and the new one survives a crash once Write returns.
func Write(path string, m *Manifest) error {
	data, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return fmt.Errorf("manifest %q: encode: %w", path, err)
	}
	data = append(data, '\n')
	if err := atomicfile.Write(path, data, 0o644); err != nil {
		return fmt.Errorf("manifest %q: %w", path, err)
	}
	return nil
}

// Read loads and validates the manifest at path. A missing file is an
// errdefs.NotFound error; a malformed one is errdefs.InvalidArgument.
func Read(path string) (*Manifest, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		if os.IsNotExist(err) {
			return nil, errdefs.NotFound("manifest %q: no such file", path)
		}
		return nil, fmt.Errorf("manifest %q: %w", path, err)
	}
	var m Manifest
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, errdefs.InvalidArgument("manifest %q: decode: %v", path, err)
	}
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("manifest %q: %w", path, err)
	}
	return &m, nil
}

// LayRequest returns the agent request that lays this image from url onto
// target. With a block map, url must serve the raw image: only the mapped
// ranges are fetched. Without one, url serves the published file in
// m.Format and its sha256 is checked.
func (m *Manifest) LayRequest(url, target string, useBlockMap bool) *agentv1.LayImageRequest {
	req := &agentv1.LayImageRequest{Url: url, Target: target, Format: m.Format, RawSize: m.RawSize, RawSha256: m.RawSHA256}
	switch {
	case useBlockMap && len(m.BlockMap) > 0:
		req.Format = FormatRaw
		for _, r := range m.BlockMap {
			req.BlockMap = append(req.BlockMap, &agentv1.BlockRange{Offset: r.Offset, Length: r.Length, Sha256: r.SHA256})
		}
	case m.Format == FormatRawZst:
		req.Sha256 = m.CompressedSHA256
	default:
		req.Sha256 = m.RawSHA256
	}
	return req
}
