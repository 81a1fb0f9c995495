// Package host reports what a host is: its OS, kernel, hardware, network
// and Kubernetes binaries (Facts). The operations that change a host live
// in the packages below it (sysctl, kmod, swap, containerd, systemd,
// netcheck, ports); like this one, each works on a root directory ("/" in
// production, a temporary tree or another mount namespace's root in
// tests) and runs commands through a command runner.
package host

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Runner runs a host command and returns its standard output
// (command.Exec in production).
type Runner interface {
	Run(ctx context.Context, name string, args ...string) ([]byte, error)
}

// FactsOptions tune FactsWith.
type FactsOptions struct {
	// Root is the host's filesystem root; "/" in production.
	Root string
	// Runner runs the Kubernetes binaries for their versions; nil means
	// command.Exec.
	Runner Runner
	// VirtualDisks includes loop, ram and zram devices in Disks.
	VirtualDisks bool
}

// Boot sources and agent modes, as reported in Facts.
const (
	BootDisk         = "disk"
	BootPXE          = "pxe"
	BootVirtualMedia = "virtualmedia"

	ModeBoot      = "boot"
	ModeInstalled = "installed"
)

// kubeBinaries are the Kubernetes binaries whose versions Facts reports,
// looked up in these directories under the root.
var (
	kubeBinaries = []string{"kubeadm", "kubelet", "kubectl"}
	kubeDirs     = []string{"usr/bin", "usr/local/bin"}
)

// OSRelease is the part of os-release(5) Facts reports.
type OSRelease struct {
	ID, VersionID, PrettyName string
}

// ParseOSRelease parses the contents of an os-release file.
func ParseOSRelease(data string) OSRelease {
	var r OSRelease
	for line := range strings.Lines(data) {
		k, v, ok := strings.Cut(strings.TrimSpace(line), "=")
		if !ok || strings.HasPrefix(k, "#") {
			continue
		}
		if uq, err := strconv.Unquote(v); err == nil {
			v = uq
		} else {
			v = strings.Trim(v, `'"`)
		}
		switch k {
		case "ID":
			r.ID = v
		case "VERSION_ID":
			r.VersionID = v
		case "PRETTY_NAME":
			r.PrettyName = v
		}
	}
	return r
}

// ParseCPUInfo returns the first model name and the number of logical
// processors in the contents of /proc/cpuinfo.
func ParseCPUInfo(data string) (model string, count uint32) {
	for line := range strings.Lines(data) {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		switch strings.TrimSpace(k) {
		case "processor":
			count++
		case "model name", "Model", "cpu model":
			if model == "" {
				model = strings.TrimSpace(v)
			}
		}
	}
	return model, count
}

// ParseMemTotal returns MemTotal in bytes from the contents of
// /proc/meminfo, or 0.
func ParseMemTotal(data string) uint64 {
	for line := range strings.Lines(data) {
		rest, ok := strings.CutPrefix(line, "MemTotal:")
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			return 0
		}
		n, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			return 0
		}
		if len(f) > 1 && strings.EqualFold(f[1], "kB") {
			n *= 1024
		}
		return n
	}
	return 0
}

// BootSource reads the kernel command line: kiln.boot=pxe or
// kiln.boot=virtualmedia means the host runs the agent from boot media
// (mode "boot"); anything else means it booted from its disk ("installed").
func BootSource(cmdline string) (source, mode string) {
	for _, f := range strings.Fields(cmdline) {
		switch f {
		case "kiln.boot=pxe":
			return BootPXE, ModeBoot
		case "kiln.boot=virtualmedia", "kiln.boot=cdrom":
			return BootVirtualMedia, ModeBoot
		}
	}
	return BootDisk, ModeInstalled
}

