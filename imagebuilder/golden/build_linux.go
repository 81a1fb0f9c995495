package golden

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/klauspost/compress/zstd"
	"golang.org/x/sys/unix"

	"github.com/kilnhq/kiln/imagebuilder/disk"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/imagebuilder/manifest"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/imagebuilder/spec"
	"github.com/kilnhq/kiln/internal/errdefs"
)

func (o Options) withDefaults() Options {
	if o.KubeTools.Dir == "" {
		o.KubeTools.Dir = filepath.Join(rootfs.CacheRoot(), "kube-tools")
	}
	if o.Release.Kubernetes == "" {
		// The release the spec names when kube-tools has a recipe for it
		// (kubetools.Releases); otherwise the pinned one, and Validate
		// reports the mismatch.
		o.Release = kubetools.Pinned()
		if o.Spec != nil && o.Spec.KubernetesVersion != "" {
			if r, err := kubetools.ReleaseFor(o.Spec.KubernetesVersion); err == nil {
				o.Release = r
			}
		}
	}
	if o.Progress == nil {
		o.Progress = io.Discard
	}
	if o.ToolOutput == nil {
		o.ToolOutput = io.Discard
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if o.Getenv == nil {
		o.Getenv = os.Getenv
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return o
}

// Build builds the golden image of o.Spec into o.OutDir and returns what
// it wrote. It checks everything it can before writing anything (the spec,
// root privileges, the agent binary, the tools, the kube-tools cache), then
// runs the steps with one progress line each. It blocks for minutes on a
// cold rootfs cache (debootstrap and apt-get from the mirror).
//
// Errors: InvalidArgument for a bad spec or agent path; FailedPrecondition
// when not root, a tool is missing or the kube-tools cache is incomplete;
// otherwise the failing step's error. On any error OutDir holds nothing new
// under a final name.
func Build(ctx context.Context, o Options) (*Result, error) {
	o = o.withDefaults()
	s := o.Spec
	if s == nil {
		return nil, errdefs.InvalidArgument("golden: no image spec")
	}
	if o.OutDir == "" {
		return nil, errdefs.InvalidArgument("golden: no output directory")
	}
	start := o.Now()
	if err := s.Validate(o.Release.Kubernetes); err != nil {
		return nil, err
	}
	epoch, err := s.Epoch(o.Getenv, start)
	if err != nil {
		return nil, err
	}
	if os.Geteuid() != 0 {
		return nil, errdefs.FailedPrecondition("golden: building an image needs root (debootstrap, file ownership in the root filesystem)")
	}
	agent := s.AgentPath()
	if st, err := os.Stat(agent); err != nil {
		return nil, errdefs.InvalidArgument("golden: agent binary %s: %v (build it with `make build` or point agent: at it)", agent, err)
	} else if !st.Mode().IsRegular() || st.Mode()&0o111 == 0 {
		return nil, errdefs.InvalidArgument("golden: agent binary %s is not an executable file", agent)
	}
	tools := map[string]string{"debugfs": "e2fsprogs"}
	if s.Kernel != spec.KernelNone {
		tools["grub-mkimage"] = "grub-efi-amd64-bin (and grub-common)"
		tools["syslinux"] = "syslinux"
	}
	for tool, pkg := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, errdefs.FailedPrecondition("golden: %s not found (Debian package %s)", tool, pkg)
		}
	}
	if s.Kernel != spec.KernelNone {
		if _, err := os.Stat("/usr/lib/grub/x86_64-efi/linux.mod"); err != nil {
			return nil, errdefs.FailedPrecondition("golden: GRUB's x86_64-efi modules are missing (Debian package grub-efi-amd64-bin)")
		}
		if _, err := os.Stat(gptMBR); err != nil {
			return nil, errdefs.FailedPrecondition("golden: %s is missing (Debian package syslinux-common)", gptMBR)
		}
	}
	var kube *kubeFiles
	if !s.Minimal {
		if kube, err = kubeFrom(o.KubeTools, o.Release); err != nil {
			return nil, err
		}
		// The upgrade recipe the controller applies comes from the
		// kubeadm this image carries, not from a table.
		if kube.addons, err = kubetools.Addons(ctx, kubetools.ExecRunner{}, filepath.Join(o.KubeTools.BinDir(o.Release), kubetools.Kubeadm), s.KubernetesVersion); err != nil {
			return nil, errdefs.FailedPrecondition("golden: addon tags of %s from its kubeadm: %v (rebuild kube-tools: %s)", s.KubernetesVersion, err, kubetools.BuildCommand(o.Release))
		}
	}
	rs := RootfsSpec(s, o.RootfsCacheDir)
	if err := rs.Validate(); err != nil {
		return nil, err
	}
	cached := isDir(rs.Dir())

	what := s.Tag("<date>")
	p := &progress{w: o.Progress, now: o.Now, start: start, steps: estimate(s.Minimal, cached)}
	p.begin(what, cached)
	p.step("check", fmt.Sprintf("spec ok, SOURCE_DATE_EPOCH=%d", epoch))

	if err := os.MkdirAll(o.OutDir, 0o755); err != nil {
		return nil, fmt.Errorf("golden %s: output: %w", what, err)
	}
	work, err := os.MkdirTemp(o.OutDir, ".tmp-"+what+"-")
	if err != nil {
		return nil, fmt.Errorf("golden %s: %w", what, err)
	}
	defer os.RemoveAll(work)

	p.step("rootfs", "debian "+s.Suite+" root "+rs.Dir()+" ("+strconv.Itoa(len(rs.Packages))+" packages)")
	base, err := rootfs.Build(ctx, rs, o.ToolOutput)
	if err != nil {
		return nil, fmt.Errorf("golden %s: rootfs: %w", what, err)
	}
	// The tag carries the date of the OS packages: when the cache entry
	// was built.
	patchLevel, err := patchLevelOf(base)
	if err != nil {
		return nil, fmt.Errorf("golden %s: %w", what, err)
	}
	tag := s.Tag(patchLevel)
	log := o.Log.With("component", "golden", "tag", tag)

	p.step("tree", "agent, units, baked prep"+map[bool]string{true: "", false: ", kubeadm/kubelet/kubectl, image archives"}[s.Minimal])
	agentVersion := versionOf(ctx, agent)
	root := filepath.Join(work, "root")
	if err := rootfs.Overlay(ctx, base, root, files(s, agent, kube, releaseFile(s, tag, epoch, agentVersion))); err != nil {
		return nil, fmt.Errorf("golden %s: tree: %w", tag, err)
	}
	if err := scrub(root, s.Slim); err != nil {
		return nil, fmt.Errorf("golden %s: tree: %w", tag, err)
	}
	pkgs, err := packagesOf(root)
	if err != nil {
		return nil, fmt.Errorf("golden %s: %w", tag, err)
	}

	rootPartUUID := uuidFor(tag, "root-partition")
	var espDir, kernelRelease string
	if s.Kernel != spec.KernelNone {
		p.step("esp", "kernel, initrd and GRUB (x86_64-efi)")
		if espDir, kernelRelease, err = buildESP(ctx, work, root, tag, rootPartUUID, epoch); err != nil {
			return nil, fmt.Errorf("golden %s: esp: %w", tag, err)
		}
	}
	if err := clamp(root, epoch); err != nil {
		return nil, fmt.Errorf("golden %s: timestamps: %w", tag, err)
	}

	raw, zst, mjson, iyaml := FileNames(tag)
	rootSize, err := rootSizeFor(s, root, kube)
	if err != nil {
		return nil, fmt.Errorf("golden %s: disk: %w", tag, err)
	}
	parts := "GPT: ESP + ext4 root "
	if espDir == "" {
		parts = "GPT: ext4 root "
	}
	p.step("disk", parts+disk.TypeRootX8664)
	layout, err := disk.Build(ctx, disk.Spec{
		RootDir: root, ESPDir: espDir, Output: filepath.Join(work, raw), RootSize: rootSize,
		Seed: tag, RootUUID: rootPartUUID, SourceDateEpoch: epoch,
	}, o.ToolOutput)
	if err != nil {
		return nil, fmt.Errorf("golden %s: disk: %w", tag, err)
	}
	var rootPart, espPart disk.Partition
	for _, pt := range layout.Partitions {
		switch pt.Type {
		case disk.TypeRootX8664:
			rootPart = pt
		case disk.TypeESP:
			espPart = pt
		}
	}
	if err := fixInodeTimes(ctx, filepath.Join(work, raw), rootPart.Offset, root, epoch); err != nil {
		return nil, fmt.Errorf("golden %s: disk: %w", tag, err)
	}
	if s.Kernel != spec.KernelNone {
		if err := installBIOSBoot(ctx, work, filepath.Join(work, raw), espPart, rootPartUUID, epoch); err != nil {
			return nil, fmt.Errorf("golden %s: BIOS boot: %w", tag, err)
		}
	}

	p.step("compress", fmt.Sprintf("zstd, %d threads", runtime.GOMAXPROCS(0)))
	sums, err := compress(ctx, filepath.Join(work, raw), filepath.Join(work, zst))
	if err != nil {
		return nil, fmt.Errorf("golden %s: compress: %w", tag, err)
	}

	p.step("blockmap", "sha256 per data range")
	ranges, err := manifest.BlockMap(ctx, filepath.Join(work, raw), manifest.DefaultBlockSize)
	if err != nil {
		return nil, fmt.Errorf("golden %s: %w", tag, err)
	}

	p.step("manifest", mjson+", "+iyaml)
	m := &manifest.Manifest{
		Tag:              tag,
		Format:           manifest.FormatRawZst,
		RawSize:          sums.rawSize,
		RawSHA256:        sums.rawSHA256,
		CompressedSize:   sums.zstSize,
		CompressedSHA256: sums.zstSHA256,
		BlockSize:        manifest.DefaultBlockSize,
		BlockMap:         ranges,
		OSVersion:        s.OSVersion(),
		KernelVersion:    kernelRelease,
		AgentVersion:     agentVersion,
		Packages:         pkgs,
		BuildDate:        time.Unix(epoch, 0).UTC(),
		PatchLevel:       patchLevel,
		SourceDateEpoch:  epoch,
		NonReproducible:  nonReproducible(rs),
	}
	if !s.Minimal {
		m.KubernetesVersion = s.KubernetesVersion
		m.Addons = &kube.addons
	}
	for _, pt := range layout.Partitions {
		m.Partitions = append(m.Partitions, manifest.Partition{Name: pt.Name, Type: pt.Type, UUID: pt.UUID, Offset: uint64(pt.Offset), Size: uint64(pt.Size)})
	}
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("golden %s: %w", tag, err)
	}
	res, err := ImageResource(m, s.PublishURL)
	if err != nil {
		return nil, fmt.Errorf("golden %s: %w", tag, err)
	}
	if err := os.WriteFile(filepath.Join(work, iyaml), res, 0o644); err != nil {
		return nil, fmt.Errorf("golden %s: %w", tag, err)
	}
	if err := manifest.Write(filepath.Join(work, mjson), m); err != nil {
		return nil, fmt.Errorf("golden %s: %w", tag, err)
	}
	// The manifest goes last: a reader that finds it finds the rest. The
	// images are built in place by tools, so they move by rename, not
	// through internal/atomicfile (which wrote the manifest in work).
	for _, name := range []string{raw, zst, iyaml, mjson} {
		if err := os.Rename(filepath.Join(work, name), filepath.Join(o.OutDir, name)); err != nil {
			return nil, fmt.Errorf("golden %s: publish %s: %w", tag, name, err)
		}
	}
	if d, err := os.Open(o.OutDir); err == nil {
		_ = d.Sync()
		d.Close()
	}
	elapsed := o.Now().Sub(start)
	fmt.Fprintf(o.Progress, "built %s in %s: %s (%d MiB raw, %d MiB data, %d MiB zstd)\n", tag, elapsed.Round(time.Second),
		filepath.Join(o.OutDir, zst), m.RawSize>>20, m.DataSize()>>20, m.CompressedSize>>20)
	log.Info("image built", "raw_sha256", m.RawSHA256, "elapsed", elapsed)
	return &Result{
		Tag: tag, Manifest: m, Elapsed: elapsed,
		RawPath: filepath.Join(o.OutDir, raw), ZstPath: filepath.Join(o.OutDir, zst),
		ManifestPath: filepath.Join(o.OutDir, mjson), ImagePath: filepath.Join(o.OutDir, iyaml),
	}, nil
}

