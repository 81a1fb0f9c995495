// Package spec is the image.yaml that `kiln-imagebuilder build` reads: what
// goes into a golden image (Debian suite and mirror, extra packages, the
// pinned Kubernetes version, the agent binary, the kernel for the EFI system
// partition, the baked host preparation) and how it is stamped (the
// SOURCE_DATE_EPOCH that makes builds reproducible, the tag date). Parse is
// strict: an unknown or mistyped field is an error naming its line, and
// Validate names the line of every bad value.
package spec

import (
	"bytes"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// Defaults and fixed values.
const (
	OSDebian             = "debian"
	DefaultSuite         = rootfs.DefaultSuite
	DefaultMirror        = rootfs.DefaultMirror
	DefaultKernel        = "linux-image-amd64"
	KernelNone           = "none"
	CgroupDriverSystemd  = "systemd"
	CgroupDriverCgroupfs = "cgroupfs"
	// DefaultPublishURL is where the Image resource says the image is
	// served when the spec names no publishURL.
	DefaultPublishURL = "http://127.0.0.1:8080/images/"
)

// Suites maps the supported Debian suites to their major version, which
// the tag carries (debian12-...).
var Suites = map[string]string{"bookworm": "12", "trixie": "13"}

// Spec is one image.yaml.
type Spec struct {
	// OS is the distribution; only "debian".
	OS string `yaml:"os"`
	// Suite is the Debian release (default bookworm).
	Suite string `yaml:"suite"`
	// Mirror is the Debian package mirror (default deb.debian.org).
	Mirror string `yaml:"mirror"`
	// Packages are Debian packages installed besides the ones a node needs.
	Packages []string `yaml:"packages"`
	// Minimal builds a small root (minbase, systemd, dbus and the agent)
	// without containerd, Kubernetes or a kernel: for tests and the lab.
	Minimal bool `yaml:"minimal"`
	// KubernetesVersion must be the version of the kube-tools cache
	// (kiln-imagebuilder kube-tools); required unless Minimal.
	KubernetesVersion string `yaml:"kubernetesVersion"`
	// Agent is the path of the kiln-agent binary to install (relative
	// paths are relative to the spec file).
	Agent string `yaml:"agent"`
	// Kernel is the Debian kernel package installed in the root whose
	// vmlinuz and initrd go to the EFI system partition, or "none"
	// (default linux-image-amd64; none when Minimal).
	Kernel string `yaml:"kernel"`
	// Size is the root partition size ("4GiB", "1536MiB", bytes); empty
	// sizes it from the tree.
	Size string `yaml:"size"`
	// CgroupDriver is the kubelet's and containerd's cgroup driver:
	// systemd (default, kubeadm's default) or cgroupfs.
	CgroupDriver string `yaml:"cgroupDriver"`
	// Sysctls are baked into /etc/sysctl.d/99-kiln.conf after the ones
	// Kubernetes needs (ip_forward, bridge-nf-call-ip(6)tables).
	Sysctls map[string]string `yaml:"sysctls"`
	// Modules are baked into /etc/modules-load.d/kiln.conf after
	// br_netfilter and overlay.
	Modules []string `yaml:"modules"`
	// SourceDateEpoch (Unix seconds) clamps every timestamp of the image;
	// the SOURCE_DATE_EPOCH environment variable overrides it. Zero means
	// the start of the build.
	SourceDateEpoch int64 `yaml:"sourceDateEpoch"`
	// TagDate is the yyyymmdd of the tag; default the date of the OS
	// packages (the patch level: when the rootfs cache entry was built).
	TagDate string `yaml:"tagDate"`
	// PublishURL is the base URL the Image resource points at (the image
	// file is <PublishURL><tag>.raw.zst).
	PublishURL string `yaml:"publishURL"`
	// LabCgroupRemount adds cgroup-rw.service, which remounts read-only
	// v1 cgroup hierarchies read-write before containerd (needed under
	// systemd-nspawn in the lab; a no-op elsewhere). Default true.
	LabCgroupRemount *bool `yaml:"labCgroupRemount"`
	// LabSysctlBinds adds kiln-lab-sysctl.service, which bind-mounts the
	// values the kubelet insists on (vm.overcommit_memory=1,
	// kernel.panic=10, kernel.panic_on_oops=1) over /proc/sys inside a
	// container host: they are not namespaced, so a lab node must not
	// (and cannot) write the machine's. Skipped outside a container.
	// Not for a minimal image. Default false.
	LabSysctlBinds bool `yaml:"labSysctlBinds"`
	// LabNetwork adds kiln-lab-net.service for lab hosts without a CNI
	// add-on: the host's name in /etc/hosts, a bridge CNI config for the
	// node's pod CIDR, routes to the other nodes' pod CIDRs (host-gw) and,
	// on control planes, CoreDNS without upstream forwarding (the lab
	// may not reach outside). Not for a minimal image. Default false.
	LabNetwork bool `yaml:"labNetwork"`
	// LabKubeletPatch adds a kubeadm patch of the kubelet configuration
	// for lab hosts, whose disk is shared with the machine: absolute
	// eviction thresholds instead of percentages of the machine's disk,
	// and no image garbage collection (the images are imported offline).
	// Unlike the units it applies outside a container too: for lab images
	// only. Not for a minimal image. Default false.
	LabKubeletPatch bool `yaml:"labKubeletPatch"`
	// LabVM is for lab VMs (QEMU, libvirt), usually on an emulated CPU
	// (TCG): kubeadm patches that give the control plane's static pods
	// patient probes (a kube-apiserver that takes minutes to start is
	// not killed by its startup probe) and a status report of the
	// control plane on the serial console every minute. Not for a
	// minimal image. Default false.
	LabVM bool `yaml:"labVM"`
	// Slim leaves out documentation, man and info pages, translations and
	// apt's package lists (the copyright files stay). Default false.
	Slim bool `yaml:"slim"`

	// Dir is the directory of the spec file, for relative paths.
	Dir string `yaml:"-"`
	// lines maps a top-level key to its line in the file.
	lines map[string]int
}

// Load reads and parses the spec file at path (see Parse).
func Load(path string) (*Spec, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		if os.IsNotExist(err) {
			return nil, errdefs.NotFound("image spec %s: no such file", path)
		}
		return nil, fmt.Errorf("image spec %s: %w", path, err)
	}
	s, err := Parse(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	s.Dir = filepath.Dir(path)
	return s, nil
}

var lineRE = regexp.MustCompile(`line (\d+): field (\S+) not found in type \S+`)

// Parse decodes one image spec strictly and fills in defaults. It returns
// InvalidArgument for YAML that is malformed, has an unknown field or a
// value of the wrong type (the message names the line), or more than one
// document.
func Parse(data []byte) (*Spec, error) {
	var s Spec
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&s); err != nil {
		if err.Error() == "EOF" {
			return nil, errdefs.InvalidArgument("image spec is empty")
		}
		msg := strings.TrimPrefix(err.Error(), "yaml: ")
		msg = strings.ReplaceAll(msg, "unmarshal errors:\n  ", "")
		msg = lineRE.ReplaceAllString(msg, "line $1: unknown field $2 (known fields: "+strings.Join(knownFields(), ", ")+")")
		return nil, errdefs.InvalidArgument("image spec: %s", msg)
	}
	var extra any
	if err := dec.Decode(&extra); err == nil {
		return nil, errdefs.InvalidArgument("image spec: more than one YAML document")
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err == nil && len(doc.Content) == 1 && doc.Content[0].Kind == yaml.MappingNode {
		s.lines = map[string]int{}
		m := doc.Content[0]
		for i := 0; i+1 < len(m.Content); i += 2 {
			s.lines[m.Content[i].Value] = m.Content[i].Line
		}
	}
	s.defaults()
	return &s, nil
}

func knownFields() []string {
	return []string{"os", "suite", "mirror", "packages", "minimal", "kubernetesVersion", "agent", "kernel", "size",
		"cgroupDriver", "sysctls", "modules", "sourceDateEpoch", "tagDate", "publishURL", "labCgroupRemount",
		"labSysctlBinds", "labNetwork", "labKubeletPatch", "labVM", "slim"}
}

func (s *Spec) defaults() {
	if s.OS == "" {
		s.OS = OSDebian
	}
	if s.Suite == "" {
		s.Suite = DefaultSuite
	}
	if s.Mirror == "" {
		s.Mirror = DefaultMirror
	}
	if s.Kernel == "" {
		s.Kernel = DefaultKernel
		if s.Minimal {
			s.Kernel = KernelNone
		}
	}
	if s.CgroupDriver == "" {
		s.CgroupDriver = CgroupDriverSystemd
	}
	if s.PublishURL == "" {
		s.PublishURL = DefaultPublishURL
	}
	if s.LabCgroupRemount == nil {
		t := true
		s.LabCgroupRemount = &t
	}
}

// Problems is every validation failure of a spec, one per line.
type Problems []string

func (p Problems) Error() string { return strings.Join(p, "\n") }

var (
	sysctlKeyRE = regexp.MustCompile(`^[a-z0-9_]+([./][a-zA-Z0-9_-]+)+$`)
	moduleRE    = regexp.MustCompile(`^[a-z0-9_-]+$`)
	k8sVerRE    = regexp.MustCompile(`^v1\.\d+\.\d+$`)
	tagDateRE   = regexp.MustCompile(`^\d{8}$`)
)

// Validate checks every field and returns InvalidArgument listing each
// problem with its line ("line 7: kubernetesVersion ..."). wantK8s is the
// Kubernetes version the kube-tools cache is pinned to ("" skips that
// check).
func (s *Spec) Validate(wantK8s string) error {
	var p Problems
	add := func(field, format string, args ...any) {
		prefix := field
		if l := s.lines[field]; l > 0 {
			prefix = fmt.Sprintf("line %d: %s", l, field)
		}
		p = append(p, prefix+": "+fmt.Sprintf(format, args...))
	}
	if s.OS != OSDebian {
		add("os", "%q is not supported: use debian", s.OS)
	}
	if _, ok := Suites[s.Suite]; !ok {
		add("suite", "%q is not supported: use one of %s", s.Suite, strings.Join(slices.Sorted(maps.Keys(Suites)), ", "))
	}
	if err := (rootfs.Spec{Suite: DefaultSuite, Mirror: s.Mirror}).Validate(); err != nil {
		add("mirror", "%q: want an http://, https:// or file:/ URL", s.Mirror)
	}
	for _, pkg := range s.Packages {
		if err := (rootfs.Spec{Packages: []string{pkg}}).Validate(); err != nil {
			add("packages", "%q is not a Debian package name", pkg)
		}
	}
	switch {
	case s.Minimal && s.KubernetesVersion != "":
		add("kubernetesVersion", "a minimal image has no Kubernetes: remove it or set minimal: false")
	case s.Minimal:
	case s.KubernetesVersion == "":
		add("kubernetesVersion", "required: the pinned version of the kube-tools cache (%s)", orAny(wantK8s))
	case !k8sVerRE.MatchString(s.KubernetesVersion):
		add("kubernetesVersion", "%q is not of the form v1.Y.Z", s.KubernetesVersion)
	case wantK8s != "" && s.KubernetesVersion != wantK8s:
		add("kubernetesVersion", "%q: this kiln-imagebuilder's kube-tools are pinned to %s", s.KubernetesVersion, wantK8s)
	}
	if s.Agent == "" {
		add("agent", "required: the path of the kiln-agent binary to install")
	}
	switch {
	case s.Kernel == KernelNone:
	case s.Minimal:
		add("kernel", "a minimal image has no kernel: remove it or set it to none")
	case !strings.HasPrefix(s.Kernel, "linux-image-"):
		add("kernel", "%q: want a Debian kernel package (linux-image-...) or none", s.Kernel)
	default:
		if err := (rootfs.Spec{Packages: []string{s.Kernel}}).Validate(); err != nil {
			add("kernel", "%q is not a Debian package name", s.Kernel)
		}
	}
	if s.Size != "" {
		if _, err := ParseSize(s.Size); err != nil {
			add("size", "%v", err)
		}
	}
	switch s.CgroupDriver {
	case CgroupDriverSystemd, CgroupDriverCgroupfs:
	default:
		add("cgroupDriver", "%q: use systemd or cgroupfs", s.CgroupDriver)
	}
	for _, k := range slices.Sorted(maps.Keys(s.Sysctls)) {
		v := s.Sysctls[k]
		if !sysctlKeyRE.MatchString(k) {
			add("sysctls", "%q is not a sysctl name (like net.ipv4.ip_forward)", k)
		}
		if v == "" || strings.ContainsAny(v, "\n\r") {
			add("sysctls", "%s: value %q must be one non-empty line", k, v)
		}
	}
	for _, m := range s.Modules {
		if !moduleRE.MatchString(m) {
			add("modules", "%q is not a kernel module name", m)
		}
	}
	if s.SourceDateEpoch < 0 {
		add("sourceDateEpoch", "%d: want Unix seconds, not negative", s.SourceDateEpoch)
	}
	if s.TagDate != "" {
		if _, err := time.Parse("20060102", s.TagDate); err != nil || !tagDateRE.MatchString(s.TagDate) {
			add("tagDate", "%q: want yyyymmdd", s.TagDate)
		}
	}
	if s.Minimal && s.LabSysctlBinds {
		add("labSysctlBinds", "a minimal image has no kubelet: remove it or set minimal: false")
	}
	if s.Minimal && s.LabNetwork {
		add("labNetwork", "a minimal image has no Kubernetes: remove it or set minimal: false")
	}
	if s.Minimal && s.LabKubeletPatch {
		add("labKubeletPatch", "a minimal image has no kubelet: remove it or set minimal: false")
	}
	if s.Minimal && s.LabVM {
		add("labVM", "a minimal image has no control plane: remove it or set minimal: false")
	}
	if !strings.HasPrefix(s.PublishURL, "http://") && !strings.HasPrefix(s.PublishURL, "https://") {
		add("publishURL", "%q: want an http:// or https:// base URL", s.PublishURL)
	}
	if len(p) > 0 {
		return errdefs.InvalidArgument("image spec:\n  %s", strings.Join(p, "\n  "))
	}
	return nil
}

func orAny(v string) string {
	if v == "" {
		return "any"
	}
	return v
}

// AgentPath is the agent binary's path, resolved against the spec's
// directory.
func (s *Spec) AgentPath() string {
	if filepath.IsAbs(s.Agent) || s.Dir == "" {
		return s.Agent
	}
	return filepath.Join(s.Dir, s.Agent)
}

// Epoch returns the timestamp to clamp to: $SOURCE_DATE_EPOCH when set,
// else SourceDateEpoch, else now. It returns InvalidArgument when the
// environment variable is not a non-negative integer.
func (s *Spec) Epoch(getenv func(string) string, now time.Time) (int64, error) {
	if v := getenv("SOURCE_DATE_EPOCH"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			return 0, errdefs.InvalidArgument("SOURCE_DATE_EPOCH=%q: want Unix seconds", v)
		}
		return n, nil
	}
	if s.SourceDateEpoch > 0 {
		return s.SourceDateEpoch, nil
	}
	return now.Unix(), nil
}

