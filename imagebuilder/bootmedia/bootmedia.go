// Package bootmedia builds the agent's boot media: a stock Debian kernel, an
// initramfs holding busybox, the kernel modules a server needs to reach its
// disks and network, an init that brings up a NIC with DHCP, and the static
// kiln-agent in boot mode; plus a hybrid BIOS+UEFI ISO that boots them for
// virtual media. Kernel and initramfs serve iPXE (see controller/bootserver).
// Every output is byte-reproducible: the same inputs, SOURCE_DATE_EPOCH and
// tool versions give the same bytes (Spec.SourceDateEpoch, WriteISO).
//
// The agent on the media enrolls from the kernel command line
// (kiln.controller=, kiln.token=, kiln.ca_hash=, kiln.host=) and reports how
// it booted from kiln.boot= (pxe or virtualmedia).
package bootmedia

import (
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/klauspost/compress/gzip"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Names of the files Build writes in Spec.OutDir.
const (
	KernelFile     = "vmlinuz"
	InitrdFile     = "initrd.img"
	ISOFile        = "kiln-agent.iso"
	ManifestFile   = "bootmedia.json"
	DefaultBusybox = "/bin/busybox"
	// DefaultDebugfs is e2fsprogs' debugfs on the build machine: the
	// boot agent writes the host's identity into the laid image with it.
	DefaultDebugfs = "/usr/sbin/debugfs"
)

// DefaultModules are the modules the initramfs loads (with their
// dependencies): virtio, NVMe, SATA/SCSI disks, common NICs, the
// filesystems the agent reads, and the ACPI power button.
var DefaultModules = []string{
	"virtio_pci", "virtio_blk", "virtio_scsi", "virtio_net",
	"nvme", "ahci", "sd_mod", "sr_mod",
	"e1000", "e1000e", "igb", "ixgbe", "tg3", "r8169",
	"ext4", "crc32c_generic", "vfat", "nls_cp437", "nls_iso8859_1", "isofs",
	"button", "evdev",
}

// DefaultCmdline is the kernel command line of every boot: serial and VGA
// consoles (the last one is /dev/console), reboot 10 s after a panic.
const DefaultCmdline = "console=tty0 console=ttyS0,115200 panic=10"

//go:embed init.sh
var initScript []byte

//go:embed udhcpc.script
var udhcpcScript []byte

//go:embed powerbutton.sh
var powerButtonScript []byte

// Spec says what to build.
type Spec struct {
	// KernelPackage is the Debian kernel package; default: the newest
	// linux-image-6.1.*-amd64 the apt sources have.
	KernelPackage string
	// AgentBinary is the static kiln-agent to put in the initramfs
	// (required).
	AgentBinary string
	// Modules to load at boot, by name; their dependencies are added and
	// ordered from modules.dep. Default DefaultModules.
	Modules []string
	// Busybox is a static busybox (default /bin/busybox from
	// busybox-static).
	Busybox string
	// Debugfs is e2fsprogs' dynamic debugfs (default DefaultDebugfs); it
	// goes into the initramfs as /sbin/debugfs with its ELF interpreter
	// and shared libraries, taken from the build machine.
	Debugfs string
	// Cmdline is added to the ISO's kernel command line after
	// DefaultCmdline and kiln.boot=virtualmedia, e.g. kiln.controller=...
	Cmdline string
	// CacheDir keeps downloaded kernels, keyed by package and version
	// (default ${KILN_CACHE:-/var/cache/kiln}/bootmedia).
	CacheDir string
	// OutDir receives vmlinuz, initrd.img, kiln-agent.iso and
	// bootmedia.json (required).
	OutDir string
	// NoISO skips the ISO (kernel and initramfs only, for iPXE).
	NoISO bool
	// SourceDateEpoch is the modification time of every initramfs entry
	// and the date of the ISO and everything on it (default:
	// $SOURCE_DATE_EPOCH, else 0), so that a rebuild from the same inputs
	// is byte-identical.
	SourceDateEpoch int64
	// Runner runs apt-cache, apt-get, dpkg-deb and the ISO tools
	// (grub-mkimage, mformat, mcopy, xorriso; default ExecRunner).
	Runner Runner
}

// File is one output file in the manifest.
type File struct {
	Name   string `json:"name"`
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256"`
}

// Manifest describes built boot media (bootmedia.json).
type Manifest struct {
	Kernel Kernel `json:"kernel"`
	// Modules are the module files in the order init loads them.
	Modules []string `json:"modules"`
	// MissingModules were asked for but are neither modules nor built in.
	MissingModules []string `json:"missingModules,omitempty"`
	// Cmdline is the ISO's kernel command line.
	Cmdline string `json:"cmdline"`
	Files   []File `json:"files"`
	// BuildDate is SourceDateEpoch as a date, so that the manifest of a
	// rebuild is byte-identical too.
	BuildDate time.Time `json:"buildDate"`
	// SourceDateEpoch dates every initramfs entry and everything on the
	// ISO (volume, files, EFI image) and seeds the ISO's identifiers.
	SourceDateEpoch int64 `json:"sourceDateEpoch"`
	// Inputs are the files built into the initramfs besides the kernel
	// package's: the agent and busybox, by size and sha256.
	Inputs []File `json:"inputs"`
	// Tools are the versions of the programs that lay out the ISO
	// (grub-mkimage, xorriso, mformat). Builds from the same kernel,
	// inputs, command line, epoch and tools are byte-identical; when two
	// builds differ, one of these fields does.
	Tools map[string]string `json:"tools,omitempty"`
}

// File returns the manifest entry of name, or false.
func (m *Manifest) File(name string) (File, bool) {
	for _, f := range m.Files {
		if f.Name == name {
			return f, true
		}
	}
	return File{}, false
}

// ReadManifest reads dir/bootmedia.json.
func ReadManifest(dir string) (*Manifest, error) {
	b, err := os.ReadFile(filepath.Join(dir, ManifestFile))
	if err != nil {
		if os.IsNotExist(err) {
			return nil, errdefs.NotFound("no boot media manifest in %s (build with kiln-imagebuilder bootmedia)", dir)
		}
		return nil, err
	}
	m := &Manifest{}
	if err := json.Unmarshal(b, m); err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, ManifestFile), err)
	}
	return m, nil
}

