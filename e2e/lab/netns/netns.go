// Package netns is the lab's default machine backend: each host is a
// network namespace with a veth into the lab bridge, a sparse disk file
// and a state directory, driven through the machine.Machine interface by
// the emulated BMCs.
//
// Powering on from PXE or virtual media runs the boot agent (the boot
// media's program) as a process in the host's network namespace and a
// private mount namespace in which /proc/cmdline carries the kernel
// command line boot media would (kiln.boot=, kiln.controller=,
// kiln.token=, ...): with Agent.ReadMedia the one of the inserted ISO's
// boot configuration, with Agent.BootScript the one of the host's iPXE
// script fetched from inside its namespace, as firmware would read them
// (ReadISOCmdline, ParseIPXE). Powering on from disk mounts the disk's discoverable
// root partition (`systemd-dissect --mount`) and boots it with
// `systemd-nspawn -b` in the host's network namespace, so the image's own
// systemd starts its units as on metal; a blank or corrupt disk boots
// nothing (the machine is on, like firmware with no bootable device). A
// reboot inside the host ends nspawn and the machine boots the disk again.
//
// The disk is mounted inside nspawn's own private mount namespace, never
// in the host's mount table. Everything else the backend creates
// (namespace, veth, cgroups) is reported to Options.Track before it is
// created, and processes right after they start, so a supervisor that
// crashed can be cleaned up by someone else (see e2e/lab/rack and Remove).
package netns

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"time"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Resource kinds reported to Options.Track.
const (
	KindNetns  = "netns"  // a named network namespace (/run/netns/NAME)
	KindLink   = "link"   // a network interface in the initial namespace
	KindMount  = "mount"  // a mount point (unmount recursively)
	KindLoop   = "loop"   // a loop device and its file (/dev/loopN=/path/disk.raw)
	KindCgroup = "cgroup" // a cgroup directory (remove deepest first)
	KindPID    = "pid"    // a process ("PID:STARTTIME", see ProcessID)
	KindDir    = "dir"    // a directory to remove (nspawn's propagation dir)
)

// Resource is something the backend creates on the machine.
type Resource struct {
	Kind  string `json:"kind"`
	Value string `json:"value"`
}

// Options configure one host.
type Options struct {
	// Name is the host name (lowercase letters, digits, '-'); required.
	Name string
	// Lab names the lab the host belongs to (default "kiln"); it prefixes
	// the namespace, the nspawn machine and cgroup names.
	Lab string
	// StateDir holds the host's disk, console log, kernel command line
	// and mount point; required.
	StateDir string
	// Bridge, when set, is the bridge the host's veth joins.
	Bridge string
	// Address is the host's eth0 address in CIDR form (10.251.0.2/24);
	// Gateway its default route. Both optional.
	Address, Gateway string
	// MAC is eth0's hardware address (default: derived from the names).
	MAC string
	// DiskSize is the size of the sparse disk file created when it does
	// not exist (default 8 GiB).
	DiskSize int64
	// Agent configures what PXE and virtual media boot.
	Agent Agent
	// GracePeriod bounds a graceful power-off before it forces (default
	// 30 s; the ctx of PowerOff can end it sooner).
	GracePeriod time.Duration
	// Track is told about every resource before it is created (and about
	// processes right after they start); it may be nil.
	Track func(Resource)
	// Logger receives lifecycle messages; nil discards them.
	Logger *slog.Logger
}