// Disks lists the block devices in sysDir (normally ROOT/sys/block).
// Loop, ram and zram devices are left out unless virtual is true.
func Disks(sysDir string, virtual bool) ([]*typesv1.Disk, error) {
	entries, err := os.ReadDir(sysDir)
	if err != nil {
		return nil, err
	}
	var disks []*typesv1.Disk
	for _, e := range entries {
		name := e.Name()
		if !virtual && (strings.HasPrefix(name, "loop") || strings.HasPrefix(name, "ram") || strings.HasPrefix(name, "zram")) {
			continue
		}
		dir := filepath.Join(sysDir, name)
		sectors, _ := strconv.ParseUint(readTrim(filepath.Join(dir, "size")), 10, 64)
		d := &typesv1.Disk{
			Name:       name,
			Path:       "/dev/" + name,
			SizeBytes:  sectors * 512, // sysfs counts 512-byte sectors whatever the block size
			Rotational: readTrim(filepath.Join(dir, "queue/rotational")) == "1",
			Removable:  readTrim(filepath.Join(dir, "removable")) == "1",
			Model:      readTrim(filepath.Join(dir, "device/model")),
			Serial:     firstNonEmpty(readTrim(filepath.Join(dir, "device/serial")), readTrim(filepath.Join(dir, "serial"))),
			Wwn:        wwn(firstNonEmpty(readTrim(filepath.Join(dir, "device/wwid")), readTrim(filepath.Join(dir, "wwid")))),
		}
		disks = append(disks, d)
	}
	slices.SortFunc(disks, func(a, b *typesv1.Disk) int { return strings.Compare(a.Name, b.Name) })
	return disks, nil
}

// wwn spells a sysfs wwid as udev's ID_WWN does: an NAA identifier
// ("naa.5000c500a0b1c2d3") as 0x5000c500a0b1c2d3; others (eui.…, t10.…)
// as they are.
func wwn(wwid string) string {
	if v, ok := strings.CutPrefix(wwid, "naa."); ok {
		return "0x" + strings.ToLower(v)
	}
	return wwid
}

// DiskLinks adds to disks the udev links under devDiskDir (normally
// ROOT/dev/disk) that name a whole disk: by-path and by-id, as full /dev
// paths, sorted. A by-id wwn- link gives the disk's WWN in udev's
// spelling. Links to partitions, and a missing directory (no udev), add
// nothing.
func DiskLinks(devDiskDir string, disks []*typesv1.Disk) {
	byName := map[string]*typesv1.Disk{}
	for _, d := range disks {
		byName[d.GetName()] = d
	}
	for _, kind := range []string{"by-path", "by-id"} {
		dir := filepath.Join(devDiskDir, kind)
		entries, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, e := range entries {
			dest, err := os.Readlink(filepath.Join(dir, e.Name()))
			if err != nil {
				continue
			}
			d := byName[filepath.Base(dest)]
			if d == nil {
				continue
			}
			link := "/dev/disk/" + kind + "/" + e.Name()
			if kind == "by-path" {
				d.ByPath = append(d.ByPath, link)
				continue
			}
			d.ById = append(d.ById, link)
			if w, ok := strings.CutPrefix(e.Name(), "wwn-"); ok {
				d.Wwn = w
			}
		}
	}
	for _, d := range disks {
		slices.Sort(d.ByPath)
		slices.Sort(d.ById)
	}
}

// KubeVersion extracts a Kubernetes version ("v1.34.4") from a binary's
// version output, or "".
func KubeVersion(out string) string {
	for _, f := range strings.FieldsFunc(out, func(r rune) bool {
		return r == ' ' || r == '\n' || r == '\t' || r == '"' || r == ',' || r == ':'
	}) {
		if len(f) > 1 && f[0] == 'v' && f[1] >= '0' && f[1] <= '9' && strings.Count(f, ".") >= 2 {
			return f
		}
	}
	return ""
}

// FindKubeBinary returns the path of a Kubernetes binary under root, or ""
// when it is not installed.
func FindKubeBinary(root, name string) string {
	for _, dir := range kubeDirs {
		p := filepath.Join(root, dir, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p
		}
	}
	return ""
}

// kubeVersionArgs are the arguments that make each binary print its
// version without contacting a cluster.
func kubeVersionArgs(name string) []string {
	switch name {
	case "kubeadm":
		return []string{"version", "-o", "short"}
	case "kubectl":
		return []string{"version", "--client"}
	default:
		return []string{"--version"}
	}
}

func readTrim(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

func firstNonEmpty(s ...string) string {
	for _, v := range s {
		if v != "" {
			return v
		}
	}
	return ""
}

// readOptional reads a file, treating a missing file as empty.
func readOptional(path string) (string, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	return string(b), err
}
