package golden

import (
	"os/exec"
	"path"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/api/resource"
	kubeletv1beta1 "k8s.io/kubelet/config/v1beta1"
	"sigs.k8s.io/yaml"

	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/imagebuilder/manifest"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/imagebuilder/spec"
	resources "github.com/kilnhq/kiln/internal/manifest"
)

func mustSpec(t *testing.T, y string) *spec.Spec {
	t.Helper()
	s, err := spec.Parse([]byte(y))
	require.NoError(t, err)
	require.NoError(t, s.Validate("v1.34.4"))
	return s
}

func TestPackages(t *testing.T) {
	for _, tc := range []struct {
		yaml string
		want string
	}{
		{"minimal: true\nagent: x\n", ""},
		{"minimal: true\nagent: x\npackages: [vim-tiny, less, vim-tiny]\n", "less vim-tiny"},
		{"kubernetesVersion: v1.34.4\nagent: x\n", "conntrack containerd containernetworking-plugins ethtool initramfs-tools iptables kmod linux-image-amd64 procps runc socat"},
		{"kubernetesVersion: v1.34.4\nagent: x\nkernel: none\npackages: [kmod]\n", "conntrack containerd containernetworking-plugins ethtool iptables kmod procps runc socat"},
	} {
		got := strings.Join(Packages(mustSpec(t, tc.yaml)), " ")
		if got != tc.want {
			t.Errorf("Packages(%q) = %q, want %q", tc.yaml, got, tc.want)
		}
	}
}

func TestBakedPrep(t *testing.T) {
	s := mustSpec(t, "kubernetesVersion: v1.34.4\nagent: x\nmodules: [ip_vs, overlay]\nsysctls: {net.ipv4.ip_forward: \"1\", vm.max_map_count: \"262144\"}\n")
	if got, want := ModulesLoad(s), "br_netfilter\noverlay\nip_vs\n"; !strings.HasSuffix(got, want) {
		t.Errorf("ModulesLoad() = %q, want it to end with %q", got, want)
	}
	sys := Sysctls(s)
	for _, want := range []string{"net.bridge.bridge-nf-call-iptables = 1\n", "net.bridge.bridge-nf-call-ip6tables = 1\n", "vm.max_map_count = 262144\n"} {
		if !strings.Contains(sys, want) {
			t.Errorf("Sysctls() = %q, want it to contain %q", sys, want)
		}
	}
	if n := strings.Count(sys, "net.ipv4.ip_forward"); n != 1 {
		t.Errorf("Sysctls() sets ip_forward %d times, want once", n)
	}
	for _, tc := range []struct {
		driver string
		want   string
	}{{"systemd", "SystemdCgroup = true"}, {"cgroupfs", "SystemdCgroup = false"}} {
		if got := ContainerdConfig(tc.driver, "registry.k8s.io/pause:3.10.1"); !strings.Contains(got, tc.want) || !strings.Contains(got, `sandbox_image = "registry.k8s.io/pause:3.10.1"`) {
			t.Errorf("ContainerdConfig(%q) = %q, want %q and the pause image", tc.driver, got, tc.want)
		}
	}
	if strings.Contains(Fstab, "swap") && !strings.Contains(Fstab, "No swap") {
		t.Errorf("Fstab has a swap entry: %q", Fstab)
	}
}