// OSVersion is the short OS name with its major version ("debian12").
func (s *Spec) OSVersion() string { return s.OS + Suites[s.Suite] }

// Tag is <os><ver>-k8s<ver>-<yyyymmdd> (debian12-k8s1.34.4-20261202), or
// <os><ver>-minimal-<yyyymmdd> for a minimal image. The date is TagDate,
// or patchDate (the yyyymmdd of the image's OS packages) when TagDate is
// empty.
func (s *Spec) Tag(patchDate string) string {
	date := s.TagDate
	if date == "" {
		date = patchDate
	}
	if s.Minimal {
		return s.OSVersion() + "-minimal-" + date
	}
	return s.OSVersion() + "-k8s" + strings.TrimPrefix(s.KubernetesVersion, "v") + "-" + date
}

// RootSize returns Size in bytes, 0 when empty.
func (s *Spec) RootSize() int64 {
	n, _ := ParseSize(s.Size)
	return n
}

var sizeRE = regexp.MustCompile(`^(\d+)\s*([KMGT]i?B?|B)?$`)

// ParseSize parses "4GiB", "512MiB", "2G" (binary units) or a byte count,
// which must be a whole number of MiB. It returns InvalidArgument.
func ParseSize(v string) (int64, error) {
	m := sizeRE.FindStringSubmatch(strings.TrimSpace(v))
	if m == nil {
		return 0, errdefs.InvalidArgument("%q: want a size like 4GiB or 1536MiB", v)
	}
	n, err := strconv.ParseInt(m[1], 10, 64)
	if err != nil {
		return 0, errdefs.InvalidArgument("%q: %v", v, err)
	}
	shift := map[byte]uint{'K': 10, 'M': 20, 'G': 30, 'T': 40}
	if m[2] != "" && m[2] != "B" {
		s := shift[m[2][0]]
		if n > (1<<62)>>s {
			return 0, errdefs.InvalidArgument("%q: too large", v)
		}
		n <<= s
	}
	if n < 64<<20 || n%(1<<20) != 0 {
		return 0, errdefs.InvalidArgument("%q: want a whole number of MiB, at least 64MiB", v)
	}
	return n, nil
}