// DefaultCacheDir is ${KILN_CACHE:-/var/cache/kiln}/bootmedia.
func DefaultCacheDir() string {
	root := os.Getenv("KILN_CACHE")
	if root == "" {
		root = "/var/cache/kiln"
	}
	return filepath.Join(root, "bootmedia")
}

// Runner runs a command in dir ("" is the current directory) and returns
// its standard output.
type Runner interface {
	Run(ctx context.Context, dir, name string, args ...string) ([]byte, error)
}

// ExecRunner runs commands with os/exec.
type ExecRunner struct{}

var _ Runner = ExecRunner{}

// Run implements Runner. Errors carry the command and the last line of its
// standard error.
func (ExecRunner) Run(ctx context.Context, dir, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		msg := strings.TrimSpace(stderr.String())
		if i := strings.LastIndexByte(msg, '\n'); i >= 0 {
			msg = msg[i+1:]
		}
		return out, fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, msg)
	}
	return out, nil
}

// Build builds the boot media of spec into spec.OutDir and returns its
// manifest. progress, when not nil, receives one line per step with the
// elapsed time. Outputs are written under temporary names and renamed, so
// OutDir never holds a half-written file under a final name; the manifest
// is renamed last.
//
// Errors: InvalidArgument for a bad spec, NotFound when the kernel package
// or a tool is missing, Unavailable when apt cannot download.
func Build(ctx context.Context, spec Spec, progress func(string)) (*Manifest, error) {
	t0 := time.Now()
	say := func(format string, args ...any) {
		if progress != nil {
			progress(fmt.Sprintf("[%6.1fs] ", time.Since(t0).Seconds()) + fmt.Sprintf(format, args...))
		}
	}
	if err := spec.defaults(); err != nil {
		return nil, err
	}
	run := spec.Runner
	if spec.KernelPackage == "" {
		pkg, err := NewestKernelPackage(ctx, run)
		if err != nil {
			return nil, err
		}
		spec.KernelPackage = pkg
	}
	k, err := fetchKernel(ctx, run, spec.CacheDir, spec.KernelPackage, say)
	if err != nil {
		return nil, err
	}
	mods, missing, err := ResolveModules(k.ModulesDir(), spec.Modules)
	if err != nil {
		return nil, fmt.Errorf("kernel %s: %w", k.Release, err)
	}
	if len(missing) > 0 {
		say("modules not in kernel %s: %s", k.Release, strings.Join(missing, " "))
	}

	if err := os.MkdirAll(spec.OutDir, 0o755); err != nil {
		return nil, fmt.Errorf("output directory: %w", err)
	}
	tmp, err := os.MkdirTemp(spec.OutDir, ".build-")
	if err != nil {
		return nil, fmt.Errorf("output directory: %w", err)
	}
	defer os.RemoveAll(tmp)

	if err := copyFile(k.Vmlinuz(), filepath.Join(tmp, KernelFile)); err != nil {
		return nil, fmt.Errorf("kernel: %w", err)
	}
	say("kernel %s (%s)", k.Release, k.Version)

	debugfsDeps, err := ELFDeps("/", spec.Debugfs)
	if err != nil {
		return nil, fmt.Errorf("boot media: debugfs: %w", err)
	}
	ar := initramfs(k, mods, spec, debugfsDeps)
	n, err := writeInitramfs(filepath.Join(tmp, InitrdFile), ar, spec.SourceDateEpoch)
	if err != nil {
		return nil, err
	}
	say("initramfs: %d entries, %d modules, %.1f MiB", len(ar.Paths()), len(mods), float64(n)/(1<<20))

	m := &Manifest{Kernel: *k, Modules: mods, MissingModules: missing,
		BuildDate: time.Unix(spec.SourceDateEpoch, 0).UTC(), SourceDateEpoch: spec.SourceDateEpoch}
	inputs := []struct{ name, path string }{{"kiln-agent", spec.AgentBinary}, {"busybox", spec.Busybox}, {"debugfs", spec.Debugfs}}
	for _, d := range debugfsDeps { // named by their path in the initramfs
		inputs = append(inputs, struct{ name, path string }{d.Path, d.Source})
	}
	for _, in := range inputs {
		f, err := hashFile(in.path)
		if err != nil {
			return nil, err
		}
		f.Name = in.name
		m.Inputs = append(m.Inputs, f)
	}
	names := []string{KernelFile, InitrdFile}
	if !spec.NoISO {
		m.Cmdline = ISOCmdline(spec.Cmdline)
		iso := ISO{Kernel: filepath.Join(tmp, KernelFile), Initrd: filepath.Join(tmp, InitrdFile), Cmdline: m.Cmdline, SourceDateEpoch: spec.SourceDateEpoch}
		if err := WriteISO(ctx, run, iso, filepath.Join(tmp, ISOFile)); err != nil {
			return nil, err
		}
		if m.Tools, err = isoToolVersions(ctx, run); err != nil {
			return nil, err
		}
		say("iso: %s", ISOFile)
		names = append(names, ISOFile)
	}
	for _, name := range names {
		f, err := hashFile(filepath.Join(tmp, name))
		if err != nil {
			return nil, err
		}
		f.Name = name
		m.Files = append(m.Files, f)
	}
	mb, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(tmp, ManifestFile), append(mb, '\n'), 0o644); err != nil {
		return nil, err
	}
	// Not internal/atomicfile: built files move from the work directory
	// by rename, the manifest last, so a reader that finds it finds the
	// rest.
	for _, name := range append(names, ManifestFile) {
		if err := os.Rename(filepath.Join(tmp, name), filepath.Join(spec.OutDir, name)); err != nil {
			return nil, fmt.Errorf("publish %s: %w", name, err)
		}
	}
	say("done: %s", spec.OutDir)
	return m, nil
}