func TestFiles(t *testing.T) {
	s := mustSpec(t, "kubernetesVersion: v1.34.4\nagent: x\n")
	kube := &kubeFiles{bins: []named{{"kubeadm", "/c/kubeadm"}}, archives: []named{{"pause.tar", "/c/pause.tar"}}, pause: "registry.k8s.io/pause:3.10.1"}
	got := map[string]string{}
	for _, f := range files(s, "/bin/agent", kube, "TAG=x\n") {
		got[f.Path] = f.Symlink + f.Source
	}
	for path, want := range map[string]string{
		AgentPath: "/bin/agent",
		"/etc/systemd/system/multi-user.target.wants/kiln-agent.service":         "/etc/systemd/system/kiln-agent.service",
		"/etc/systemd/system/multi-user.target.wants/kubelet.service":            "/lib/systemd/system/kubelet.service",
		"/etc/systemd/system/multi-user.target.wants/kiln-import-images.service": "/etc/systemd/system/kiln-import-images.service",
		"/etc/systemd/system/sysinit.target.wants/cgroup-rw.service":             "/etc/systemd/system/cgroup-rw.service",
		"/usr/bin/kubeadm":       "/c/kubeadm",
		ImagesDir + "/pause.tar": "/c/pause.tar",
		"/etc/machine-id":        "",
		"/etc/systemd/system/kubelet.service.d/10-kubeadm.conf": "",
		// A booted machine's NIC gets DHCP from systemd-networkd.
		DHCPNetworkFile: "",
		"/etc/systemd/system/multi-user.target.wants/systemd-networkd.service": "/lib/systemd/system/systemd-networkd.service",
		"/etc/systemd/system/sockets.target.wants/systemd-networkd.socket":     "/lib/systemd/system/systemd-networkd.socket",
	} {
		if g, ok := got[path]; !ok || g != want {
			t.Errorf("files()[%q] = %q (present %v), want %q", path, g, ok, want)
		}
	}
	min := mustSpec(t, "minimal: true\nagent: x\nlabCgroupRemount: false\n")
	for _, f := range files(min, "/bin/agent", nil, "") {
		if strings.Contains(f.Path, "kube") || strings.Contains(f.Path, "cgroup-rw") {
			t.Errorf("minimal image without labCgroupRemount has %s", f.Path)
		}
	}
	// Without a kernel (nspawn lab hosts) the host's namespace configures
	// the NIC: networkd stays off.
	for _, sp := range []*spec.Spec{min, mustSpec(t, "kubernetesVersion: v1.34.4\nagent: x\nkernel: none\n")} {
		for _, f := range files(sp, "/bin/agent", kube, "") {
			if strings.Contains(f.Path, "networkd") || strings.HasPrefix(f.Path, "/etc/systemd/network/") {
				t.Errorf("image without a kernel has %s", f.Path)
			}
		}
	}
	if !strings.Contains(DHCPNetwork, "[Match]\nName=en* eth*") || !strings.Contains(DHCPNetwork, "DHCP=ipv4") {
		t.Errorf("DHCPNetwork = %q", DHCPNetwork)
	}
}

func TestParseDpkgStatus(t *testing.T) {
	status := `Package: systemd
Status: install ok installed
Priority: important
Version: 252.39-1~deb12u1
Description: system and service manager
 long text

Package: removed-one
Status: deinstall ok config-files
Version: 1.0

Package: base-files
Status: install ok installed
Version: 12.4+deb12u13
`
	got, err := ParseDpkgStatus(strings.NewReader(status))
	require.NoError(t, err)
	want := []manifest.Package{{Name: "base-files", Version: "12.4+deb12u13"}, {Name: "systemd", Version: "252.39-1~deb12u1"}}
	require.Equal(t, want, got)
}

func TestImageResourceApplies(t *testing.T) {
	m := &manifest.Manifest{
		Tag: "debian12-k8s1.34.4-20251202", Format: manifest.FormatRawZst,
		RawSize: 4 << 30, RawSHA256: strings.Repeat("a", 64), CompressedSize: 300 << 20, CompressedSHA256: strings.Repeat("b", 64),
		OSVersion: "debian12", KubernetesVersion: "v1.34.4", KernelVersion: "6.1.0-41-amd64", PatchLevel: "20251201",
		BuildDate: time.Unix(1764633600, 0),
		Addons:    &manifest.Addons{KubeProxy: "v1.34.4", CoreDNS: "v1.12.1", Etcd: "3.6.5-0", Pause: "3.10.1"},
	}
	y, err := ImageResource(m, "https://images.example.com/kiln")
	require.NoError(t, err)
	docs, err := resources.Decode("image.yaml", y)
	require.NoError(t, err, "%s", y)
	require.Len(t, docs, 1)
	if err := validation.Validate(docs[0].Resource); err != nil {
		t.Fatalf("validation.Validate(%s) = %v, want nil", y, err)
	}
	img := docs[0].Resource.GetImage()
	if got, want := img.GetSpec().GetUrl(), "https://images.example.com/kiln/debian12-k8s1.34.4-20251202.raw.zst"; got != want {
		t.Errorf("url = %q, want %q", got, want)
	}
	if got, want := img.GetSpec().GetManifestUrl(), "https://images.example.com/kiln/debian12-k8s1.34.4-20251202.json"; got != want {
		t.Errorf("manifestUrl = %q, want %q", got, want)
	}
	if img.GetSpec().GetSha256() != m.CompressedSHA256 || img.GetSpec().GetSize() != m.CompressedSize || img.GetSpec().GetRawSize() != m.RawSize {
		t.Errorf("image spec %v does not carry the compressed hash and sizes of %+v", img.GetSpec(), m)
	}
	if got := img.GetMetadata().GetName(); got != m.Tag {
		t.Errorf("name = %q, want %q", got, m.Tag)
	}
	// The upgrade recipe travels with the image.
	a := img.GetSpec().GetAddons()
	if a.GetKubeProxy() != "v1.34.4" || a.GetCoredns() != "v1.12.1" || a.GetEtcd() != "3.6.5-0" || a.GetPause() != "3.10.1" {
		t.Errorf("addons = %v, want the manifest's %+v", a, *m.Addons)
	}
}

