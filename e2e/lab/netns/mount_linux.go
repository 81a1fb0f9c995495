package netns

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
)

// rootTypeX8664 is the discoverable root partition type of x86-64.
const rootTypeX8664 = "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709"

// rootPartition finds the discoverable x86-64 root partition of a GPT
// image. Equivalent to `sfdisk -J DISK`.
func rootPartition(ctx context.Context, disk string) (offset, size int64, err error) {
	// Only stdout is JSON: sfdisk warns on stderr, e.g. "GPT PMBR size
	// mismatch" for an image laid onto a larger disk, which firmware
	// boots all the same.
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "sfdisk", "-J", disk)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return 0, 0, fmt.Errorf("no partition table: %s", strings.TrimSpace(stderr.String()))
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
