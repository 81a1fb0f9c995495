package disk

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Build writes the image spec describes and returns its layout. Nothing
// is mounted and no loop device is used. Equivalent to:
//
//	truncate -s SIZE OUT; sfdisk OUT <<< LAYOUT
//	mkfs.fat -C --invariant -i VOLID -n ESP esp.img KIB; mcopy -s -i esp.img ESPDIR/* ::/
//	dd if=esp.img of=OUT bs=1M seek=1 conv=notrunc,sparse
//	E2FSPROGS_FAKE_TIME=EPOCH mkfs.ext4 -d ROOT -U UUID -E offset=N,hash_seed=UUID OUT KIB
//
// The image is written beside Output and renamed into place, so Output is
// either the old file or a complete new image. It returns InvalidArgument
// for a bad spec, FailedPrecondition when a tool is missing (sfdisk:
// fdisk, mkfs.fat: dosfstools, mcopy: mtools, mkfs.ext4: e2fsprogs), and
// the failing tool's output otherwise. Output from the tools goes to
// progress (nil discards it).
func Build(ctx context.Context, spec Spec, progress io.Writer) (*Layout, error) {
	spec = spec.withDefaults()
	if err := validate(spec); err != nil {
		return nil, err
	}
	if progress == nil {
		progress = io.Discard
	}
	tools := map[string]string{"sfdisk": "fdisk", "mkfs.fat": "dosfstools", "mcopy": "mtools", "mkfs.ext4": "e2fsprogs", "dd": "coreutils"}
	for tool, pkg := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, errdefs.FailedPrecondition("disk: %s not found (Debian package %s)", tool, pkg)
		}
	}
	if st, err := os.Stat(spec.RootDir); err != nil || !st.IsDir() {
		return nil, errdefs.InvalidArgument("disk: root %s is not a directory", spec.RootDir)
	}
	if spec.RootSize == 0 {
		n, err := treeSize(spec.RootDir)
		if err != nil {
			return nil, fmt.Errorf("disk: size of %s: %w", spec.RootDir, err)
		}
		spec.RootSize = alignUp(n+n/3+64*mib, mib)
	}
	espStart := int64(mib)
	rootStart := espStart + spec.ESPSize
	total := rootStart + spec.RootSize + mib // room for the backup GPT

	tmp := spec.Output + ".tmp"
	work, err := os.MkdirTemp(filepath.Dir(spec.Output), ".kiln-disk-")
	if err != nil {
		return nil, fmt.Errorf("disk: %w", err)
	}
	defer os.RemoveAll(work)
	defer os.Remove(tmp)

	env := []string{"LC_ALL=C"}
	if spec.SourceDateEpoch != 0 {
		epoch := strconv.FormatInt(spec.SourceDateEpoch, 10)
		env = append(env, "SOURCE_DATE_EPOCH="+epoch, "E2FSPROGS_FAKE_TIME="+epoch)
	}

	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, fmt.Errorf("disk: %w", err)
	}
	err = f.Truncate(total)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("disk: %w", err)
	}

	script := sfdiskScript(spec, espStart, rootStart)
	if err := runIn(ctx, progress, env, strings.NewReader(script), "sfdisk", "--no-reread", "--no-tell-kernel", "-q", tmp); err != nil {
		return nil, fmt.Errorf("disk: partition table: %w", err)
	}

	esp := filepath.Join(work, "esp.img")
	volID := strings.ReplaceAll(spec.ESPUUID, "-", "")[:8]
	if err := runIn(ctx, progress, env, nil, "mkfs.fat", "-C", "--invariant", "-i", volID, "-n", "ESP", esp, strconv.FormatInt(spec.ESPSize/1024, 10)); err != nil {
		return nil, fmt.Errorf("disk: ESP: %w", err)
	}
	if spec.ESPDir != "" {
		entries, err := os.ReadDir(spec.ESPDir)
		if err != nil {
			return nil, fmt.Errorf("disk: ESP content: %w", err)
		}
		if len(entries) > 0 {
			args := []string{"-s", "-Q", "-i", esp}
			for _, e := range entries {
				args = append(args, filepath.Join(spec.ESPDir, e.Name()))
			}
			args = append(args, "::/")
			if err := runIn(ctx, progress, env, nil, "mcopy", args...); err != nil {
				return nil, fmt.Errorf("disk: ESP content: %w", err)
			}
		}
	}
	if err := runIn(ctx, progress, env, nil, "dd", "if="+esp, "of="+tmp, "bs=1M",
		"seek="+strconv.FormatInt(espStart/mib, 10), "conv=notrunc,sparse", "status=none"); err != nil {
		return nil, fmt.Errorf("disk: ESP copy: %w", err)
	}

	if err := runIn(ctx, progress, env, nil, "mkfs.ext4", "-q", "-F", "-t", "ext4", "-b", "4096",
		"-d", spec.RootDir, "-L", "root", "-U", strings.ToLower(spec.RootFSUUID),
		"-E", fmt.Sprintf("offset=%d,hash_seed=%s,root_owner=0:0", rootStart, strings.ToLower(spec.RootFSUUID)),
		tmp, strconv.FormatInt(spec.RootSize/1024, 10)+"k"); err != nil {
		return nil, fmt.Errorf("disk: root filesystem: %w", err)
	}
	// Not internal/atomicfile: the image is made in place by sfdisk, dd
	// and mkfs.ext4 (gigabytes), so it is published by a plain rename; a
	// crash loses at most a rebuildable output, which the manifest's sizes
	// and sha256 written after it would not match.
	if err := os.Rename(tmp, spec.Output); err != nil {
		return nil, fmt.Errorf("disk: %w", err)
	}
	return &Layout{
		Path:       spec.Output,
		Size:       total,
		DiskUUID:   spec.DiskUUID,
		RootFSUUID: spec.RootFSUUID,
		Partitions: []Partition{
			{Name: "esp", Type: TypeESP, UUID: spec.ESPUUID, Offset: espStart, Size: spec.ESPSize},
			{Name: "root-x86-64", Type: TypeRootX8664, UUID: spec.RootUUID, Offset: rootStart, Size: spec.RootSize},
		},
	}, nil
}

// treeSize is the space the files of dir take in 4 KiB blocks, plus one
// block per entry for inodes and directories.
func treeSize(dir string) (int64, error) {
	var n int64
	err := filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		n += 4096
		if d.Type().IsRegular() {
			info, err := d.Info()
			if err != nil {
				return err
			}
			n += alignUp(info.Size(), 4096)
		}
		return nil
	})
	return n, err
}

func alignUp(n, to int64) int64 { return (n + to - 1) / to * to }

func runIn(ctx context.Context, progress io.Writer, env []string, stdin io.Reader, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	var out bytes.Buffer
	cmd.Stdin = stdin
	cmd.Stdout = io.MultiWriter(progress, &out)
	cmd.Stderr = cmd.Stdout
	cmd.Env = append(os.Environ(), env...)
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s: %w: %s", name, err, strings.TrimSpace(out.String()))
	}
	return nil
}