// rootSizeFor is the root partition size: the spec's size, or for a
// full image room for the tree plus a third, the image archives twice
// (containerd's content store and their unpacked snapshots on first
// boot) and 1 GiB for kubelet, etcd and logs. A minimal image leaves the
// choice to the disk package (0). The partition is sparse: free space
// costs nothing in the raw file, the block map or the zstd file.
func rootSizeFor(s *spec.Spec, root string, kube *kubeFiles) (int64, error) {
	if n := s.RootSize(); n > 0 || kube == nil {
		return n, nil
	}
	tree, err := treeBytes(root)
	if err != nil {
		return 0, err
	}
	var archives int64
	for _, a := range kube.archives {
		st, err := os.Stat(a.path)
		if err != nil {
			return 0, err
		}
		archives += st.Size()
	}
	const mib = 1 << 20
	n := tree + tree/3 + 2*archives + 1<<30
	return (n + mib - 1) / mib * mib, nil
}

// treeBytes is the space the files under dir take in 4 KiB blocks, plus
// a block per entry. Equivalent to: `du -s --apparent-size` rounded per
// file, plus inodes.
func treeBytes(dir string) (int64, error) {
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
			n += (info.Size() + 4095) / 4096 * 4096
		}
		return nil
	})
	return n, err
}

