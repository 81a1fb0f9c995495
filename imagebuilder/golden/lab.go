package golden

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"path"

	"github.com/kilnhq/kiln/agent/kubeadm"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/imagebuilder/spec"
)

// Units and files of the lab options (spec labSysctlBinds, labNetwork,
// labKubeletPatch).
const (
	LabSysctlUnit = "kiln-lab-sysctl.service"
	LabNetUnit    = "kiln-lab-net.service"
	// LabSysctlDir holds one file per kernel setting the kubelet insists
	// on, bind-mounted over /proc/sys/<name> by LabSysctlUnit.
	LabSysctlDir = "/etc/kiln-lab/sysctl"
	// LabNetScript is what LabNetUnit runs.
	LabNetScript = "/usr/lib/kiln/lab-net"
	// LabCNIConfig is the bridge CNI config LabNetScript writes once the
	// node has a pod CIDR.
	LabCNIConfig = "/etc/cni/net.d/10-kiln-lab.conflist"
)

// LabKubeletPatchFile is the kubeadm patch (spec labKubeletPatch) the
// agent hands kubeadm on init and join (kubeadm.PatchesDir): a JSON merge
// patch of the node's KubeletConfiguration.
var LabKubeletPatchFile = path.Join(kubeadm.PatchesDir, "kubeletconfiguration+merge.yaml")

// LabKubeletPatch is LabKubeletPatchFile's content. A lab host's disk is
// a file, an overlay or a loop-mounted image on the machine's own disk:
// the kubelet's default thresholds (imagefs.available<15%,
// nodefs.available<10%, image GC from 85% used) are percentages of
// whatever that disk holds, so a lab on a machine whose disk is 85% full
// enters DiskPressure, evicts CoreDNS and garbage-collects the images it
// imported offline (pull policy Never: they cannot come back). Absolute
// thresholds small enough for any lab disk (below the defaults on the lab
// image's own root) keep the kubelet's guard against a truly full disk;
// imageGCHighThresholdPercent 100 turns image GC off (the low threshold
// must stay below it).
const LabKubeletPatch = `# A lab host shares the machine's disk (written by kiln-imagebuilder, spec
# labKubeletPatch; docs/lab.md): absolute eviction thresholds, no image GC.
evictionHard:
  memory.available: 100Mi
  nodefs.available: 256Mi
  nodefs.inodesFree: "1000"
  imagefs.available: 256Mi
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
`

// LabProbeTargets are the control plane's static pods (kubeadm patch
// targets, each the name of its container) whose probes a lab VM image
// patches.
var LabProbeTargets = []string{"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"}

// LabProbePatchFile is the kubeadm patch file of a target in
// kubeadm.PatchesDir (strategic merge patch of the static Pod).
func LabProbePatchFile(target string) string {
	return path.Join(kubeadm.PatchesDir, target+"+strategic.yaml")
}

// LabProbePatch gives target's container patient probes. kubeadm's static
// pods allow a component 10 s + 24 × 10 s to start (startupProbe) and
// kill it after 8 failed liveness probes of 15 s; under TCG on a loaded
// machine a kube-apiserver took longer than kubeadm's whole 10-minute
// wait to answer /livez (TestVMEndToEnd), and one killed by its startup
// probe starts again from nothing. With the patch: 60 s per probe, 20
// minutes to start, 5 minutes of failed liveness probes before a kill.
func LabProbePatch(target string) string {
	return `# A lab VM's control plane under an emulated CPU (written by
# kiln-imagebuilder, spec labVM; docs/lab.md): patient probes.
spec:
  containers:
  - name: ` + target + `
    startupProbe:
      timeoutSeconds: 60
      failureThreshold: 120
    livenessProbe:
      timeoutSeconds: 60
      failureThreshold: 30
`
}

// LabConsoleUnit prints LabConsoleScript's report on the serial console
// every minute, in lab VM images: a test that cannot log in reads the
// console's tail when the control plane does not come up.
const (
	LabConsoleUnit   = "kiln-lab-console.service"
	LabConsoleScript = "/usr/lib/kiln/lab-console-status"
)