func TestBootConfigs(t *testing.T) {
	const uuid = "4F68BCE3-0000-4000-8000-000000000000"
	for _, tc := range []struct {
		name string
		got  string
		want []string
	}{
		{"GrubConfig", GrubConfig(uuid), []string{"linux /vmlinuz root=PARTUUID=4f68bce3-0000-4000-8000-000000000000 rw", "initrd /initrd.img", "search --no-floppy --file --set=root /kiln-esp.marker"}},
		{"SyslinuxConfig", SyslinuxConfig(uuid), []string{"LINUX /vmlinuz", "INITRD /initrd.img", "APPEND root=PARTUUID=4f68bce3-0000-4000-8000-000000000000 rw"}},
	} {
		for _, want := range tc.want {
			if !strings.Contains(tc.got, want) {
				t.Errorf("%s(%q) = %q, want it to contain %q", tc.name, uuid, tc.got, want)
			}
		}
	}
}

func TestLabFiles(t *testing.T) {
	s := mustSpec(t, "kubernetesVersion: v1.34.4\nagent: x\nlabSysctlBinds: true\nlabNetwork: true\n")
	kube := &kubeFiles{pause: "registry.k8s.io/pause:3.10.1"}
	got := map[string]rootfs.File{}
	for _, f := range files(s, "/bin/agent", kube, "TAG=x\n") {
		got[f.Path] = f
	}
	for path, want := range map[string]string{
		"/etc/systemd/system/sysinit.target.wants/" + LabSysctlUnit: "/etc/systemd/system/" + LabSysctlUnit,
		"/etc/systemd/system/multi-user.target.wants/" + LabNetUnit: "/etc/systemd/system/" + LabNetUnit,
	} {
		if got[path].Symlink != want {
			t.Errorf("files()[%q] = %+v, want a symlink to %s", path, got[path], want)
		}
	}
	for _, kv := range LabSysctls {
		f, ok := got[LabSysctlDir+"/"+kv[0]]
		if !ok || string(f.Data) != kv[1]+"\n" {
			t.Errorf("lab sysctl %s = %q (present %v), want %q", kv[0], f.Data, ok, kv[1])
		}
		if !strings.Contains(LabSysctlUnitFile(), kv[0]) {
			t.Errorf("%s does not bind %s", LabSysctlUnit, kv[0])
		}
	}
	if f := got[LabNetScript]; f.Mode != 0o755 || string(f.Data) != LabNetScriptFile {
		t.Errorf("%s: mode %v, want 0755 and the script", LabNetScript, f.Mode)
	}
	// The kubelet's kernel settings are bound only in a container; the lab
	// network runs in lab VMs too (their images have no other CNI).
	if !strings.Contains(LabSysctlUnitFile(), "ConditionVirtualization=container") {
		t.Errorf("lab sysctl unit runs outside containers too:\n%s", LabSysctlUnitFile())
	}
	if strings.Contains(LabNetUnitFile, "ConditionVirtualization") {
		t.Errorf("lab network unit runs only in containers:\n%s", LabNetUnitFile)
	}
	// The script is valid sh (dash parses it without running it).
	cmd := exec.Command("sh", "-n")
	cmd.Stdin = strings.NewReader(LabNetScriptFile)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "sh -n %s: %s", LabNetScript, out)

	plain := mustSpec(t, "kubernetesVersion: v1.34.4\nagent: x\n")
	for _, f := range files(plain, "/bin/agent", kube, "") {
		if strings.Contains(f.Path, "kiln-lab") {
			t.Errorf("an image without the lab options has %s", f.Path)
		}
	}
}

func TestDigest(t *testing.T) {
	const pause = "registry.k8s.io/pause:3.10.1"
	base := "kubernetesVersion: v1.34.4\nagent: x\n"
	d := Digest(mustSpec(t, base), pause)
	if len(d) != 64 || Digest(mustSpec(t, base), pause) != d {
		t.Fatalf("Digest = %q, want 64 hex digits, the same for the same spec", d)
	}
	if Digest(mustSpec(t, "kubernetesVersion: v1.34.4\nagent: /other/agent\n"), pause) != d {
		t.Errorf("Digest depends on the agent's path (an input, keyed separately)")
	}
	for _, other := range []string{"labNetwork: true\n", "slim: true\n", "cgroupDriver: cgroupfs\n", "packages: [less]\n", "sysctls: {vm.max_map_count: \"1\"}\n"} {
		if Digest(mustSpec(t, base+other), pause) == d {
			t.Errorf("Digest does not change with %q", other)
		}
	}
	if Digest(mustSpec(t, base), "registry.k8s.io/pause:3.9") == d {
		t.Errorf("Digest does not change with the pause image")
	}
}

