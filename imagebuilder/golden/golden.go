// Package golden builds Kiln's golden images: the pipeline behind
// `kiln-imagebuilder build -f image.yaml -o DIR`. From an image spec it
// takes a cached Debian root (imagebuilder/rootfs) with the node packages,
// adds kubeadm, kubelet and kubectl from the kube-tools cache with their
// units, the offline control-plane image archives and a oneshot unit that
// imports them into containerd on first boot, the kiln-agent and its unit,
// and the baked host preparation (modules, sysctls, no swap, containerd's
// cgroup driver); then lays it out as a GPT raw disk with an EFI system
// partition (imagebuilder/disk), compresses it with zstd and writes the
// manifest (imagebuilder/manifest) and an Image resource for kilnctl apply.
//
// Every timestamp is clamped to SOURCE_DATE_EPOCH and every identifier is
// derived from the tag, so the same spec, epoch and rootfs cache give the
// same bytes; what cannot be made identical is listed in the manifest's
// nonReproducible entries.
//
// Outputs are built under DIR/.tmp-<tag>-*/ and renamed into DIR at the
// end, the manifest last: a failed or interrupted build leaves nothing
// under a final name.
package golden

import (
	"bufio"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/imagebuilder/manifest"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/imagebuilder/spec"
	resources "github.com/kilnhq/kiln/internal/manifest"
	"github.com/kilnhq/kiln/internal/units"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// NodePackages are the Debian packages of a Kubernetes node (besides the
// rootfs base: systemd, systemd-sysv, dbus, iproute2).
var NodePackages = []string{"containerd", "runc", "containernetworking-plugins", "iptables", "conntrack",
	"socat", "ethtool", "kmod", "procps"}

// Paths inside the image.
const (
	AgentPath      = units.AgentExec
	AgentDataDir   = units.AgentDataDir
	AgentListen    = units.AgentListen
	ImagesDir      = "/var/lib/kiln/images"
	ImportUnit     = "kiln-import-images.service"
	AgentUnit      = units.AgentName
	CgroupRWUnit   = "cgroup-rw.service"
	ModulesFile    = "/etc/modules-load.d/kiln.conf"
	SysctlFile     = "/etc/sysctl.d/99-kiln.conf"
	ContainerdConf = "/etc/containerd/config.toml"
	// ReleaseFile records what the image is (tag, versions) inside it.
	ReleaseFile = "/etc/kiln-release"
)

// DefaultModules and DefaultSysctls are the preparation Kubernetes needs.
var (
	DefaultModules = []string{"br_netfilter", "overlay"}
	DefaultSysctls = [][2]string{
		{"net.ipv4.ip_forward", "1"},
		{"net.bridge.bridge-nf-call-iptables", "1"},
		{"net.bridge.bridge-nf-call-ip6tables", "1"},
	}
)

// Options configure a build.
type Options struct {
	// Spec is the parsed image spec; required.
	Spec *spec.Spec
	// OutDir receives <tag>.raw, <tag>.raw.zst, <tag>.json (the manifest)
	// and <tag>.image.yaml; created when missing.
	OutDir string
	// KubeTools is the kube-tools cache (default
	// ${KILN_CACHE:-/var/cache/kiln}/kube-tools) and Release the release
	// to install (default the one of Spec.KubernetesVersion,
	// kubetools.ReleaseFor; kubetools.Pinned() when it has no recipe).
	KubeTools kubetools.Cache
	Release   kubetools.Release
	// RootfsCacheDir is the rootfs cache (default rootfs's).
	RootfsCacheDir string
	// Progress receives one line per step; nil discards.
	Progress io.Writer
	// ToolOutput receives the output of debootstrap, apt-get and the disk
	// tools; nil discards (a failure still carries the tail).
	ToolOutput io.Writer
	// Log is the logger (default discards).
	Log *slog.Logger
	// Getenv reads SOURCE_DATE_EPOCH (default os.Getenv); Now is the
	// clock (default time.Now).
	Getenv func(string) string
	Now    func() time.Time
}

// Result is a finished build.
type Result struct {
	Tag          string
	RawPath      string
	ZstPath      string
	ManifestPath string
	ImagePath    string
	Manifest     *manifest.Manifest
	Elapsed      time.Duration
}

// FileNames returns the output file names of a tag: raw, compressed,
// manifest and Image resource.
func FileNames(tag string) (raw, zst, manifestJSON, imageYAML string) {
	return tag + ".raw", tag + ".raw.zst", tag + ".json", tag + ".image.yaml"
}

// Packages returns the packages installed with apt-get into the root of
// s: the node packages and the kernel unless minimal, then the spec's own,
// sorted and without duplicates (the rootfs cache key is stable).
func Packages(s *spec.Spec) []string {
	var p []string
	if !s.Minimal {
		p = append(p, NodePackages...)
	}
	if s.Kernel != spec.KernelNone {
		p = append(p, s.Kernel, "initramfs-tools")
	}
	p = append(p, s.Packages...)
	slices.Sort(p)
	return slices.Compact(p)
}

// RootfsSpec is the rootfs cache entry a spec uses.
func RootfsSpec(s *spec.Spec, cacheDir string) rootfs.Spec {
	return rootfs.Spec{Suite: s.Suite, Mirror: s.Mirror, Packages: Packages(s), CacheDir: cacheDir}
}

// AgentUnitFile is kiln-agent.service in installed mode: it serves the
// agent API with the identity the controller wrote into the laid image
// (until then it waits, restarting every 5 s). It is the unit of the
// kiln-agent package and of `kiln-agent enroll --install-unit`
// (internal/units).
func AgentUnitFile() string {
	return string(units.AgentUnit(units.Agent{Exec: AgentPath, DataDir: AgentDataDir, Listen: AgentListen}))
}

// ImportUnitFile imports the offline image archives into containerd's
// k8s.io namespace with ImportScript, before kubelet starts, until the
// marker ImportMarker exists. A failed import (containerd not answering
// yet, restarted by the agent's Prepare, a corrupt archive, a timeout)
// is retried for ever: Restart=on-failure with no start limit, and the
// script waits longer before each retry of the same boot. Wants= rather
// than Requires= containerd: a containerd that fails to start, or is
// restarted, makes the import fail and retry instead of leaving the unit
// inactive for good. Equivalent to:
// `for f in /var/lib/kiln/images/*.tar; do ctr -n k8s.io images import $f; done`.
func ImportUnitFile() string {
	return `[Unit]
Description=Import Kiln's offline Kubernetes images into containerd
Documentation=file://` + ImportScriptPath + `
Wants=containerd.service
After=containerd.service
Before=kubelet.service
ConditionPathExists=!` + ImportMarker + `
StartLimitIntervalSec=0

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=` + ImportScriptPath + `
Restart=on-failure
RestartSec=5s
TimeoutStartSec=infinity

[Install]
WantedBy=multi-user.target
`
}

// The first-boot import's files: the script the unit runs, the marker it
// writes when every archive is in containerd (agent/preflight's
// offline-images check passes on it), its log (progress and the last
// error, which that check quotes while the marker is missing) and its
// attempt counter of the current boot (under /run, so a reboot starts
// without waiting).
const (
	ImportScriptPath = "/usr/lib/kiln/import-images"
	ImportMarker     = ImagesDir + "/.imported"
	ImportLog        = ImagesDir + "/.import.log"
	ImportAttempts   = "/run/kiln/import-images.attempts"
)

// ImportScript is ImportScriptPath. Every path is under $KILN_ROOT (unset:
// "/"); KILN_IMPORT_BACKOFF is the first retry's wait in seconds (default
// 10, doubled at each retry up to 300) and KILN_IMPORT_TIMEOUT bounds one
// archive's import (default 20m, timeout(1) syntax).
func ImportScript() string {
	return `#!/bin/sh
# kiln-import-images: imports a Kiln golden image's offline Kubernetes
# image archives into containerd (namespace k8s.io), then writes the
# marker kiln-agent's preflight check offline-images waits for. Progress
# and errors go to stdout (the journal) and to the log that check quotes.
# kiln-import-images.service runs it and restarts it when it fails; each
# retry of the same boot waits longer.
set -u
root=${KILN_ROOT:-}
dir=$root` + ImagesDir + `
log=$root` + ImportLog + `
attempts=$root` + ImportAttempts + `
backoff=${KILN_IMPORT_BACKOFF:-10}
limit=${KILN_IMPORT_TIMEOUT:-20m}

say() {
	echo "$*"
	echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) $*" >>"$log"
}

mkdir -p "${attempts%/*}"
n=$(cat "$attempts" 2>/dev/null || echo 0)
n=$((n + 1))
echo "$n" >"$attempts"
if [ "$n" -gt 1 ]; then
	delay=$backoff
	i=2
	while [ "$i" -lt "$n" ] && [ "$delay" -lt 300 ]; do
		delay=$((delay * 2))
		i=$((i + 1))
	done
	[ "$delay" -gt 300 ] && delay=300
	say "attempt $n: retrying in ${delay}s"
	sleep "$delay"
fi

set -- "$dir"/*.tar
if [ ! -e "$1" ]; then
	say "no image archives in $dir"
	touch "$dir/.imported"
	rm -f "$attempts"
	exit 0
fi
total=$#
i=0
say "attempt $n: importing $total archives"
for f in "$@"; do
	i=$((i + 1))
	name=${f##*/}
	say "importing $i/$total $name"
	out=$(timeout "$limit" ctr -n k8s.io images import "$f" 2>&1)
	rc=$?
	if [ "$rc" -ne 0 ]; then
		[ -n "$out" ] && printf '%s\n' "$out" | tail -n 5 | while IFS= read -r line; do say "  $line"; done
		if [ "$rc" -eq 124 ]; then
			say "failed: importing $name did not finish within $limit"
		else
			say "failed: importing $name: ctr exited $rc"
		fi
		exit 1
	fi
	[ -n "$out" ] && echo "$out"
done
touch "$dir/.imported"
say "imported $total archives"
rm -f "$attempts"
`
}

// KubeletUnitFile and KubeadmDropIn are the units the upstream kubelet
// package ships.
const KubeletUnitFile = `[Unit]
Description=kubelet: The Kubernetes Node Agent
Documentation=https://kubernetes.io/docs/
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/usr/bin/kubelet
Restart=always
StartLimitInterval=0
RestartSec=10

[Install]
WantedBy=multi-user.target
`

const KubeadmDropIn = `# Note: This dropin only works with kubeadm and kubelet v1.11+
[Service]
Environment="KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf --kubeconfig=/etc/kubernetes/kubelet.conf"
Environment="KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml"
# This is a file that "kubeadm init" and "kubeadm join" generates at runtime, populating the KUBELET_KUBEADM_ARGS variable dynamically
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
# This is a file that the user can use for overrides of the kubelet args as a last resort. Preferably, the user should use
# the .NodeRegistration.KubeletExtraArgs object in the configuration files instead. KUBELET_EXTRA_ARGS should be sourced from this file.
EnvironmentFile=-/etc/default/kubelet
ExecStart=
ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS
`

// CgroupRWUnitFile remounts v1 cgroup hierarchies read-write when they
// are read-only (systemd-nspawn on a cgroup v1 lab machine); elsewhere
// (cgroup v2, or writable v1 hierarchies) its conditions skip it.
const CgroupRWUnitFile = `[Unit]
Description=Remount v1 cgroup controller hierarchies read-write (nspawn mounts them ro)
DefaultDependencies=no
After=local-fs.target
Before=containerd.service kubelet.service sysinit.target
ConditionPathIsMountPoint=/sys/fs/cgroup/memory
ConditionPathIsReadWrite=!/sys/fs/cgroup/memory

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -c 'for d in /sys/fs/cgroup/*/; do mount -o remount,rw "$d" 2>/dev/null || mount -o remount,bind,rw "$d"; done'

[Install]
WantedBy=sysinit.target
`

// ContainerdConfig is containerd's config with SystemdCgroup matching the
// kubelet's cgroup driver, the pause image kubeadm expects and Debian's
// CNI plugin directory. restrict_oom_score_adj keeps containerd working
// where it lacks CAP_SYS_RESOURCE (lab hosts).
func ContainerdConfig(cgroupDriver, pauseImage string) string {
	return fmt.Sprintf(`version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = %t
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/etc/cni/net.d"
`, pauseImage, cgroupDriver == spec.CgroupDriverSystemd)
}

// ModulesLoad is /etc/modules-load.d/kiln.conf.
func ModulesLoad(s *spec.Spec) string {
	var b strings.Builder
	b.WriteString("# Written by kiln-imagebuilder: modules Kubernetes needs, loaded at boot.\n")
	seen := map[string]bool{}
	for _, m := range append(slices.Clone(DefaultModules), s.Modules...) {
		if !seen[m] {
			seen[m] = true
			b.WriteString(m + "\n")
		}
	}
	return b.String()
}

// Sysctls is /etc/sysctl.d/99-kiln.conf; the spec's values win over the
// defaults.
func Sysctls(s *spec.Spec) string {
	var b strings.Builder
	b.WriteString("# Written by kiln-imagebuilder: kernel settings Kubernetes needs.\n")
	for _, kv := range DefaultSysctls {
		if _, ok := s.Sysctls[kv[0]]; !ok {
			fmt.Fprintf(&b, "%s = %s\n", kv[0], kv[1])
		}
	}
	for _, k := range slices.Sorted(maps.Keys(s.Sysctls)) {
		fmt.Fprintf(&b, "%s = %s\n", k, s.Sysctls[k])
	}
	return b.String()
}

// Fstab has no swap: the root is found by its discoverable partition type
// (or root=PARTUUID= on the kernel command line) and the ESP is not
// mounted.
const Fstab = "# Written by kiln-imagebuilder. The root partition is found by its type\n" +
	"# (discoverable partitions) or root=PARTUUID= on the kernel command line.\n" +
	"# No swap: kubelet requires it off.\n"

// DHCPNetworkFile configures, in an image with a kernel, every wired
// NIC by DHCP (systemd-networkd, enabled in such images). Its name sorts
// after personalize.NetworkFile (10-kiln.network), so a host's own
// network configuration written at provisioning wins.
const DHCPNetworkFile = "/etc/systemd/network/90-kiln-dhcp.network"

// DHCPNetwork is DHCPNetworkFile: DHCPv4 on the NICs the kernel names
// (predictable en* names, or eth* with net.ifnames=0); bridges and veths
// that containerd's CNI makes (cni0, veth*) do not match.
const DHCPNetwork = "# Written by kiln-imagebuilder: DHCP on every wired NIC of a booted machine.\n" +
	"# A host's own configuration (10-kiln.network, written at provisioning) wins.\n" +
	"[Match]\nName=en* eth*\n\n[Network]\nDHCP=ipv4\n"

// files is what the build adds to the cached root: the agent, units,
// baked preparation and, for a full image, the Kubernetes tools.
func files(s *spec.Spec, agent string, kube *kubeFiles, release string) []rootfs.File {
	wants := func(target, unit, path string) rootfs.File {
		return rootfs.File{Path: "/etc/systemd/system/" + target + ".wants/" + unit, Symlink: path}
	}
	fs := []rootfs.File{
		{Path: AgentPath, Mode: 0o755, Source: agent},
		{Path: "/etc/systemd/system/" + AgentUnit, Data: []byte(AgentUnitFile())},
		wants("multi-user.target", AgentUnit, "/etc/systemd/system/"+AgentUnit),
		{Path: ModulesFile, Data: []byte(ModulesLoad(s))},
		{Path: SysctlFile, Data: []byte(Sysctls(s))},
		{Path: "/etc/fstab", Data: []byte(Fstab)},
		{Path: "/etc/machine-id", Mode: 0o444},
		{Path: ReleaseFile, Data: []byte(release)},
	}
	if s.Kernel != spec.KernelNone {
		// An image with a kernel boots a machine (metal, a VM) whose NIC
		// nothing else configures: DHCP on it with systemd-networkd.
		// Without it the installed agent never reaches the controller.
		fs = append(fs,
			rootfs.File{Path: DHCPNetworkFile, Data: []byte(DHCPNetwork)},
			wants("multi-user.target", "systemd-networkd.service", "/lib/systemd/system/systemd-networkd.service"),
			wants("sockets.target", "systemd-networkd.socket", "/lib/systemd/system/systemd-networkd.socket"))
	}
	if *s.LabCgroupRemount {
		fs = append(fs,
			rootfs.File{Path: "/etc/systemd/system/" + CgroupRWUnit, Data: []byte(CgroupRWUnitFile)},
			wants("sysinit.target", CgroupRWUnit, "/etc/systemd/system/"+CgroupRWUnit))
	}
	if kube == nil {
		return fs
	}
	fs = append(fs, labFiles(s)...)
	for _, b := range kube.bins {
		fs = append(fs, rootfs.File{Path: "/usr/bin/" + b.name, Mode: 0o755, Source: b.path})
	}
	fs = append(fs,
		rootfs.File{Path: "/lib/systemd/system/kubelet.service", Data: []byte(KubeletUnitFile)},
		rootfs.File{Path: "/etc/systemd/system/kubelet.service.d/10-kubeadm.conf", Data: []byte(KubeadmDropIn)},
		wants("multi-user.target", "kubelet.service", "/lib/systemd/system/kubelet.service"),
		rootfs.File{Path: ContainerdConf, Data: []byte(ContainerdConfig(s.CgroupDriver, kube.pause))},
		rootfs.File{Path: "/etc/systemd/system/" + ImportUnit, Data: []byte(ImportUnitFile())},
		rootfs.File{Path: ImportScriptPath, Mode: 0o755, Data: []byte(ImportScript())},
		wants("multi-user.target", ImportUnit, "/etc/systemd/system/"+ImportUnit),
	)
	if next, ok := NextMinorAddons(s.KubernetesVersion); ok {
		fs = append(fs, rootfs.File{Path: ImagesDir + "/NEXT-MINOR", Data: []byte(
			"kube-proxy and coredns of " + next.Kubernetes + ": a node of this image runs the addons of a cluster being upgraded to the next minor\n")})
	}
	for _, a := range kube.archives {
		fs = append(fs, rootfs.File{Path: ImagesDir + "/" + a.name, Source: a.path})
	}
	return fs
}

// NextMinorAddons says whether an image of kubernetesVersion carries, besides
// its own image archives, the kube-proxy and CoreDNS archives of the next
// minor's release recipe (kubetools.Previous carries kubetools.Pinned's),
// and that release. During a minor upgrade by reimaging the controller moves
// the kube-proxy DaemonSet and the CoreDNS Deployment to the new minor as
// soon as the first new control-plane member is Ready (docs/clusters.md,
// Upgrades), while nodes of the old image still run: offline, they can only
// run those images if they carry them.
func NextMinorAddons(kubernetesVersion string) (kubetools.Release, bool) {
	if kubernetesVersion != "" && kubernetesVersion == kubetools.Previous().Kubernetes {
		return kubetools.Pinned(), true
	}
	return kubetools.Release{}, false
}

// NextMinorArchives are the base names of the next minor's archives an
// image of NextMinorAddons carries.
var NextMinorArchives = []string{kubetools.KubeProxy, kubetools.CoreDNS}

// kubeFiles are the pieces of a full image taken from the kube-tools cache.
type kubeFiles struct {
	bins     []named
	archives []named
	pause    string
	// addons are the tags the packed kubeadm pins (kubetools.Addons).
	addons manifest.Addons
}

type named struct{ name, path string }

// ParseDpkgStatus lists the installed packages of a dpkg status file,
// sorted by name. Equivalent to:
// `dpkg-query --admindir=ROOT/var/lib/dpkg -W -f '${Package} ${Version}\n'`
// restricted to packages in state "install ok installed".
func ParseDpkgStatus(r io.Reader) ([]manifest.Package, error) {
	var out []manifest.Package
	var name, version, status string
	flush := func() {
		if name != "" && status == "install ok installed" {
			out = append(out, manifest.Package{Name: name, Version: version})
		}
		name, version, status = "", "", ""
	}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			flush()
		case strings.HasPrefix(line, "Package: "):
			name = strings.TrimSpace(strings.TrimPrefix(line, "Package: "))
		case strings.HasPrefix(line, "Version: "):
			version = strings.TrimSpace(strings.TrimPrefix(line, "Version: "))
		case strings.HasPrefix(line, "Status: "):
			status = strings.TrimSpace(strings.TrimPrefix(line, "Status: "))
		}
	}
	flush()
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("dpkg status: %w", err)
	}
	slices.SortFunc(out, func(a, b manifest.Package) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// ImageResource renders the Image resource (kind Image, apiVersion
// kiln.dev/v1) that `kilnctl apply -f` accepts for a built image served
// under publishURL.
func ImageResource(m *manifest.Manifest, publishURL string) ([]byte, error) {
	base := publishURL
	if !strings.HasSuffix(base, "/") {
		base += "/"
	}
	_, zst, mj, _ := FileNames(m.Tag)
	labels := map[string]string{"os": m.OSVersion}
	if m.KubernetesVersion != "" {
		labels["kubernetes"] = m.KubernetesVersion
	}
	img := &typesv1.Image{
		ApiVersion: "kiln.dev/v1",
		Kind:       "Image",
		Metadata:   &typesv1.ObjectMeta{Name: m.Tag, Labels: labels},
		Spec: &typesv1.ImageSpec{
			Url:               base + zst,
			Sha256:            m.CompressedSHA256,
			Size:              m.CompressedSize,
			Format:            manifest.FormatRawZst,
			KubernetesVersion: m.KubernetesVersion,
			Os:                m.OSVersion,
			PatchLevel:        m.PatchLevel,
			Kernel:            m.KernelVersion,
			BuildDate:         m.BuildDate.UTC().Format("2006-01-02"),
			ManifestUrl:       base + mj,
			RawSha256:         m.RawSHA256,
			RawSize:           m.RawSize,
		},
	}
	if a := m.Addons; a != nil {
		img.Spec.Addons = &typesv1.ImageAddons{KubeProxy: a.KubeProxy, Coredns: a.CoreDNS, Etcd: a.Etcd, Pause: a.Pause}
	}
	y, err := resources.MarshalMessage(img)
	if err != nil {
		return nil, fmt.Errorf("image resource: %w", err)
	}
	head := fmt.Sprintf("# Built by kiln-imagebuilder; serve %s and %s under %s, then: kilnctl apply -f %s.image.yaml\n", zst, mj, base, m.Tag)
	return append([]byte(head), y...), nil
}

// KernelCmdline is the command line of a disk boot: the root partition by
// its PARTUUID, the VGA and serial consoles, reboot 10 s after a panic.
func KernelCmdline(rootPartUUID string) string {
	return "root=PARTUUID=" + strings.ToLower(rootPartUUID) + " rw console=tty0 console=ttyS0,115200 panic=10"
}

// GrubConfig boots the kernel and initrd on the ESP (UEFI).
func GrubConfig(rootPartUUID string) string {
	return `serial --unit=0 --speed=115200
terminal_input serial console
terminal_output serial console
set timeout=0
search --no-floppy --file --set=root /kiln-esp.marker
linux /vmlinuz ` + KernelCmdline(rootPartUUID) + `
initrd /initrd.img
boot
`
}

// SyslinuxConfig boots the kernel and initrd on the ESP (BIOS).
func SyslinuxConfig(rootPartUUID string) string {
	return `SERIAL 0 115200
DEFAULT kiln
PROMPT 0
TIMEOUT 0
LABEL kiln
  LINUX /vmlinuz
  INITRD /initrd.img
  APPEND ` + KernelCmdline(rootPartUUID) + `
`
}

// estimate is the expected duration of each step, measured on the
// project's 2-core machines (docs/imagebuilder.md).
func estimate(minimal, rootfsCached bool) []step {
	sec := func(n int) time.Duration { return time.Duration(n) * time.Second }
	pick := func(small, big int) time.Duration {
		if minimal {
			return sec(small)
		}
		return sec(big)
	}
	rootfsEst := sec(1)
	if !rootfsCached {
		rootfsEst = pick(75, 270)
	}
	steps := []step{
		{"check", pick(1, 3)},
		{"rootfs", rootfsEst},
		{"tree", pick(8, 25)},
	}
	if !minimal {
		steps = append(steps, step{"esp", sec(1)})
	}
	return append(steps,
		step{"disk", pick(4, 15)},
		step{"compress", pick(4, 25)},
		step{"blockmap", pick(1, 5)},
		step{"manifest", sec(1)},
	)
}

type step struct {
	name string
	est  time.Duration
}

// progress prints "[n/N] step ... (elapsed, estimate)" lines.
type progress struct {
	w     io.Writer
	now   func() time.Time
	start time.Time
	steps []step
	n     int
}

func (p *progress) begin(what string, cached bool) {
	var total time.Duration
	for _, s := range p.steps {
		total += s.est
	}
	c := "cold rootfs cache"
	if cached {
		c = "rootfs cached"
	}
	fmt.Fprintf(p.w, "building %s: %d steps, estimate %s (%s)\n", what, len(p.steps), total.Round(time.Second), c)
}

func (p *progress) step(name, detail string) {
	p.n++
	est := ""
	for _, s := range p.steps {
		if s.name == name {
			est = fmt.Sprintf(", ~%s", s.est)
		}
	}
	fmt.Fprintf(p.w, "[%d/%d] %-8s %s (elapsed %s%s)\n", p.n, len(p.steps), name, detail,
		p.now().Sub(p.start).Round(100*time.Millisecond), est)
}