// kubeFrom takes kubeadm, kubelet, kubectl and the image archives from a
// kube-tools cache that verifies.
func kubeFrom(c kubetools.Cache, r kubetools.Release) (*kubeFiles, error) {
	if _, err := c.Verify(r); err != nil {
		return nil, errdefs.FailedPrecondition("golden: %v (run: %s)", err, kubetools.BuildCommand(r))
	}
	k := &kubeFiles{pause: r.Registry + "/pause:" + r.Pause}
	for _, name := range []string{kubetools.Kubeadm, kubetools.Kubelet, kubetools.Kubectl} {
		k.bins = append(k.bins, named{name, filepath.Join(c.BinDir(r), name)})
	}
	tars, _ := filepath.Glob(filepath.Join(c.ImagesDir(r), "*.tar"))
	if len(tars) < len(kubetools.ImageRefs(r)) {
		return nil, errdefs.FailedPrecondition("golden: kube-tools %s: %d image archives in %s, want %d (run: kiln-imagebuilder archives)",
			r.Kubernetes, len(tars), c.ImagesDir(r), len(kubetools.ImageRefs(r)))
	}
	for _, t := range tars {
		k.archives = append(k.archives, named{filepath.Base(t), t})
	}
	if next, ok := NextMinorAddons(r.Kubernetes); ok {
		if _, err := c.Verify(next); err != nil {
			return nil, errdefs.FailedPrecondition("golden: an image of %s carries %s's kube-proxy and coredns: %v (run: %s)", r.Kubernetes, next.Kubernetes, err, kubetools.BuildCommand(next))
		}
		for _, name := range NextMinorArchives {
			t := filepath.Join(c.ImagesDir(next), name+".tar")
			if _, err := os.Stat(t); err != nil {
				return nil, errdefs.FailedPrecondition("golden: kube-tools %s: %v (run: kiln-imagebuilder archives)", next.Kubernetes, err)
			}
			k.archives = append(k.archives, named{name + "-" + next.Kubernetes + ".tar", t})
		}
	}
	return k, nil
}