func (s *Spec) defaults() error {
	if s.OutDir == "" {
		return errdefs.InvalidArgument("boot media: an output directory is required")
	}
	if s.AgentBinary == "" {
		return errdefs.InvalidArgument("boot media: the agent binary is required (--agent)")
	}
	if st, err := os.Stat(s.AgentBinary); err != nil || !st.Mode().IsRegular() {
		return errdefs.InvalidArgument("boot media: agent binary %s is not a file", s.AgentBinary)
	}
	if s.Busybox == "" {
		s.Busybox = DefaultBusybox
	}
	if _, err := os.Stat(s.Busybox); err != nil {
		return errdefs.NotFound("boot media: no static busybox at %s (apt-get install busybox-static)", s.Busybox)
	}
	if s.Debugfs == "" {
		s.Debugfs = DefaultDebugfs
	}
	if _, err := os.Stat(s.Debugfs); err != nil {
		return errdefs.NotFound("boot media: no debugfs at %s (apt-get install e2fsprogs)", s.Debugfs)
	}
	if len(s.Modules) == 0 {
		s.Modules = DefaultModules
	}
	if s.CacheDir == "" {
		s.CacheDir = DefaultCacheDir()
	}
	if s.SourceDateEpoch == 0 {
		s.SourceDateEpoch = EnvSourceDateEpoch()
	}
	if s.SourceDateEpoch < 0 {
		return errdefs.InvalidArgument("boot media: source date epoch %d is before 1970", s.SourceDateEpoch)
	}
	if s.Runner == nil {
		s.Runner = ExecRunner{}
	}
	return nil
}