// LabConsoleUnitFile is LabConsoleUnit.
const LabConsoleUnitFile = `[Unit]
Description=Kiln lab VM: control-plane status on the serial console every minute
After=containerd.service

[Service]
ExecStart=` + LabConsoleScript + `
StandardOutput=tty
TTYPath=/dev/ttyS0
Restart=always
RestartSec=10

[Install]
WantedBy=multi-user.target
`

// LabConsoleScriptFile is LabConsoleScript: load, memory, the image
// import, the kubelet and the containers of the k8s.io namespace, and the
// kubelet's last probe failures and kills, one block a minute.
const LabConsoleScriptFile = `#!/bin/sh
# kiln-lab-console: a lab VM's control-plane status on the console.
while :; do
	echo "--- kiln-lab-console $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) mem-avail $(awk '/MemAvailable/ {print $2 / 1024 " MiB"}' /proc/meminfo)"
	echo "import: $(tail -n 1 ` + ImportLog + ` 2>/dev/null) kubelet: $(systemctl is-active kubelet)"
	ctr -n k8s.io containers ls -q 2>/dev/null | wc -l | sed 's/^/containers: /'
	ctr -n k8s.io tasks ls 2>/dev/null | tail -n +2 | head -n 12
	journalctl -u kubelet --since "-1min" --no-pager -o cat 2>/dev/null | grep -E 'Probe failed|Killing|Back-off|failed to' | tail -n 4 | cut -c1-240
	sleep 60
done
`

// LabSysctls are the kernel settings the kubelet writes when they differ
// (its "kernel defaults"). They are not namespaced: a lab host in a
// container must not change the machine's, so LabSysctlUnit shows the
// kubelet these values inside the host only.
var LabSysctls = [][2]string{
	{"vm/overcommit_memory", "1"},
	{"kernel/panic", "10"},
	{"kernel/panic_on_oops", "1"},
}

// LabSysctlUnitFile bind-mounts LabSysctlDir/<name> over /proc/sys/<name>
// for each of LabSysctls, in the host's own mount namespace, before the
// kubelet starts. It runs only in a container (the lab's nspawn hosts).
// Equivalent to: `mount --bind /etc/kiln-lab/sysctl/vm/overcommit_memory
// /proc/sys/vm/overcommit_memory` and so on.
func LabSysctlUnitFile() string {
	var names string
	for i, kv := range LabSysctls {
		if i > 0 {
			names += " "
		}
		names += kv[0]
	}
	return `[Unit]
Description=Kubelet kernel defaults for a lab host (bind mounts inside the host only)
DefaultDependencies=no
ConditionVirtualization=container
After=local-fs.target
Before=kubelet.service sysinit.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -ec 'for f in ` + names + `; do mount --bind ` + LabSysctlDir + `/$f /proc/sys/$f; done'

[Install]
WantedBy=sysinit.target
`
}

// LabNetUnitFile runs LabNetScript for as long as the host is up: in
// the lab's nspawn hosts, and in lab VMs booted from an image with a
// kernel and labNetwork (examples/images/vm-lab.yaml), which have no CNI
// either.
const LabNetUnitFile = `[Unit]
Description=Lab host network: /etc/hosts, bridge CNI for the pod CIDR, pod routes, offline CoreDNS
After=network.target
Before=kiln-agent.service kubelet.service

[Service]
ExecStart=` + LabNetScript + `
Restart=always
RestartSec=5

[Install]
WantedBy=multi-user.target
`

// LabRouteProto is the routing protocol number of the routes
// LabNetScript adds (`ip route ... proto 77`), so it can remove exactly
// those: the lab host's network namespace outlives a reboot or a reimage,
// and a stale route inside the pod CIDR would fail the next Preflight.
const LabRouteProto = "77"