func releaseFile(s *spec.Spec, tag string, epoch int64, agentVersion string) string {
	k := s.KubernetesVersion
	if s.Minimal {
		k = "none"
	}
	return fmt.Sprintf("TAG=%s\nOS=%s\nKUBERNETES_VERSION=%s\nAGENT_VERSION=%s\nCGROUP_DRIVER=%s\nSOURCE_DATE_EPOCH=%d\n",
		tag, s.OSVersion(), k, agentVersion, s.CgroupDriver, epoch)
}

// versionOf runs `AGENT version`; "unknown" when it cannot.
func versionOf(ctx context.Context, agent string) string {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, agent, "version").Output()
	if err != nil {
		return "unknown"
	}
	if f := strings.Fields(string(out)); len(f) > 0 {
		return f[len(f)-1]
	}
	return "unknown"
}

// scrub removes build-time logs and caches that differ between builds and
// serve no host, and for a slim image documentation, man pages,
// translations and apt's lists (slimGlobs; copyright files stay).
func scrub(root string, slim bool) error {
	globs := []string{"var/log/*.log", "var/log/apt/*", "var/cache/debconf/*-old", "var/lib/dpkg/*-old",
		"var/cache/apt/archives/*.deb", "var/cache/ldconfig/aux-cache", "run/*", "tmp/*", "var/tmp/*"}
	if slim {
		globs = append(globs, slimGlobs...)
	}
	for _, g := range globs {
		matches, _ := filepath.Glob(filepath.Join(root, g))
		for _, m := range matches {
			if filepath.Base(m) == "copyright" && strings.HasPrefix(g, "usr/share/doc/") {
				continue
			}
			if err := os.RemoveAll(m); err != nil {
				return err
			}
		}
	}
	return nil
}

