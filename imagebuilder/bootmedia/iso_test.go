package bootmedia_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/imagebuilder/bootmedia"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

// isoInputs writes a kernel and an initramfs stand-in to a new directory,
// dated mtime, and returns their paths.
func isoInputs(t *testing.T, mtime time.Time) (kernel, initrd string) {
	t.Helper()
	dir := t.TempDir()
	kernel, initrd = filepath.Join(dir, "vmlinuz"), filepath.Join(dir, "initrd.img")
	require.NoError(t, os.WriteFile(kernel, bytes.Repeat([]byte("kernel"), 100000), 0o644))
	require.NoError(t, os.WriteFile(initrd, bytes.Repeat([]byte("initramfs"), 50000), 0o600))
	for _, p := range []string{kernel, initrd, dir} {
		require.NoError(t, os.Chtimes(p, mtime, mtime))
	}
	return kernel, initrd
}

func needISOTools(t *testing.T) {
	t.Helper()
	for _, tool := range []string{"grub-mkimage", "xorriso", "mformat", "mcopy"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (apt-get install grub-common grub-pc-bin grub-efi-amd64-bin xorriso mtools)", tool)
		}
	}
}

func writeISO(t *testing.T, iso bootmedia.ISO) []byte {
	t.Helper()
	out := filepath.Join(t.TempDir(), "kiln-agent.iso")
	err := bootmedia.WriteISO(context.Background(), bootmedia.ExecRunner{}, iso, out)
	if errdefs.IsNotFound(err) {
		testenv.Skipf(t, "cannot build an ISO here: %v", err)
	}
	require.NoError(t, err)
	b, err := os.ReadFile(out)
	require.NoError(t, err)
	return b
}

func TestWriteISOIsReproducible(t *testing.T) {
	needISOTools(t)
	const epoch = 1764633600 // 2025-12-02T00:00:00Z
	cmdline := bootmedia.ISOCmdline("kiln.host=vm1")
	k1, i1 := isoInputs(t, time.Now())
	a := writeISO(t, bootmedia.ISO{Kernel: k1, Initrd: i1, Cmdline: cmdline, SourceDateEpoch: epoch})

	// Same inputs elsewhere, with other file dates, in another time zone,
	// at least one second later.
	k2, i2 := isoInputs(t, time.Unix(1000000000, 0))
	t.Setenv("TZ", "America/New_York")
	t.Setenv("SOURCE_DATE_EPOCH", "1")
	for now := time.Now().Unix(); time.Now().Unix() == now; {
		time.Sleep(50 * time.Millisecond)
	}
	b := writeISO(t, bootmedia.ISO{Kernel: k2, Initrd: i2, Cmdline: cmdline, SourceDateEpoch: epoch})
	if !bytes.Equal(a, b) {
		t.Fatalf("two ISOs from the same inputs differ: %s", firstDiffs(a, b))
	}

	// What a user reads back: the volume is dated the epoch, boots BIOS
	// and UEFI, and carries the command line.
	iso := filepath.Join(t.TempDir(), "a.iso")
	require.NoError(t, os.WriteFile(iso, a, 0o644))
	report := xorrisoReport(t, iso, "-pvd_info", "-report_el_torito", "plain")
	for _, want := range []string{"Volume Id    : KILN_AGENT", "Creation Time: 2025120200000000", "Modif. Time  : 2025120200000000",
		"El Torito img path :   1  /boot/grub/i386-pc/eltorito.img", "El Torito img path :   2  /efi.img"} {
		if !strings.Contains(report, want) {
			t.Errorf("xorriso report lacks %q:\n%s", want, report)
		}
	}
	if !regexp.MustCompile(`(?m)^El Torito boot img :\s+1\s+BIOS\s`).MatchString(report) || !regexp.MustCompile(`(?m)^El Torito boot img :\s+2\s+UEFI\s`).MatchString(report) {
		t.Errorf("El Torito catalog lacks a BIOS and a UEFI image:\n%s", report)
	}
	dir := t.TempDir()
	xorrisoReport(t, iso, "-osirrox", "on", "-extract", "/boot/grub/grub.cfg", filepath.Join(dir, "grub.cfg"), "-extract", "/efi.img", filepath.Join(dir, "efi.img"))
	cfg, err := os.ReadFile(filepath.Join(dir, "grub.cfg"))
	require.NoError(t, err)
	if !strings.Contains(string(cfg), "linux /boot/vmlinuz "+cmdline+"\n") {
		t.Errorf("grub.cfg:\n%s\nwant the command line %q", cfg, cmdline)
	}
	// The EFI image's files are dated the epoch too.
	cmd := exec.Command("mdir", "-i", filepath.Join(dir, "efi.img"), "::/efi/boot")
	cmd.Env = append(os.Environ(), "TZ=UTC0")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, string(out))
	if !regexp.MustCompile(`bootx64\s+efi\s+\d+ 2025-12-02\s+0:00`).Match(out) {
		t.Errorf("mdir of the EFI image:\n%s\nwant bootx64.efi dated 2025-12-02 0:00", out)
	}

	// Another epoch, other bytes.
	c := writeISO(t, bootmedia.ISO{Kernel: k2, Initrd: i2, Cmdline: cmdline, SourceDateEpoch: epoch + 86400})
	if bytes.Equal(a, c) {
		t.Errorf("ISOs of two epochs are identical")
	}
}