// LabNetScriptFile is LabNetScript. At start it adds the host's name with
// its address to /etc/hosts (kubeadm's checks and the kubelet look it up,
// and a lab host has no DNS server to ask). Then every 3 s:
//
//   - while the host is not a node (no /etc/kubernetes/kubelet.conf: before
//     init or join, after a reset), it removes what it set up: its routes
//     (proto LabRouteProto), LabCNIConfig and the cni0 bridge;
//   - on a node it writes LabCNIConfig (a bridge with host-local addresses
//     from this node's spec.podCIDR, read with the kubelet's credentials)
//     when missing or different; until then the node is NotReady, as
//     with any CNI;
//   - on a control plane (admin.conf exists) it routes every other node's
//     pod CIDR via that node's InternalIP (host-gw) and removes `forward`
//     and `loop` from CoreDNS's Corefile, so cluster DNS never asks an
//     upstream resolver (the lab's hosts may not reach outside);
//   - on a worker, which may read only its own Node, it routes the
//     cluster's pod subnet (kubeadm-config's podSubnet) via a control
//     plane (the first address of the kubernetes Service's endpoints, else
//     the one its kubelet talks to), which forwards to the right node.
const LabNetScriptFile = `#!/bin/sh
# kiln-lab-net (written by kiln-imagebuilder, spec labNetwork): see docs/imagebuilder.md.
set -u
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
conf=` + LabCNIConfig + `
proto=` + LabRouteProto + `
name=$(hostname)
addr=
[ -s /etc/hosts ] || printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' > /etc/hosts
# The address of the NIC of the default route (eth0 in a lab namespace,
# en* in a VM, once DHCP answered), with the host's name in /etc/hosts.
hosts() {
	[ -z "$addr" ] || return 0
	dev=$(ip -4 route show default | awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}')
	addr=$(ip -4 -o addr show dev "${dev:-eth0}" scope global 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
	if [ -n "$addr" ] && ! awk -v n="$name" '{for (i = 2; i <= NF; i++) if ($i == n) f = 1} END {exit !f}' /etc/hosts; then
		printf '%s\t%s\n' "$addr" "$name" >> /etc/hosts
	fi
}

kk() { kubectl --kubeconfig /etc/kubernetes/kubelet.conf "$@"; }
ka() { kubectl --kubeconfig /etc/kubernetes/admin.conf "$@"; }

cni() {
	cat <<EOF
{
  "cniVersion": "1.0.0",
  "name": "kiln-lab",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$1"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
}

route() {
	[ -n "$1" ] && [ -n "$2" ] && [ "$2" != "$addr" ] || return 0
	ip route replace "$1" via "$2" proto "$proto"
}

offline_dns() {
	cf=$(ka -n kube-system get configmap coredns -o jsonpath='{.data.Corefile}' 2>/dev/null) || return 0
	printf '%s\n' "$cf" | grep -Eq '^[[:space:]]*(forward|loop)([[:space:]]|$)' || return 0
	printf '%s\n' "$cf" | awk '
		skip { if ($0 ~ /^[ \t]*}[ \t]*$/) skip = 0; next }
		/^[ \t]*forward[ \t]/ { if ($0 ~ /{[ \t]*$/) skip = 1; next }
		/^[ \t]*loop[ \t]*$/ { next }
		{ print }' > /run/kiln-lab-Corefile
	ka -n kube-system create configmap coredns --from-file=Corefile=/run/kiln-lab-Corefile --dry-run=client -o yaml |
		ka replace -f - >/dev/null && echo "kiln-lab-net: CoreDNS no longer forwards upstream"
}

node=
reconcile() {
	hosts
	if [ ! -f /etc/kubernetes/kubelet.conf ]; then
		node=
		ip route flush proto "$proto" 2>/dev/null
		if [ -e "$conf" ] || ip link show cni0 >/dev/null 2>&1; then
			rm -f "$conf"
			ip link del cni0 2>/dev/null
			echo "kiln-lab-net: not a node: pod network removed"
		fi
		return 0
	fi
	[ -n "$node" ] || node=$(kk auth whoami -o jsonpath='{.status.userInfo.username}' 2>/dev/null | sed -n 's/^system:node://p')
	[ -n "$node" ] || return 0
	cidr=$(kk get node "$node" -o jsonpath='{.spec.podCIDR}' 2>/dev/null)
	if [ -n "$cidr" ]; then
		want=$(cni "$cidr")
		if [ "$(cat "$conf" 2>/dev/null)" != "$want" ]; then
			mkdir -p "$(dirname "$conf")"
			printf '%s\n' "$want" > "$conf.tmp" && mv "$conf.tmp" "$conf"
			echo "kiln-lab-net: node $node: pod network $cidr on cni0"
		fi
	fi
	if [ -f /etc/kubernetes/admin.conf ]; then
		offline_dns
		ka get nodes -o jsonpath='{range .items[*]}{.spec.podCIDR} {.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}' 2>/dev/null |
			while read -r c ip; do route "$c" "$ip"; done
	else
		# An API server's own address (the kubernetes Service's endpoints):
		# the kubelet may talk to a load balancer (controlPlaneEndpoint),
		# which routes no pod traffic.
		cp=$(kk -n default get endpoints kubernetes -o jsonpath='{.subsets[0].addresses[0].ip}' 2>/dev/null)
		[ -n "$cp" ] || cp=$(kk config view --minify -o jsonpath='{.clusters[0].cluster.server}' 2>/dev/null | sed -e 's#^https://##' -e 's#:[0-9]*$##')
		pods=$(kk -n kube-system get configmap kubeadm-config -o jsonpath='{.data.ClusterConfiguration}' 2>/dev/null | awk '$1 == "podSubnet:" {print $2}')
		route "$pods" "$cp"
	fi
}

while :; do
	reconcile
	sleep 3
done
`