// packagesOf reads the package list from the root's dpkg status.
func packagesOf(root string) ([]manifest.Package, error) {
	f, err := os.Open(filepath.Join(root, "var/lib/dpkg/status"))
	if err != nil {
		return nil, fmt.Errorf("package list: %w", err)
	}
	defer f.Close()
	return ParseDpkgStatus(f)
}

// patchLevelOf is the patch level of a root: the UTC day (yyyymmdd) dpkg
// last changed its status, when its packages came from the mirror.
func patchLevelOf(root string) (string, error) {
	st, err := os.Stat(filepath.Join(root, "var/lib/dpkg/status"))
	if err != nil {
		return "", fmt.Errorf("patch level: %w", err)
	}
	return st.ModTime().UTC().Format("20060102"), nil
}

func nonReproducible(rs rootfs.Spec) []manifest.NonReproducible {
	return []manifest.NonReproducible{{
		What: "Debian packages (rootfs cache entry " + rs.Key() + ")",
		Reason: "debootstrap and apt-get take the newest packages of the mirror when the rootfs cache entry is built; " +
			"a build from the same cache entry is identical, a new entry built on another day may hold newer package versions " +
			"(the package list and patchLevel record them).",
	}}
}

// uuidFor derives a fixed version-4-shaped UUID from the tag.
func uuidFor(tag, purpose string) string {
	h := sha256.Sum256([]byte("kiln-golden\x00" + tag + "\x00" + purpose))
	h[6] = h[6]&0x0f | 0x40
	h[8] = h[8]&0x3f | 0x80
	return strings.ToUpper(fmt.Sprintf("%x-%x-%x-%x-%x", h[0:4], h[4:6], h[6:8], h[8:10], h[10:16]))
}

// gptMBR is syslinux's boot code for a GPT disk: it boots the partition
// with the LegacyBIOSBootable attribute.
const gptMBR = "/usr/lib/syslinux/mbr/gptmbr.bin"

// installBIOSBoot makes the image boot on BIOS too: syslinux on the ESP
// (the FAT file system holds vmlinuz and initrd.img already), its GPT boot
// code in the protective MBR, and the ESP marked legacy-BIOS-bootable.
// Equivalent to:
//
//	mcopy -m -i RAW@@ESPOFFSET syslinux.cfg ::/syslinux.cfg
//	syslinux --install --offset ESPOFFSET RAW
//	dd if=/usr/lib/syslinux/mbr/gptmbr.bin of=RAW bs=440 count=1 conv=notrunc
//	sfdisk --part-attrs RAW 1 LegacyBIOSBootable
func installBIOSBoot(ctx context.Context, work, raw string, esp disk.Partition, rootPartUUID string, epoch int64) error {
	cfg := filepath.Join(work, "syslinux.cfg")
	if err := os.WriteFile(cfg, []byte(SyslinuxConfig(rootPartUUID)), 0o644); err != nil {
		return err
	}
	if err := clamp(cfg, epoch); err != nil {
		return err
	}
	off := strconv.FormatInt(esp.Offset, 10)
	env := append(os.Environ(), "SOURCE_DATE_EPOCH="+strconv.FormatInt(epoch, 10), "LC_ALL=C")
	for _, args := range [][]string{
		{"mcopy", "-m", "-i", raw + "@@" + off, cfg, "::/syslinux.cfg"},
		{"syslinux", "--install", "--offset", off, raw},
	} {
		cmd := exec.CommandContext(ctx, args[0], args[1:]...)
		cmd.Env = env
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("%s: %w: %s", args[0], err, tail(string(out)))
		}
	}
	mbr, err := os.ReadFile(gptMBR)
	if err != nil {
		return err
	}
	if len(mbr) > 440 {
		mbr = mbr[:440]
	}
	f, err := os.OpenFile(raw, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	if _, err := f.WriteAt(mbr, 0); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "sfdisk", "-q", "--no-reread", "--no-tell-kernel", "--part-attrs", raw, "1", "LegacyBIOSBootable")
	cmd.Env = env
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("sfdisk --part-attrs: %w: %s", err, tail(string(out)))
	}
	return nil
}