// Agent is the boot media's program.
type Agent struct {
	// Command is the boot agent and its arguments, for example
	// {"/usr/local/bin/kiln-agent", "run", "--data-dir", DIR}. Empty:
	// PXE and virtual media boot nothing.
	Command []string
	// Cmdline is added to the kernel command line the agent sees, for
	// example "kiln.controller=10.251.0.1:7443 kiln.ca_hash=sha256:...".
	Cmdline string
	// CmdlineFile, when it exists at power-on, is read and added too (a
	// per-boot token written by whoever prepares the boot). It should be
	// mode 0600.
	CmdlineFile string
	// Scratch, when set, is a directory emptied at every boot of the
	// agent: boot media keep nothing across a power cycle (give it to the
	// agent as its --data-dir).
	Scratch string
	// BootScript, when set, is the URL of the host's iPXE script (for
	// example http://10.251.0.1:8080/boot/ipxe/lab-h1): a PXE boot fetches
	// it from inside the host's network namespace, checks that its kernel
	// and initrd URLs answer, and gives the agent the script's kernel
	// arguments instead of Cmdline. A script that cannot be had boots
	// nothing (LastBootError says why).
	BootScript string
	// ReadMedia: a virtual-media boot downloads the inserted ISO (from the
	// caller's network namespace, as a BMC does) and gives the agent the
	// kernel command line of its boot configuration (GRUB's linux line,
	// or isolinux's append) instead of Cmdline. Media that cannot be read
	// boot nothing. Needs xorriso.
	ReadMedia bool
	// OSPower gives the agent (kiln-agent) commands to reboot and power
	// off the machine it runs on, as boot media do with `reboot -f`:
	// --reboot-command and --poweroff-command. Reboot kills the agent
	// (SIGKILL, as `reboot -f` would) and the machine boots again from
	// the device its BMC picks (Machine.SetNextBoot); power off sends it
	// SIGTERM and the machine is off once it has exited. A boot agent
	// killed by anything else (the OOM killer) reboots the machine too,
	// like a kernel that panics.
	OSPower bool
	// FirmwareRetry is how long a boot keeps trying to read virtual media
	// or fetch the iPXE script while the boot server is unreachable or
	// answers 5xx (a restarting controller), as BMCs and iPXE retry; 4xx
	// answers fail at once. 0: no retry.
	FirmwareRetry time.Duration
}

func (o *Options) defaults() error {
	if !validName(o.Name) || o.StateDir == "" {
		return errdefs.InvalidArgument("netns machine: name %q (lowercase letters, digits, '-') and a state directory are required", o.Name)
	}
	if o.Lab == "" {
		o.Lab = "kiln"
	}
	if !validName(o.Lab) {
		return errdefs.InvalidArgument("netns machine: lab name %q: want lowercase letters, digits, '-'", o.Lab)
	}
	if o.DiskSize == 0 {
		o.DiskSize = 8 << 30
	}
	if o.GracePeriod == 0 {
		o.GracePeriod = 30 * time.Second
	}
	if o.MAC == "" {
		h := sha256.Sum256([]byte(o.Lab + "/" + o.Name))
		o.MAC = "52:54:00:" + hex.EncodeToString(h[0:1]) + ":" + hex.EncodeToString(h[1:2]) + ":" + hex.EncodeToString(h[2:3])
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Track == nil {
		o.Track = func(Resource) {}
	}
	return nil
}

func validName(s string) bool {
	if s == "" || len(s) > 40 || s[0] == '-' {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-') {
			return false
		}
	}
	return true
}

// NamespaceName is the network namespace of host in lab: kiln-LAB-HOST.
func NamespaceName(lab, host string) string { return "kiln-" + lab + "-" + host }

// MachineName is the nspawn machine (and cgroup) name of host in lab.
func MachineName(lab, host string) string { return "kiln-" + lab + "-" + host }

// VethName is the host-side veth of host in lab ("kv" and 10 hex digits,
// within the 15-byte interface name limit).
func VethName(lab, host string) string {
	h := sha256.Sum256([]byte(lab + "/" + host))
	return "kv" + hex.EncodeToString(h[:5])
}

// BridgeMAC is the fixed, locally administered MAC address to create a
// lab bridge named name with (`ip link add NAME address MAC type
// bridge`). A bridge without one takes the lowest MAC of its ports, so a
// host added later with a lower MAC changes the gateway's address under
// the hosts already up: their ARP entry then points at a MAC nobody has
// and their connections to the gateway time out until it is probed again
// (seen in CI: an enrolled agent's heartbeats got "dial tcp GW:7443: i/o
// timeout" for a minute after the next hosts joined the bridge).
func BridgeMAC(name string) string {
	sum := sha256.Sum256([]byte("kiln-lab-bridge/" + name))
	return fmt.Sprintf("02:6b:6c:%02x:%02x:%02x", sum[0], sum[1], sum[2])
}
