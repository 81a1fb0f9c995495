// Package disk assembles partitioned raw disk images from directory trees
// without mounting anything: a GPT written with sfdisk on a sparse file, a
// FAT EFI system partition made with `mkfs.fat -C` and filled with mtools,
// and an ext4 root partition of the discoverable root type (so
// `systemd-dissect` and `systemd-nspawn --image` find it) populated with
// `mkfs.ext4 -d` directly at its offset in the image. Identifiers (disk,
// partition and filesystem UUIDs, the ext4 hash seed, the FAT volume ID)
// are fixed by the spec and metadata timestamps by SourceDateEpoch, so the
// same tree gives the same image byte for byte as long as the tree's own
// inode times (which mkfs.ext4 -d copies, atime and ctime included) have not
// changed.
package disk

import (
	"crypto/sha256"
	"fmt"
	"strings"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Partition type GUIDs (UAPI discoverable partitions specification).
const (
	TypeESP       = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
	TypeRootX8664 = "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709"
)

const (
	mib = 1 << 20
	// sectorSize is the logical sector size of the images.
	sectorSize = 512
	// DefaultESPSize is the ESP size when Spec.ESPSize is 0.
	DefaultESPSize = 64 * mib
)

// Spec describes a disk image.
type Spec struct {
	// RootDir is the tree that becomes the root filesystem; required.
	RootDir string
	// ESPDir, when set, is copied into the EFI system partition.
	ESPDir string
	// Output is the image file to write (replaced if it exists); required.
	Output string
	// RootSize is the root partition's size in bytes; 0 sizes it from the
	// tree (its apparent size plus a third and 64 MiB, MiB-aligned).
	RootSize int64
	// ESPSize is the ESP's size in bytes (default 64 MiB).
	ESPSize int64
	// Seed derives every UUID not given explicitly (default "kiln").
	Seed string
	// DiskUUID, ESPUUID, RootUUID (partition UUIDs) and RootFSUUID (the
	// ext4 filesystem UUID) override the derived ones.
	DiskUUID, ESPUUID, RootUUID, RootFSUUID string
	// SourceDateEpoch is the time (Unix seconds) written into the
	// filesystems' metadata (default 0: the current time).
	SourceDateEpoch int64
}

// Partition is one partition of a built image.
type Partition struct {
	Name   string
	Type   string
	UUID   string
	Offset int64 // bytes from the start of the image
	Size   int64 // bytes
}

// Layout is what Build wrote.
type Layout struct {
	Path       string
	Size       int64
	DiskUUID   string
	RootFSUUID string
	Partitions []Partition
}

// uuidFrom derives a stable version-4-shaped UUID from seed and purpose.
func uuidFrom(seed, purpose string) string {
	h := sha256.Sum256([]byte("kiln-disk\x00" + seed + "\x00" + purpose))
	h[6] = h[6]&0x0f | 0x40
	h[8] = h[8]&0x3f | 0x80
	return strings.ToUpper(fmt.Sprintf("%x-%x-%x-%x-%x", h[0:4], h[4:6], h[6:8], h[8:10], h[10:16]))
}

func (s Spec) withDefaults() Spec {
	if s.Seed == "" {
		s.Seed = "kiln"
	}
	if s.ESPSize == 0 {
		s.ESPSize = DefaultESPSize
	}
	for _, f := range []struct {
		dst     *string
		purpose string
	}{{&s.DiskUUID, "disk"}, {&s.ESPUUID, "esp"}, {&s.RootUUID, "root"}, {&s.RootFSUUID, "rootfs"}} {
		if *f.dst == "" {
			*f.dst = uuidFrom(s.Seed, f.purpose)
		}
	}
	return s
}

func validate(s Spec) error {
	if s.RootDir == "" || s.Output == "" {
		return errdefs.InvalidArgument("disk: RootDir and Output are required")
	}
	if s.ESPSize < 32*mib || s.ESPSize%mib != 0 {
		return errdefs.InvalidArgument("disk: ESP size %d: want a whole number of MiB, at least 32 MiB", s.ESPSize)
	}
	if s.RootSize != 0 && (s.RootSize < 8*mib || s.RootSize%mib != 0) {
		return errdefs.InvalidArgument("disk: root size %d: want a whole number of MiB, at least 8 MiB", s.RootSize)
	}
	for _, u := range []string{s.DiskUUID, s.ESPUUID, s.RootUUID, s.RootFSUUID} {
		if !isUUID(u) {
			return errdefs.InvalidArgument("disk: %q is not a UUID", u)
		}
	}
	return nil
}

func isUUID(s string) bool {
	if len(s) != 36 {
		return false
	}
	for i, r := range s {
		switch i {
		case 8, 13, 18, 23:
			if r != '-' {
				return false
			}
		default:
			if !strings.ContainsRune("0123456789abcdefABCDEF", r) {
				return false
			}
		}
	}
	return true
}

// sfdiskScript is the GPT layout: 1 MiB alignment, ESP first, root second.
func sfdiskScript(s Spec, espStart, rootStart int64) string {
	return fmt.Sprintf(`label: gpt
label-id: %s
unit: sectors
first-lba: 2048

start=%d, size=%d, type=%s, uuid=%s, name="esp"
start=%d, size=%d, type=%s, uuid=%s, name="root-x86-64"
`, s.DiskUUID,
		espStart/sectorSize, s.ESPSize/sectorSize, TypeESP, s.ESPUUID,
		rootStart/sectorSize, s.RootSize/sectorSize, TypeRootX8664, s.RootUUID)
}