// grubModules are built into BOOTX64.EFI.
var grubModules = []string{"memdisk", "tar", "part_gpt", "part_msdos", "fat", "ext2", "linux", "normal", "search",
	"search_fs_file", "serial", "terminal", "echo", "configfile", "boot", "all_video", "gzio"}

// buildESP fills work/esp with the root's kernel and initrd and a GRUB
// EFI binary whose memdisk holds grub.cfg. Equivalent to
// `grub-mkstandalone -O x86_64-efi`, but with a memdisk tar of fixed
// timestamps so the binary is reproducible:
//
//	grub-mkimage -O x86_64-efi -p '(memdisk)/boot/grub' -m memdisk.tar -o EFI/BOOT/BOOTX64.EFI MODULES
func buildESP(ctx context.Context, work, root, tag, rootPartUUID string, epoch int64) (string, string, error) {
	kernels, _ := filepath.Glob(filepath.Join(root, "boot/vmlinuz-*"))
	if len(kernels) != 1 {
		return "", "", errdefs.FailedPrecondition("want one kernel in the root's /boot, found %d (is the kernel package installed?)", len(kernels))
	}
	release := strings.TrimPrefix(filepath.Base(kernels[0]), "vmlinuz-")
	initrd := filepath.Join(root, "boot/initrd.img-"+release)
	if _, err := os.Stat(initrd); err != nil {
		return "", "", errdefs.FailedPrecondition("kernel %s has no initrd in the root (initramfs-tools): %v", release, err)
	}
	esp := filepath.Join(work, "esp")
	if err := os.MkdirAll(filepath.Join(esp, "EFI/BOOT"), 0o755); err != nil {
		return "", "", err
	}
	for src, dst := range map[string]string{kernels[0]: "vmlinuz", initrd: "initrd.img"} {
		if err := copyFile(src, filepath.Join(esp, dst)); err != nil {
			return "", "", err
		}
	}
	if err := os.WriteFile(filepath.Join(esp, "kiln-esp.marker"), []byte(tag+"\n"), 0o644); err != nil {
		return "", "", err
	}
	memdisk := filepath.Join(work, "memdisk.tar")
	if err := writeMemdisk(memdisk, GrubConfig(rootPartUUID), epoch); err != nil {
		return "", "", err
	}
	args := append([]string{"-O", "x86_64-efi", "-p", "(memdisk)/boot/grub", "-m", memdisk,
		"-o", filepath.Join(esp, "EFI/BOOT/BOOTX64.EFI")}, grubModules...)
	if out, err := exec.CommandContext(ctx, "grub-mkimage", args...).CombinedOutput(); err != nil {
		return "", "", fmt.Errorf("grub-mkimage: %w: %s", err, strings.TrimSpace(string(out)))
	}
	return esp, release, clamp(esp, epoch)
}

