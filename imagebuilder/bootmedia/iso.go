package bootmedia

import (
	"context"
	"fmt"
	"hash/crc32"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// DefaultGrubDir holds GRUB's images and modules per platform
// (grub-pc-bin: i386-pc, grub-efi-amd64-bin: x86_64-efi).
const DefaultGrubDir = "/usr/lib/grub"

// ISOVolumeID is the ISO 9660 volume label of the boot media.
const ISOVolumeID = "KILN_AGENT"

// fatMinEpoch is 1980-01-01T00:00:00Z, the earliest date FAT can hold.
const fatMinEpoch = 315532800

// grubMeta are the characters GRUB's script lexer gives a meaning in
// grub.cfg: its metacharacters, quotes, variables and comments.
const grubMeta = "{}|&$;<>\"'\\#"

// maxEpoch is 9999-12-31T23:59:59Z: ISO 9660 dates have four-digit years.
const maxEpoch = 253402300799

// isoTools are the programs WriteISO runs.
var isoTools = []string{"grub-mkimage", "xorriso", "mformat", "mcopy"}

// ISO says what WriteISO puts on a boot ISO.
type ISO struct {
	// Kernel and Initrd are the files booted (/boot/vmlinuz and
	// /boot/initrd.img on the ISO); required.
	Kernel, Initrd string
	// Cmdline is the kernel command line in grub.cfg.
	Cmdline string
	// SourceDateEpoch is the date of the volume and of every file on it,
	// in seconds since 1970, and the seed of its identifiers (ISO volume
	// UUID, GPT GUIDs, FAT serial). The EFI FAT image, which cannot hold
	// dates before 1980, gets 1980-01-01 for earlier ones.
	SourceDateEpoch int64
	// GrubDir holds GRUB's i386-pc and x86_64-efi directories (default
	// DefaultGrubDir).
	GrubDir string
}

// EnvSourceDateEpoch is $SOURCE_DATE_EPOCH, or 0 when it is unset or not
// a number of seconds.
func EnvSourceDateEpoch() int64 {
	n, err := strconv.ParseInt(os.Getenv("SOURCE_DATE_EPOCH"), 10, 64)
	if err != nil || n < 0 {
		return 0
	}
	return n
}

// BuildISO writes a hybrid BIOS+UEFI ISO to out that boots kernel and
// initrd with cmdline, dated $SOURCE_DATE_EPOCH (0 when unset): the same
// inputs give the same bytes. See WriteISO.
func BuildISO(ctx context.Context, run Runner, kernel, initrd, cmdline, out string) error {
	return WriteISO(ctx, run, ISO{Kernel: kernel, Initrd: initrd, Cmdline: cmdline, SourceDateEpoch: EnvSourceDateEpoch()}, out)
}

// WriteISO writes iso to out: a hybrid ISO that boots from CD and disk
// under BIOS and UEFI, laid out as grub-mkrescue lays it out (same GRUB
// images, same xorriso boot options; without its fonts, translations and
// Mac HFS+ tree), but byte-reproducible: every date is
// iso.SourceDateEpoch, the identifiers derive from it, and the tools run
// with TZ=UTC0 and LC_ALL=C. The same kernel, initramfs, command line,
// epoch and tool versions (grub-mkimage, xorriso, mtools) give the same
// bytes. It is written under a temporary name next to out and renamed.
// Equivalent to:
//
//	grub-mkimage -O i386-pc-eltorito -p /boot/grub -c load.cfg -o ROOT/boot/grub/i386-pc/eltorito.img biosdisk iso9660
//	grub-mkimage -O x86_64-efi -p '()/boot/grub' -c load.cfg -o EFI/efi/boot/bootx64.efi part_gpt part_msdos fat part_apple iso9660
//	mformat -C -f 2880 -L 16 -N SERIAL -i ROOT/efi.img :: && mcopy -s -i ROOT/efi.img EFI/efi ::/
//	xorriso -as mkisofs ... --efi-boot efi.img ... -r ROOT -- -volume_date all_file_dates =EPOCH
//
// (load.cfg inserts GRUB's partition map modules; ROOT holds boot/vmlinuz,
// boot/initrd.img, boot/grub/grub.cfg and GRUB's modules.)
//
// Errors: InvalidArgument for a command line grub.cfg would interpret or
// a date outside 1970-9999,
// NotFound when a tool or GRUB platform is not installed.
func WriteISO(ctx context.Context, run Runner, iso ISO, out string) error {
	if strings.ContainsAny(iso.Cmdline, grubMeta) || strings.ContainsFunc(iso.Cmdline, unicode.IsControl) {
		return errdefs.InvalidArgument("iso: kernel command line %q holds characters grub.cfg would interpret (any of %s or a control character)", iso.Cmdline, grubMeta)
	}
	if iso.SourceDateEpoch < 0 {
		return errdefs.InvalidArgument("iso: source date epoch %d is before 1970", iso.SourceDateEpoch)
	}
	if iso.SourceDateEpoch > maxEpoch {
		return errdefs.InvalidArgument("iso: source date epoch %d is after 9999-12-31, the last date an ISO 9660 volume holds", iso.SourceDateEpoch)
	}
	if iso.GrubDir == "" {
		iso.GrubDir = DefaultGrubDir
	}
	const pkgs = "apt-get install grub-common grub-pc-bin grub-efi-amd64-bin xorriso mtools"
	for _, tool := range isoTools {
		if _, err := exec.LookPath(tool); err != nil {
			return errdefs.NotFound("iso: %s not found (%s)", tool, pkgs)
		}
	}
	pcDir, efiDir := filepath.Join(iso.GrubDir, "i386-pc"), filepath.Join(iso.GrubDir, "x86_64-efi")
	for _, f := range []string{filepath.Join(pcDir, "boot_hybrid.img"), filepath.Join(pcDir, "kernel.img"), filepath.Join(efiDir, "kernel.img")} {
		if _, err := os.Stat(f); err != nil {
			return errdefs.NotFound("iso: GRUB file %s missing (%s)", f, pkgs)
		}
	}

	out, err := filepath.Abs(out)
	if err != nil {
		return fmt.Errorf("iso: %w", err)
	}
	dir, err := os.MkdirTemp(filepath.Dir(out), ".iso-")
	if err != nil {
		return fmt.Errorf("iso: %w", err)
	}
	defer os.RemoveAll(dir)
	root := filepath.Join(dir, "root")
	grub := filepath.Join(root, "boot", "grub")
	efiTree := filepath.Join(dir, "efi")
	for _, d := range []string{filepath.Join(grub, "i386-pc"), filepath.Join(grub, "x86_64-efi"), filepath.Join(efiTree, "efi", "boot")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("iso: %w", err)
		}
	}
	if err := linkOrCopy(iso.Kernel, filepath.Join(root, "boot", "vmlinuz")); err != nil {
		return fmt.Errorf("iso: kernel: %w", err)
	}
	if err := linkOrCopy(iso.Initrd, filepath.Join(root, "boot", "initrd.img")); err != nil {
		return fmt.Errorf("iso: initramfs: %w", err)
	}
	if err := os.WriteFile(filepath.Join(grub, "grub.cfg"), []byte(GrubConfig(iso.Cmdline)), 0o644); err != nil {
		return fmt.Errorf("iso: %w", err)
	}
	// GRUB's modules, which grub.cfg's commands load from /boot/grub.
	for _, plat := range []string{"i386-pc", "x86_64-efi"} {
		if err := copyModules(filepath.Join(iso.GrubDir, plat), filepath.Join(grub, plat)); err != nil {
			return fmt.Errorf("iso: GRUB %s modules: %w", plat, err)
		}
	}

	// The boot images, as grub-mkrescue makes them: the partition map
	// modules inserted by an embedded config, /boot/grub on the boot
	// device as prefix.
	pcCfg, efiCfg := filepath.Join(dir, "load-pc.cfg"), filepath.Join(dir, "load-efi.cfg")
	if err := writeLoadCfg(pcDir, pcCfg); err != nil {
		return fmt.Errorf("iso: %w", err)
	}
	if err := writeLoadCfg(efiDir, efiCfg); err != nil {
		return fmt.Errorf("iso: %w", err)
	}
	// Tools that read the clock or the time zone run under env(1).
	env := func(epoch int64, name string, args ...string) []string {
		return append([]string{"env", "TZ=UTC0", "LC_ALL=C", "SOURCE_DATE_EPOCH=" + strconv.FormatInt(epoch, 10), name}, args...)
	}
	fatEpoch := max(iso.SourceDateEpoch, fatMinEpoch)
	date := time.Unix(iso.SourceDateEpoch, 0).UTC()
	uuid := date.Format("20060102150405") + "00"
	serial := fmt.Sprintf("%08X", crc32.ChecksumIEEE([]byte("kiln-agent-efi "+uuid)))
	efiImg := filepath.Join(root, "efi.img")
	for _, args := range [][]string{
		{"grub-mkimage", "-d", pcDir, "-O", "i386-pc-eltorito", "-p", "/boot/grub", "-c", pcCfg,
			"-o", filepath.Join(grub, "i386-pc", "eltorito.img"), "biosdisk", "iso9660"},
		{"grub-mkimage", "-d", efiDir, "-O", "x86_64-efi", "-p", "()/boot/grub", "-c", efiCfg,
			"-o", filepath.Join(efiTree, "efi", "boot", "bootx64.efi"), "part_gpt", "part_msdos", "fat", "part_apple", "iso9660"},
		// The EFI system partition image: a fixed serial instead of a
		// random one; mtools dates every entry $SOURCE_DATE_EPOCH.
		env(fatEpoch, "mformat", "-C", "-f", "2880", "-L", "16", "-N", serial, "-i", efiImg, "::"),
		env(fatEpoch, "mcopy", "-s", "-i", efiImg, filepath.Join(efiTree, "efi"), "::/"),
		// With SOURCE_DATE_EPOCH xorriso derives the GPT GUIDs from the
		// volume UUID and dates the boot catalog and "now"; all_file_dates
		// dates every file, whatever its mtime on disk. The tree and the
		// output are named relative to dir: with -graft-points a "=" in a
		// pathspec means TARGET=SOURCE, and dir sits next to out, whose
		// path may hold one (a boot server's ISO cache).
		env(iso.SourceDateEpoch, "xorriso", "-as", "mkisofs", "-graft-points", "--modification-date="+uuid,
			"-b", "boot/grub/i386-pc/eltorito.img", "-no-emul-boot", "-boot-load-size", "4", "-boot-info-table",
			"--grub2-boot-info", "--grub2-mbr", filepath.Join(pcDir, "boot_hybrid.img"),
			"--efi-boot", "efi.img", "-efi-boot-part", "--efi-boot-image", "--protective-msdos-label",
			"-V", ISOVolumeID, "-o", "out.iso", "-r", "root",
			"--sort-weight", "0", "/", "--sort-weight", "1", "/boot",
			"--", "-volume_date", "all_file_dates", "="+strconv.FormatInt(iso.SourceDateEpoch, 10)),
	} {
		if _, err := run.Run(ctx, dir, args[0], args[1:]...); err != nil {
			return fmt.Errorf("iso: %w", err)
		}
	}
	// Not internal/atomicfile: xorriso writes the ISO itself; it is
	// published by a plain rename.
	if err := os.Rename(filepath.Join(dir, "out.iso"), out); err != nil {
		return fmt.Errorf("iso: %w", err)
	}
	return nil
}

