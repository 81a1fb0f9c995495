package disk

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

func needTools(t *testing.T) {
	t.Helper()
	for tool, pkg := range map[string]string{"sfdisk": "fdisk", "mkfs.fat": "dosfstools", "mcopy": "mtools", "mkfs.ext4": "e2fsprogs"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (Debian package %s)", tool, pkg)
		}
	}
}

func smallTree(t *testing.T) (root, esp string) {
	dir := t.TempDir()
	root, esp = filepath.Join(dir, "root"), filepath.Join(dir, "esp")
	for _, d := range []string{"root/etc", "root/usr/bin", "esp/EFI/BOOT"} {
		require.NoError(t, os.MkdirAll(filepath.Join(dir, d), 0o755))
	}
	require.NoError(t, os.WriteFile(filepath.Join(root, "etc/os-release"), []byte("ID=debian\nVERSION_ID=12\n"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(root, "usr/bin/hello"), []byte("#!/bin/sh\necho hi\n"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(esp, "EFI/BOOT/hello.txt"), []byte("esp file\n"), 0o644))
	// mkfs.ext4 -d copies atimes: fix them after the mtimes so that
	// reading the tree (relatime: atime newer than mtime, ctime and a day
	// ago) does not change them between builds.
	mtime, atime := time.Unix(1600000000, 0), time.Now().Add(time.Hour)
	require.NoError(t, filepath.WalkDir(dir, func(p string, _ os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		return os.Chtimes(p, atime, mtime)
	}))
	return root, esp
}

type sfdiskJSON struct {
	PartitionTable struct {
		Label      string `json:"label"`
		ID         string `json:"id"`
		Partitions []struct {
			Start int64  `json:"start"`
			Size  int64  `json:"size"`
			Type  string `json:"type"`
			UUID  string `json:"uuid"`
			Name  string `json:"name"`
		} `json:"partitions"`
	} `json:"partitiontable"`
}

func TestBuild(t *testing.T) {
	needTools(t)
	root, esp := smallTree(t)
	out := filepath.Join(t.TempDir(), "disk.raw")
	spec := Spec{RootDir: root, ESPDir: esp, Output: out, Seed: "test", SourceDateEpoch: 1700000000}
	before := treeTimes(t, filepath.Dir(root))
	l, err := Build(context.Background(), spec, nil)
	require.NoError(t, err)
	firstHash := fileHash(t, out)
	readChanged := treeTimes(t, filepath.Dir(root)) != before

	b, err := exec.Command("sfdisk", "-J", out).Output()
	require.NoError(t, err)
	var pt sfdiskJSON
	require.NoError(t, json.Unmarshal(b, &pt))
	if pt.PartitionTable.Label != "gpt" {
		t.Errorf("sfdisk -J: label = %q, want gpt", pt.PartitionTable.Label)
	}
	wantTypes := []string{TypeESP, TypeRootX8664}
	require.Len(t, pt.PartitionTable.Partitions, 2)
	for i, p := range pt.PartitionTable.Partitions {
		if !strings.EqualFold(p.Type, wantTypes[i]) {
			t.Errorf("partition %d type = %s, want %s", i+1, p.Type, wantTypes[i])
		}
		if p.Start*512 != l.Partitions[i].Offset || p.Size*512 != l.Partitions[i].Size {
			t.Errorf("partition %d at %d+%d, layout says %d+%d", i+1, p.Start*512, p.Size*512, l.Partitions[i].Offset, l.Partitions[i].Size)
		}
		if !strings.EqualFold(p.UUID, l.Partitions[i].UUID) {
			t.Errorf("partition %d uuid = %s, want %s", i+1, p.UUID, l.Partitions[i].UUID)
		}
	}

	// Sparse: far fewer blocks than the apparent size.
	var st syscall.Stat_t
	require.NoError(t, syscall.Stat(out, &st))
	if used := st.Blocks * 512; used*4 > st.Size {
		t.Errorf("image uses %d bytes of %d: not sparse", used, st.Size)
	}

	// The root filesystem holds the tree (read back with debugfs, no mount).
	rootPart := l.Partitions[1]
	if debugfs, err := exec.LookPath("debugfs"); err == nil {
		fsImg := filepath.Join(t.TempDir(), "root.ext4")
		require.NoError(t, exec.Command("dd", "if="+out, "of="+fsImg, "bs=1M",
			"skip="+itoa(rootPart.Offset/mib), "count="+itoa(rootPart.Size/mib), "conv=sparse", "status=none").Run())
		got, err := exec.Command(debugfs, "-R", "cat /etc/os-release", fsImg).Output()
		require.NoError(t, err)
		if !bytes.Contains(got, []byte("ID=debian")) {
			t.Errorf("root fs /etc/os-release = %q, want the tree's file", got)
		}
		uuid, _ := exec.Command("blkid", "-o", "value", "-s", "UUID", fsImg).Output()
		if strings.TrimSpace(string(uuid)) != strings.ToLower(l.RootFSUUID) {
			t.Errorf("root fs UUID = %q, want %q", uuid, strings.ToLower(l.RootFSUUID))
		}
	}
	// The ESP holds the ESP tree (read back with mtools at its offset).
	got, err := exec.Command("mtype", "-i", out+"@@"+itoa(l.Partitions[0].Offset), "::/EFI/BOOT/hello.txt").Output()
	require.NoError(t, err, "mtype")
	if string(got) != "esp file\n" {
		t.Errorf("ESP hello.txt = %q, want %q", got, "esp file\n")
	}

	// systemd-dissect recognises the root partition (needs loop devices).
	if os.Geteuid() == 0 {
		if dissect, err := exec.LookPath("systemd-dissect"); err == nil {
			got, err := exec.Command(dissect, "--json=short", out).CombinedOutput()
			if err != nil {
				t.Logf("systemd-dissect %s: %v: %s (no loop devices here?)", out, err, got)
			} else if !bytes.Contains(got, []byte(`"designator":"root"`)) {
				t.Errorf("systemd-dissect %s = %s, want a root partition", out, got)
			}
		}
	}

	// Same tree and spec, same image.
	t.Run("reproducible", func(t *testing.T) {
		if readChanged {
			// mkfs.ext4 -d copies each inode's atime and ctime from the
			// tree, so a tree whose atimes change when read (a filesystem
			// mounted strictatime, as systemd-nspawn's /tmp tmpfs is: make
			// fresh-check runs there) cannot give the same image twice.
			// docs/imagebuilder.md says so.
			testenv.Skipf(t, "reading the tree in %s changed its atimes (a strictatime mount): mkfs.ext4 -d copies them, so a second build cannot match; set TMPDIR to a relatime or noatime filesystem", filepath.Dir(root))
		}
		out2 := filepath.Join(t.TempDir(), "disk.raw")
		spec.Output = out2
		_, err = Build(context.Background(), spec, nil)
		require.NoError(t, err)
		if a, b := firstHash, fileHash(t, out2); a != b {
			t.Errorf("Build twice from the same spec: images differ (%x vs %x)", a, b)
		}
	})
}

// treeTimes is the atime, mtime and ctime of every file under dir, as one
// string to compare.
func treeTimes(t *testing.T, dir string) string {
	t.Helper()
	var b strings.Builder
	require.NoError(t, filepath.WalkDir(dir, func(p string, _ os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var st syscall.Stat_t
		if err := syscall.Lstat(p, &st); err != nil {
			return err
		}
		fmt.Fprintf(&b, "%s %d.%d %d.%d %d.%d\n", p, st.Atim.Sec, st.Atim.Nsec, st.Mtim.Sec, st.Mtim.Nsec, st.Ctim.Sec, st.Ctim.Nsec)
		return nil
	}))
	return b.String()
}

func TestBuildInvalid(t *testing.T) {
	root, _ := smallTree(t)
	out := filepath.Join(t.TempDir(), "x.raw")
	tests := []struct {
		name string
		spec Spec
	}{
		{"no root", Spec{Output: out}},
		{"no output", Spec{RootDir: root}},
		{"small ESP", Spec{RootDir: root, Output: out, ESPSize: mib}},
		{"unaligned root", Spec{RootDir: root, Output: out, RootSize: 10*mib + 1}},
		{"bad uuid", Spec{RootDir: root, Output: out, RootUUID: "nope"}},
		{"root not a dir", Spec{RootDir: filepath.Join(root, "etc/os-release"), Output: out}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Build(context.Background(), tt.spec, nil)
			if !errdefs.IsInvalidArgument(err) {
				t.Errorf("Build(%+v) = %v, want InvalidArgument", tt.spec, err)
			}
		})
	}
	if _, err := os.Stat(out); err == nil {
		t.Errorf("failed builds left %s", out)
	}
}

func TestUUIDFrom(t *testing.T) {
	a, b := uuidFrom("s", "root"), uuidFrom("s", "esp")
	if a == b || !isUUID(a) || a != uuidFrom("s", "root") {
		t.Errorf("uuidFrom(%q, root/esp) = %q, %q: want distinct stable UUIDs", "s", a, b)
	}
}

func fileHash(t *testing.T, p string) [32]byte {
	f, err := os.Open(p)
	require.NoError(t, err)
	defer f.Close()
	h := sha256.New()
	_, err = io.Copy(h, f)
	require.NoError(t, err)
	var s [32]byte
	copy(s[:], h.Sum(nil))
	return s
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