// labFiles are the files of the lab options of s.
func labFiles(s *spec.Spec) []rootfs.File {
	unit := func(name, data string, target string) []rootfs.File {
		p := "/etc/systemd/system/" + name
		return []rootfs.File{
			{Path: p, Data: []byte(data)},
			{Path: "/etc/systemd/system/" + target + ".wants/" + name, Symlink: p},
		}
	}
	var fs []rootfs.File
	if s.LabSysctlBinds {
		fs = append(fs, unit(LabSysctlUnit, LabSysctlUnitFile(), "sysinit.target")...)
		for _, kv := range LabSysctls {
			fs = append(fs, rootfs.File{Path: path.Join(LabSysctlDir, kv[0]), Data: []byte(kv[1] + "\n"), Mode: 0o444})
		}
	}
	if s.LabKubeletPatch {
		fs = append(fs, rootfs.File{Path: LabKubeletPatchFile, Data: []byte(LabKubeletPatch), Mode: 0o644})
	}
	if s.LabVM {
		for _, target := range LabProbeTargets {
			fs = append(fs, rootfs.File{Path: LabProbePatchFile(target), Data: []byte(LabProbePatch(target)), Mode: 0o644})
		}
		fs = append(fs, unit(LabConsoleUnit, LabConsoleUnitFile, "multi-user.target")...)
		fs = append(fs, rootfs.File{Path: LabConsoleScript, Data: []byte(LabConsoleScriptFile), Mode: 0o755})
	}
	if s.LabNetwork {
		fs = append(fs, unit(LabNetUnit, LabNetUnitFile, "multi-user.target")...)
		fs = append(fs, rootfs.File{Path: LabNetScript, Data: []byte(LabNetScriptFile), Mode: 0o755})
	}
	return fs
}

// slimGlobs are what a slim image leaves out (relative to the root); the
// copyright files under usr/share/doc stay.
var slimGlobs = []string{"usr/share/man/*", "usr/share/info/*", "usr/share/locale/*", "usr/share/doc/*/*",
	"usr/share/doc-base/*", "usr/share/lintian/*", "var/lib/apt/lists/*", "var/cache/apt/*.bin"}

// Digest is a sha256 (hex) of what a build of s bakes in from the builder
// itself: the path, mode, link target and content of every unit, config
// and script it adds, the package list and what a slim image leaves out;
// not its inputs (the agent binary, the kube-tools cache, the rootfs cache
// entry), which a cache of built images keys on separately. A changed
// builder changes the digest, so such a cache builds again.
func Digest(s *spec.Spec, pause string) string {
	var kube *kubeFiles
	if !s.Minimal {
		kube = &kubeFiles{pause: pause}
	}
	h := sha256.New()
	fmt.Fprintf(h, "packages %q\nslim %v %q\n", Packages(s), s.Slim, slimGlobs)
	for _, f := range files(s, "", kube, "") {
		fmt.Fprintf(h, "%s %o %q %d\n", f.Path, f.Mode, f.Symlink, len(f.Data))
		h.Write(f.Data)
	}
	return hex.EncodeToString(h.Sum(nil))
}