// An image of the previous minor carries the pinned minor's kube-proxy and
// CoreDNS (a minor upgrade by reimaging moves the addons while its nodes
// still run); the pinned minor's image carries only its own.
func TestNextMinorAddons(t *testing.T) {
	next, ok := NextMinorAddons(kubetools.Previous().Kubernetes)
	if !ok || next.Kubernetes != kubetools.Pinned().Kubernetes {
		t.Fatalf("NextMinorAddons(%s) = %s, %v; want %s, true", kubetools.Previous().Kubernetes, next.Kubernetes, ok, kubetools.Pinned().Kubernetes)
	}
	if _, ok := NextMinorAddons(kubetools.Pinned().Kubernetes); ok {
		t.Errorf("NextMinorAddons(%s) = true, want false", kubetools.Pinned().Kubernetes)
	}
	const pause = "registry.k8s.io/pause:3.10"
	prev, err := spec.Parse([]byte("kubernetesVersion: " + kubetools.Previous().Kubernetes + "\nagent: x\n"))
	require.NoError(t, err)
	require.NoError(t, prev.Validate(kubetools.Previous().Kubernetes))
	marker := false
	for _, f := range files(prev, "", &kubeFiles{pause: pause}, "") {
		if f.Path == ImagesDir+"/NEXT-MINOR" {
			marker = strings.Contains(string(f.Data), kubetools.Pinned().Kubernetes)
		}
	}
	if !marker {
		t.Errorf("an image of %s has no %s/NEXT-MINOR naming %s (it changes the image's digest, so cached images without the archives are rebuilt)",
			kubetools.Previous().Kubernetes, ImagesDir, kubetools.Pinned().Kubernetes)
	}
}

// The lab's kubelet patch is a KubeletConfiguration the kubelet accepts:
// known fields only, every signal the kubelet defaults given (a partial
// evictionHard sets the others to 0), absolute quantities, and image GC
// off the way the kubelet recognises it (high 100, low below it).
func TestLabKubeletPatch(t *testing.T) {
	var kc kubeletv1beta1.KubeletConfiguration
	require.NoError(t, yaml.UnmarshalStrict([]byte(LabKubeletPatch), &kc), "LabKubeletPatch is not a KubeletConfiguration")
	for _, signal := range []string{"memory.available", "nodefs.available", "nodefs.inodesFree", "imagefs.available"} {
		v, ok := kc.EvictionHard[signal]
		if !ok {
			t.Errorf("LabKubeletPatch evictionHard has no %s (it would become 0)", signal)
			continue
		}
		if strings.HasSuffix(v, "%") {
			t.Errorf("LabKubeletPatch evictionHard[%s] = %q, want an absolute quantity (a percentage is of the machine's disk)", signal, v)
		}
		if _, err := resource.ParseQuantity(v); err != nil {
			t.Errorf("LabKubeletPatch evictionHard[%s] = %q: %v", signal, v, err)
		}
	}
	if high, low := kc.ImageGCHighThresholdPercent, kc.ImageGCLowThresholdPercent; high == nil || *high != 100 || low == nil || *low >= *high || *low < 0 {
		t.Errorf("LabKubeletPatch image GC thresholds high %v low %v, want high 100 (GC off) and 0 <= low < 100", high, low)
	}
	if got := path.Base(LabKubeletPatchFile); got != "kubeletconfiguration+merge.yaml" {
		t.Errorf("LabKubeletPatchFile = %q, want kubeadm's kubeletconfiguration target as a merge patch", got)
	}

	s := mustSpec(t, "kubernetesVersion: v1.34.4\nagent: x\nlabKubeletPatch: true\n")
	kube := &kubeFiles{pause: "registry.k8s.io/pause:3.10.1"}
	found := false
	for _, f := range files(s, "/bin/agent", kube, "") {
		if f.Path == "/etc/kiln/kubeadm-patches/kubeletconfiguration+merge.yaml" && string(f.Data) == LabKubeletPatch {
			found = true
		}
	}
	if !found {
		t.Errorf("files(labKubeletPatch: true) has no %s", LabKubeletPatchFile)
	}
	for _, f := range files(mustSpec(t, "kubernetesVersion: v1.34.4\nagent: x\n"), "/bin/agent", kube, "") {
		if f.Path == LabKubeletPatchFile {
			t.Errorf("files(no lab options) has %s", LabKubeletPatchFile)
		}
	}
}