// ISOCmdline is the kernel command line of an ISO boot: DefaultCmdline,
// kiln.boot=virtualmedia, then extra.
func ISOCmdline(extra string) string {
	return strings.TrimSpace(DefaultCmdline + " kiln.boot=virtualmedia " + extra)
}

// initramfs lays out the initramfs of kernel k; debugfsDeps are the
// interpreter and libraries of spec.Debugfs.
func initramfs(k *Kernel, mods []string, spec Spec, debugfsDeps []ELFDep) *Archive {
	ar := &Archive{}
	for _, d := range []string{"proc", "sys", "dev", "run", "tmp", "etc", "root", "var/lib", "sbin", "usr/bin", "usr/sbin"} {
		ar.Add(Entry{Path: d, Mode: fs.ModeDir | 0o755})
	}
	ar.Add(Entry{Path: "tmp", Mode: fs.ModeDir | fs.ModeSticky | 0o777})
	// The kernel opens /dev/console for init before devtmpfs is mounted.
	ar.Add(Entry{Path: "dev/console", Mode: fs.ModeDevice | fs.ModeCharDevice | 0o600, Major: 5, Minor: 1})
	ar.Add(Entry{Path: "bin/busybox", Mode: 0o755, Source: spec.Busybox})
	ar.Add(Entry{Path: "bin/sh", Mode: fs.ModeSymlink, Data: []byte("busybox")})
	ar.Add(Entry{Path: "init", Mode: 0o755, Data: initScript})
	ar.Add(Entry{Path: "sbin/kiln-agent", Mode: 0o755, Source: spec.AgentBinary})
	// The agent runs debugfs from PATH (/bin:/sbin, set by init) to write
	// the host's identity (agent/personalize).
	ar.Add(Entry{Path: "sbin/debugfs", Mode: 0o755, Source: spec.Debugfs})
	for _, d := range debugfsDeps {
		ar.Add(Entry{Path: d.Path, Mode: 0o755, Source: d.Source})
	}
	ar.Add(Entry{Path: "etc/kiln/udhcpc.script", Mode: 0o755, Data: udhcpcScript})
	ar.Add(Entry{Path: "etc/acpi/PWRF/00000080", Mode: 0o755, Data: powerButtonScript})
	ar.Add(Entry{Path: "etc/kiln/modules", Mode: 0o644, Data: []byte(strings.Join(mods, "\n") + "\n")})
	ar.Add(Entry{Path: "etc/hostname", Mode: 0o644, Data: []byte("kiln-boot\n")})
	ar.Add(Entry{Path: "etc/passwd", Mode: 0o644, Data: []byte("root:x:0:0:root:/root:/bin/sh\n")})
	ar.Add(Entry{Path: "etc/group", Mode: 0o644, Data: []byte("root:x:0:\n")})
	// The agent's facts read os-release (host.Facts).
	ar.Add(Entry{Path: "usr/lib/os-release", Mode: 0o644, Data: []byte(OSRelease(k))})
	ar.Add(Entry{Path: "etc/os-release", Mode: fs.ModeSymlink, Data: []byte("../usr/lib/os-release")})
	for _, m := range mods {
		ar.Add(Entry{Path: "lib/modules/" + m, Mode: 0o644, Source: filepath.Join(k.ModulesDir(), m)})
	}
	return ar
}