// TestWriteISOBefore1980 builds an ISO dated 1970 (SOURCE_DATE_EPOCH
// unset): FAT cannot hold that date and gets 1980-01-01.
func TestWriteISOBefore1980(t *testing.T) {
	needISOTools(t)
	k, i := isoInputs(t, time.Now())
	a := writeISO(t, bootmedia.ISO{Kernel: k, Initrd: i, Cmdline: "console=ttyS0"})
	iso := filepath.Join(t.TempDir(), "a.iso")
	require.NoError(t, os.WriteFile(iso, a, 0o644))
	if report := xorrisoReport(t, iso, "-pvd_info"); !strings.Contains(report, "Creation Time: 1970010100000000") {
		t.Errorf("xorriso -pvd_info:\n%s\nwant creation time 1970010100000000", report)
	}
	dir := t.TempDir()
	xorrisoReport(t, iso, "-osirrox", "on", "-extract", "/efi.img", filepath.Join(dir, "efi.img"))
	cmd := exec.Command("mdir", "-i", filepath.Join(dir, "efi.img"), "::/efi/boot")
	cmd.Env = append(os.Environ(), "TZ=UTC0")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, string(out))
	if !regexp.MustCompile(`bootx64\s+efi\s+\d+ 1980-01-01\s+0:00`).Match(out) {
		t.Errorf("mdir of the EFI image:\n%s\nwant bootx64.efi dated 1980-01-01 0:00", out)
	}
}

func TestWriteISOErrors(t *testing.T) {
	k, i := isoInputs(t, time.Now())
	for _, tc := range []struct {
		name string
		iso  bootmedia.ISO
		want func(error) bool
	}{
		{"quote in cmdline", bootmedia.ISO{Kernel: k, Initrd: i, Cmdline: `kiln.host=a"; reboot`}, errdefs.IsInvalidArgument},
		{"negative epoch", bootmedia.ISO{Kernel: k, Initrd: i, SourceDateEpoch: -1}, errdefs.IsInvalidArgument},
		// Found by FuzzWriteISO: GRUB metacharacters other than quotes
		// and ';' passed, and a year after 9999 made a 17-digit date.
		{"brace in cmdline", bootmedia.ISO{Kernel: k, Initrd: i, Cmdline: "quiet } menuentry x {"}, errdefs.IsInvalidArgument},
		{"pipe in cmdline", bootmedia.ISO{Kernel: k, Initrd: i, Cmdline: "a | b"}, errdefs.IsInvalidArgument},
		{"epoch after 9999", bootmedia.ISO{Kernel: k, Initrd: i, SourceDateEpoch: 253402300800}, errdefs.IsInvalidArgument},
		{"no GRUB", bootmedia.ISO{Kernel: k, Initrd: i, GrubDir: t.TempDir()}, errdefs.IsNotFound},
	} {
		err := bootmedia.WriteISO(context.Background(), bootmedia.ExecRunner{}, tc.iso, filepath.Join(t.TempDir(), "x.iso"))
		if !tc.want(err) {
			t.Errorf("WriteISO(%s) = %v", tc.name, err)
		}
	}
}

func xorrisoReport(t *testing.T, iso string, args ...string) string {
	t.Helper()
	out, err := exec.Command("xorriso", append([]string{"-indev", iso}, args...)...).CombinedOutput()
	require.NoError(t, err, string(out))
	return string(out)
}

// firstDiffs describes where a and b differ, like cmp -l | head.
func firstDiffs(a, b []byte) string {
	var s []string
	if len(a) != len(b) {
		s = append(s, "sizes "+strconv.Itoa(len(a))+" and "+strconv.Itoa(len(b)))
	}
	n := 0
	for i := 0; i < min(len(a), len(b)) && n < 10; i++ {
		if a[i] != b[i] {
			s = append(s, fmt.Sprintf("offset %d: %#02x %#02x", i, a[i], b[i]))
			n++
		}
	}
	return strings.Join(s, "; ")
}

// TestWriteISOPathWithEquals builds an ISO into a directory whose path
// holds "=" (a boot server's ISO cache under such a path): xorriso's
// -graft-points syntax reads "=" in a pathspec as TARGET=SOURCE, so the
// tree must not be named by a path that holds one.
func TestWriteISOPathWithEquals(t *testing.T) {
	needISOTools(t)
	k, i := isoInputs(t, time.Now())
	dir := filepath.Join(t.TempDir(), "cache=a=b")
	require.NoError(t, os.Mkdir(dir, 0o755))
	out := filepath.Join(dir, "h1.iso")
	err := bootmedia.WriteISO(context.Background(), bootmedia.ExecRunner{}, bootmedia.ISO{Kernel: k, Initrd: i, Cmdline: "console=ttyS0"}, out)
	if errdefs.IsNotFound(err) {
		testenv.Skipf(t, "cannot build an ISO here: %v", err)
	}
	require.NoError(t, err, "WriteISO into %s", dir)
	if report := xorrisoReport(t, out, "-find", "/boot", "-name", "vmlinuz"); !strings.Contains(report, "/boot/vmlinuz") {
		t.Errorf("the ISO built under %s lacks /boot/vmlinuz:\n%s", dir, report)
	}
}