func writeMemdisk(path, grubCfg string, epoch int64) error {
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	mt := time.Unix(epoch, 0)
	for _, d := range []string{"boot/", "boot/grub/"} {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d, Mode: 0o755, ModTime: mt, Format: tar.FormatUSTAR}); err != nil {
			return err
		}
	}
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "boot/grub/grub.cfg", Mode: 0o644, Size: int64(len(grubCfg)), ModTime: mt, Format: tar.FormatUSTAR}); err != nil {
		return err
	}
	if _, err := tw.Write([]byte(grubCfg)); err != nil {
		return err
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return os.WriteFile(path, b.Bytes(), 0o644)
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// clamp sets the modification time of every entry under dir that is newer
// than epoch to epoch, and every access time to its modification time,
// without following symbolic links. Equivalent to:
// `find DIR -newermt @EPOCH -exec touch -h -d @EPOCH {} +`.
func clamp(dir string, epoch int64) error {
	var paths []string
	err := filepath.WalkDir(dir, func(p string, _ fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		paths = append(paths, p)
		return nil
	})
	if err != nil {
		return err
	}
	// Children before parents: changing a child's times does not change its
	// directory's, but keep the order obvious.
	for i := len(paths) - 1; i >= 0; i-- {
		var st unix.Stat_t
		if err := unix.Lstat(paths[i], &st); err != nil {
			return err
		}
		mt := unix.Timespec{Sec: st.Mtim.Sec, Nsec: st.Mtim.Nsec}
		if mt.Sec > epoch || (mt.Sec == epoch && mt.Nsec > 0) {
			mt = unix.Timespec{Sec: epoch}
		}
		if err := unix.UtimesNanoAt(unix.AT_FDCWD, paths[i], []unix.Timespec{mt, mt}, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("%s: %w", paths[i], err)
		}
	}
	return nil
}

// fixInodeTimes sets the change and access times of every inode that
// `mkfs.ext4 -d` copied from tree to epoch: mkfs copies them from the
// source files, whose ctime is the time they were written. Equivalent to
// one debugfs session of `sif PATH ctime EPOCH; sif PATH atime EPOCH` per
// file:
//
//	debugfs -w -f CMDS 'IMAGE?offset=ROOTOFFSET'
func fixInodeTimes(ctx context.Context, image string, offset int64, tree string, epoch int64) error {
	var cmds bytes.Buffer
	e := strconv.FormatInt(epoch, 10)
	err := filepath.WalkDir(tree, func(p string, _ fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(tree, p)
		in := "/" + filepath.ToSlash(rel)
		if rel == "." {
			in = "/"
		}
		if strings.ContainsAny(in, "\"\n") {
			return errdefs.FailedPrecondition("file name %q cannot be passed to debugfs", in)
		}
		for _, f := range []string{"ctime", "atime", "crtime"} {
			fmt.Fprintf(&cmds, "sif \"%s\" %s %s\n", in, f, e)
		}
		return nil
	})
	if err != nil {
		return err
	}
	cmdFile := image + ".debugfs"
	if err := os.WriteFile(cmdFile, cmds.Bytes(), 0o600); err != nil {
		return err
	}
	defer os.Remove(cmdFile)
	cmd := exec.CommandContext(ctx, "debugfs", "-w", "-f", cmdFile, fmt.Sprintf("%s?offset=%d", image, offset))
	var stderr bytes.Buffer
	cmd.Stdout = io.Discard
	cmd.Stderr = &stderr
	cmd.Env = append(os.Environ(), "E2FSPROGS_FAKE_TIME="+e)
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("debugfs: %w: %s", err, tail(stderr.String()))
	}
	// debugfs reports a failed command on stderr and still exits 0.
	for _, line := range strings.Split(stderr.String(), "\n") {
		if line != "" && !strings.HasPrefix(line, "debugfs ") {
			return fmt.Errorf("debugfs: %s", line)
		}
	}
	return nil
}

func tail(s string) string {
	s = strings.TrimSpace(s)
	if len(s) > 2000 {
		s = s[len(s)-2000:]
	}
	return s
}

type sums struct {
	rawSize, zstSize     uint64
	rawSHA256, zstSHA256 string
}

// compress writes raw as zstd to dst with one encoder goroutine per CPU and
// returns the sha256 and size of both, reading raw once. Equivalent to
// `zstd -T0 RAW -o DST && sha256sum RAW DST`.
func compress(ctx context.Context, raw, dst string) (sums, error) {
	in, err := os.Open(raw)
	if err != nil {
		return sums{}, err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o644)
	if err != nil {
		return sums{}, err
	}
	defer out.Close()
	hr, hz := sha256.New(), sha256.New()
	cz := &countWriter{w: io.MultiWriter(out, hz)}
	enc, err := zstd.NewWriter(cz, zstd.WithEncoderConcurrency(runtime.GOMAXPROCS(0)), zstd.WithEncoderLevel(zstd.SpeedDefault))
	if err != nil {
		return sums{}, err
	}
	n, err := io.Copy(enc, io.TeeReader(&ctxReader{ctx: ctx, r: in}, hr))
	if err != nil {
		enc.Close()
		return sums{}, err
	}
	if err := enc.Close(); err != nil {
		return sums{}, err
	}
	if err := out.Sync(); err != nil {
		return sums{}, err
	}
	return sums{rawSize: uint64(n), zstSize: cz.n, rawSHA256: hex.EncodeToString(hr.Sum(nil)), zstSHA256: hex.EncodeToString(hz.Sum(nil))}, out.Close()
}

type countWriter struct {
	w io.Writer
	n uint64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += uint64(n)
	return n, err
}

type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c *ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

func isDir(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.IsDir()
}
