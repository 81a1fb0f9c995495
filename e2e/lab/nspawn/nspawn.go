// Package nspawn runs a Debian root (or any root with systemd) as a lab
// node: systemd-nspawn with systemd as PID 1, in its own cgroups and
// network namespace, with the flags the lab's machines need (LAB.md,
// "Hosts with a real systemd"), and takes it down again without leaving
// a process, cgroup or nspawn propagation directory behind.
//
// The pieces serve the lab's users at two levels: Start, WaitRunning,
// Exec and Stop run a whole Container (e2e/kube's nodes, the real-systemd
// tests of host/systemd/systemdtest, the golden image's boot test);
// Args, Env, Cgroups, LeaderOf and PropagateDir serve a launcher of its
// own (e2e/lab/netns boots a disk inside a private mount namespace and
// relaunches nspawn when the node reboots).
//
// Everything here needs Linux and root; elsewhere the functions return
// NotSupported.
package nspawn

import (
	"path/filepath"
	"strings"
	"time"
)

// Options describe one container.
type Options struct {
	// Name is the machine name (-M), the name of its cgroup in every
	// hierarchy and of nspawn's propagation directory; required.
	Name string
	// Dir is the container's root directory (-D); required. Start does
	// not change it beyond what the booted system writes (use an overlay,
	// or --volatile=overlay in Extra, to keep a shared root clean).
	Dir string
	// NetNS is the path of the network namespace to join
	// (--network-namespace-path=), e.g. /run/netns/NAME. Empty gives the
	// container a network namespace of its own with only lo
	// (--private-network), unless HostNetwork is set.
	NetNS string
	// HostNetwork shares the caller's network namespace. The container
	// then gets nspawn's default capabilities and a read-only
	// /proc/sys/net, so it cannot change the host's network.
	HostNetwork bool
	// Binds are further --bind=SRC:DST or --bind-ro=SRC:DST arguments.
	Binds []string
	// Extra are further systemd-nspawn arguments (e.g. --volatile=overlay).
	Extra []string
	// Console is the file nspawn's output (the booted system's console)
	// is appended to; empty discards it.
	Console string
	// StopTimeout bounds the graceful power-off in Stop (default 45 s).
	StopTimeout time.Duration
}

// Args returns the systemd-nspawn arguments that boot o.Dir as machine
// o.Name: `-D DIR -M NAME -b --register=no --keep-unit` (no host systemd
// to register with), `--network-namespace-path=NETNS` (or
// `--private-network`), `--capability=all` (the network namespace path
// alone leaves out CAP_NET_ADMIN, which CNI, iptables and kube-proxy
// need), `--system-call-filter=@keyring` (runc joins a session keyring),
// `--resolv-conf=off --timezone=off --link-journal=no
// --console=read-only --bind=/dev/kmsg`, then o.Binds and o.Extra. With
// HostNetwork, neither a network flag nor `--capability=all`.
func Args(o Options) []string {
	args := []string{"-D", o.Dir, "-M", o.Name, "-b", "--register=no", "--keep-unit"}
	switch {
	case o.HostNetwork:
	case o.NetNS != "":
		args = append(args, "--network-namespace-path="+o.NetNS, "--capability=all")
	default:
		args = append(args, "--private-network", "--capability=all")
	}
	args = append(args, "--system-call-filter=@keyring", "--resolv-conf=off", "--timezone=off",
		"--link-journal=no", "--console=read-only", "--bind=/dev/kmsg")
	args = append(args, o.Binds...)
	return append(args, o.Extra...)
}

// Env returns the environment variables systemd-nspawn needs for o, to
// add to the caller's: SYSTEMD_NSPAWN_API_VFS_WRITABLE=network makes
// /proc/sys/net writable inside the container's own network namespace
// (none with HostNetwork).
func Env(o Options) []string {
	if o.HostNetwork {
		return nil
	}
	return []string{"SYSTEMD_NSPAWN_API_VFS_WRITABLE=network"}
}

// PropagateDir is the directory systemd-nspawn makes for machine name
// and, where /run is not a tmpfs, leaves behind when it exits.
func PropagateDir(name string) string {
	return filepath.Join("/run/systemd/nspawn/propagate", name)
}

// JoinScript is the shell line that moves the shell into the cgroups
// (procs from Create) before it execs nspawn, failing when one refuses.
// Equivalent to: `for p in PROCS...; do echo $$ > "$p" || exit 1; done`.
func JoinScript(procs []string) string {
	return "for p in " + ShellQuote(procs) + `; do echo $$ > "$p" || exit 1; done`
}

// ShellQuote quotes args for sh, each in single quotes.
func ShellQuote(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
	}
	return strings.Join(q, " ")
}