// writeLoadCfg writes the config grub-mkrescue embeds in a boot image: an
// insmod of each partition map module of the platform (partmap.lst).
func writeLoadCfg(platDir, path string) error {
	b, err := os.ReadFile(filepath.Join(platDir, "partmap.lst"))
	if err != nil {
		return err
	}
	var cfg strings.Builder
	for _, m := range strings.Fields(string(b)) {
		cfg.WriteString("insmod " + m + "\n")
	}
	return os.WriteFile(path, []byte(cfg.String()), 0o644)
}

// copyModules copies GRUB's modules (*.mod) and their lists (*.lst) from
// src to dst.
func copyModules(src, dst string) error {
	ents, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	var names []string
	for _, e := range ents {
		if n := e.Name(); e.Type().IsRegular() && (strings.HasSuffix(n, ".mod") || strings.HasSuffix(n, ".lst")) {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	if len(names) == 0 {
		return errdefs.NotFound("no GRUB modules in %s", src)
	}
	for _, n := range names {
		if err := copyFile(filepath.Join(src, n), filepath.Join(dst, n)); err != nil {
			return err
		}
	}
	return nil
}

// isoToolVersions returns the first line of the version of each program
// whose output is on the ISO.
func isoToolVersions(ctx context.Context, run Runner) (map[string]string, error) {
	v := map[string]string{}
	for _, tool := range []struct{ name, flag string }{{"grub-mkimage", "--version"}, {"xorriso", "-version"}, {"mformat", "--version"}} {
		out, err := run.Run(ctx, "", tool.name, tool.flag)
		if err != nil {
			return nil, fmt.Errorf("iso: %w", err)
		}
		line, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
		v[tool.name] = line
	}
	return v, nil
}