// OSRelease is the os-release of the boot media: the agent reports it in
// its facts.
func OSRelease(k *Kernel) string {
	return "NAME=\"Kiln boot media\"\nID=kiln-boot\nVERSION_ID=\"" + k.Release + "\"\nPRETTY_NAME=\"Kiln boot media (" + k.Package + " " + k.Version + ")\"\n"
}

// writeInitramfs writes ar as a gzip-compressed cpio archive to path and
// returns its size.
func writeInitramfs(path string, ar *Archive, mtime int64) (int64, error) {
	f, err := os.Create(path)
	if err != nil {
		return 0, fmt.Errorf("initramfs: %w", err)
	}
	defer f.Close()
	zw, err := gzip.NewWriterLevel(f, gzip.DefaultCompression)
	if err != nil {
		return 0, err
	}
	// No name and a zero time in the gzip header: deterministic output.
	if _, err := ar.WriteTo(zw, mtime); err != nil {
		return 0, err
	}
	if err := zw.Close(); err != nil {
		return 0, fmt.Errorf("initramfs: %w", err)
	}
	if err := f.Sync(); err != nil {
		return 0, fmt.Errorf("initramfs: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		return 0, err
	}
	return st.Size(), f.Close()
}

func openFile(name string) (io.ReadCloser, int64, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, 0, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, err
	}
	return f, st.Size(), nil
}

// GrubConfig is the grub.cfg of an ISO that boots /boot/vmlinuz and
// /boot/initrd.img with cmdline, on the serial and VGA consoles.
func GrubConfig(cmdline string) string {
	return `serial --unit=0 --speed=115200
terminal_input serial console
terminal_output serial console
set timeout=0
menuentry "Kiln agent" {
  echo "kiln: loading the agent boot media"
  linux /boot/vmlinuz ` + cmdline + `
  initrd /boot/initrd.img
}
`
}

func linkOrCopy(src, dst string) error {
	if err := os.Link(src, dst); err == nil {
		return nil
	}
	return copyFile(src, dst)
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// hashFile returns the size and sha256 of a file.
func hashFile(path string) (File, error) {
	f, err := os.Open(path)
	if err != nil {
		return File{}, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return File{}, fmt.Errorf("hash %s: %w", path, err)
	}
	return File{Size: n, SHA256: hex.EncodeToString(h.Sum(nil))}, nil
}
