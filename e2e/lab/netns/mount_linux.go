package netns

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
)

// rootTypeX8664 is the discoverable root partition type of x86-64.
const rootTypeX8664 = "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709"

// mountDisk mounts the root partition of the GPT disk image at dir on a
// loop device of its own. Equivalent to `systemd-dissect --mount DISK
// DIR`. systemd-dissect also mounts the ESP, which fails on kernels
// without vfat (the lab machines): there the root partition is found with
// `sfdisk -J` and mounted with `mount -o loop,offset=N,sizelimit=S`.
func mountDisk(ctx context.Context, disk, dir string) error {
	if hasFilesystem("vfat") {
		out, err := exec.CommandContext(ctx, "systemd-dissect", "--mount", disk, dir).CombinedOutput()
		if err != nil {
			return fmt.Errorf("systemd-dissect: %s", strings.TrimSpace(string(out)))
		}
		return nil
	}
	off, size, err := rootPartition(ctx, disk)
	if err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, "mount", "-t", "ext4", "-o", fmt.Sprintf("loop,offset=%d,sizelimit=%d,nodev", off, size), disk, dir).CombinedOutput()
	if err != nil {
		return fmt.Errorf("mount root partition: %s", strings.TrimSpace(string(out)))
	}
	return nil
}

// rootPartition finds the discoverable x86-64 root partition of a GPT
// image. Equivalent to `sfdisk -J DISK`.
func rootPartition(ctx context.Context, disk string) (offset, size int64, err error) {
	out, err := exec.CommandContext(ctx, "sfdisk", "-J", disk).CombinedOutput()
	if err != nil {
		return 0, 0, fmt.Errorf("no partition table: %s", strings.TrimSpace(string(out)))
	}
	var pt struct {
		PartitionTable struct {
			Label      string `json:"label"`
			SectorSize int64  `json:"sectorsize"`
			Partitions []struct {
				Start int64  `json:"start"`
				Size  int64  `json:"size"`
				Type  string `json:"type"`
			} `json:"partitions"`
		} `json:"partitiontable"`
	}
	if err := json.Unmarshal(out, &pt); err != nil {
		return 0, 0, fmt.Errorf("sfdisk -J: %w", err)
	}
	ss := pt.PartitionTable.SectorSize
	if ss == 0 {
		ss = 512
	}
	for _, p := range pt.PartitionTable.Partitions {
		if strings.EqualFold(p.Type, rootTypeX8664) {
			return p.Start * ss, p.Size * ss, nil
		}
	}
	return 0, 0, fmt.Errorf("no root partition (type %s) in the %s partition table", rootTypeX8664, pt.PartitionTable.Label)
}

// hasFilesystem reports whether the kernel supports fs (/proc/filesystems).
func hasFilesystem(fs string) bool {
	f, err := os.Open("/proc/filesystems")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if ff := strings.Fields(sc.Text()); len(ff) > 0 && ff[len(ff)-1] == fs {
			return true
		}
	}
	return false
}
