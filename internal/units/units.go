// Package units holds Kiln's systemd units, one text per daemon: the
// agent's (kiln-agent.service: shipped by the kiln-agent package, written
// by `kiln-agent enroll --install-unit` and baked into golden images) and
// the controller's (kiln-controller.service, in the kiln-controller
// package). Each is rendered from a few options; the sandboxing
// directives and the reasons for them are the same everywhere
// (docs/security.md, "systemd sandboxing").
//
// The units are written with fmt, not text/template: the agent links this
// package, and executing a template makes the linker keep every exported
// method of every type in the binary (docs/bench/agent.md).
package units

import (
	"fmt"
	"strings"
)

// Unit names.
const (
	AgentName      = "kiln-agent.service"
	ControllerName = "kiln-controller.service"
)

// Defaults of the packaged daemons: binaries, data directories, listen
// addresses and environment files (the packages' conffiles).
const (
	AgentExec           = "/usr/bin/kiln-agent"
	AgentDataDir        = "/var/lib/kiln-agent"
	AgentListen         = ":7441"
	AgentEnvFile        = "/etc/kiln/agent.env"
	ControllerExec      = "/usr/bin/kiln-controller"
	ControllerDataDir   = "/var/lib/kiln-controller"
	ControllerEnvFile   = "/etc/kiln/controller.env"
	AgentWatchdog       = "60s"
	documentationPrefix = "https://github.com/kilnhq/kiln/blob/main/docs/"
)

// Agent are the options of the agent's unit.
type Agent struct {
	// Exec is the agent binary (default AgentExec).
	Exec string
	// DataDir is the identity and journal directory (default AgentDataDir).
	DataDir string
	// Listen is the agent API address (default AgentListen).
	Listen string
	// Root is the host's root as the agent sees it; "" and "/" add no
	// --root flag.
	Root string
}

// AgentUnit returns kiln-agent.service for o: `kiln-agent run` with o's
// data directory, listen address and root, systemctl as its reboot and
// power-off commands, and $KILN_AGENT_ARGS from AgentEnvFile (optional)
// appended. Type=notify: the agent says READY=1 once it serves, and pets
// the watchdog (WatchdogSec=AgentWatchdog) while it runs.
//
// The agent is privileged by design: it partitions and writes disks,
// loads kernel modules, sets sysctls, writes /etc (modules-load.d,
// sysctl.d, fstab, containerd's config), talks to systemd over D-Bus and
// runs kubeadm. So it keeps root, the devices, /etc, /var, the kernel
// tunables and modules; it loses what none of that uses: the clock,
// ptrace and other debugging calls, raw port I/O, obsolete system calls,
// real-time scheduling, set-user-ID files, personality changes, user,
// PID, IPC, cgroup and UTS namespaces, writable /usr and /boot, /home, a
// shared /tmp, and the capabilities listed in agentDroppedCaps.
func AgentUnit(o Agent) []byte {
	if o.Exec == "" {
		o.Exec = AgentExec
	}
	if o.DataDir == "" {
		o.DataDir = AgentDataDir
	}
	if o.Listen == "" {
		o.Listen = AgentListen
	}
	root := ""
	if o.Root != "" && o.Root != "/" {
		root = " --root " + o.Root
	}
	var b strings.Builder
	fmt.Fprintf(&b, `[Unit]
Description=Kiln host agent
Documentation=%sagent.md
Wants=network-online.target
After=network-online.target

[Service]
Type=notify
NotifyAccess=main
EnvironmentFile=-%s
ExecStart=%s run --data-dir %s --listen %s%s --reboot-command "systemctl reboot" --poweroff-command "systemctl poweroff" $KILN_AGENT_ARGS
Restart=always
RestartSec=5
# run enrolls first when the data directory holds no identity (boot
# media, KILN_AGENT_ARGS with --controller/--token-file/--ca-hash) and
# waits for the controller meanwhile; READY=1 comes once it serves.
TimeoutStartSec=infinity
WatchdogSec=%s
# Sandboxing (docs/security.md): privileged, but only as far as the
# agent's work needs.
ProtectSystem=yes
ProtectHome=read-only
PrivateTmp=yes
ProtectKernelLogs=yes
# No ProtectControlGroups: kubeadm's preflight (SystemVerification)
# creates a cgroup under /sys/fs/cgroup to find the cgroup v2 freezer,
# and refuses "missing required cgroups: freezer" when it cannot.
NoNewPrivileges=yes
RestrictSUIDSGID=yes
RestrictRealtime=yes
LockPersonality=yes
MemoryDenyWriteExecute=yes
SystemCallArchitectures=native
SystemCallFilter=~@clock @cpu-emulation @debug @obsolete @raw-io
SystemCallErrorNumber=EPERM
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
RestrictNamespaces=~user pid ipc cgroup uts
CapabilityBoundingSet=~%s
UMask=0022

[Install]
WantedBy=multi-user.target
`, documentationPrefix, AgentEnvFile, o.Exec, o.DataDir, o.Listen, root, AgentWatchdog, strings.Join(agentDroppedCaps, " "))
	return []byte(b.String())
}

// agentDroppedCaps are the capabilities the agent's work never uses.
var agentDroppedCaps = []string{
	"CAP_SYS_TIME", "CAP_WAKE_ALARM", "CAP_SYS_PACCT", "CAP_SYS_TTY_CONFIG",
	"CAP_MAC_ADMIN", "CAP_MAC_OVERRIDE", "CAP_LINUX_IMMUTABLE", "CAP_LEASE",
	"CAP_SYSLOG", "CAP_AUDIT_CONTROL", "CAP_AUDIT_READ", "CAP_BLOCK_SUSPEND",
	"CAP_SYS_PTRACE", "CAP_BPF", "CAP_PERFMON", "CAP_CHECKPOINT_RESTORE",
	"CAP_IPC_OWNER", "CAP_IPC_LOCK", "CAP_SYS_NICE", "CAP_MKNOD", "CAP_SYS_CHROOT",
	"CAP_NET_RAW", "CAP_NET_BROADCAST",
}

// ControllerUnit returns kiln-controller.service: `kiln-controller run`
// with its data directory in ControllerDataDir (systemd's
// StateDirectory=, mode 0700) and $KILN_CONTROLLER_ARGS from
// ControllerEnvFile (optional). Type=notify: READY=1 once the API serves.
//
// The controller needs its data directory, the network (its API, the
// agents, the BMCs, the boot server) and read access to boot media and
// images: it runs as a dynamic unprivileged user, with no capability but
// binding a port below 1024 (a boot server on :80), no devices, a
// read-only system, no kernel or cgroup access, no new namespaces, and
// only the system calls of an ordinary network service.
func ControllerUnit() []byte {
	var b strings.Builder
	fmt.Fprintf(&b, `[Unit]
Description=Kiln controller
Documentation=%scontroller.md
Wants=network-online.target
After=network-online.target

[Service]
Type=notify
NotifyAccess=main
EnvironmentFile=-%s
ExecStart=%s run --data-dir %s $KILN_CONTROLLER_ARGS
Restart=on-failure
RestartSec=5
LimitNOFILE=65536
# Sandboxing (docs/security.md): the data directory, the network, and
# nothing else. DynamicUser= implies ProtectSystem=strict,
# ProtectHome=read-only, PrivateTmp=, RemoveIPC=, NoNewPrivileges= and
# RestrictSUIDSGID=.
DynamicUser=yes
StateDirectory=kiln-controller
StateDirectoryMode=0700
UMask=0077
CapabilityBoundingSet=CAP_NET_BIND_SERVICE
AmbientCapabilities=CAP_NET_BIND_SERVICE
PrivateDevices=yes
DevicePolicy=closed
ProtectClock=yes
ProtectHostname=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectProc=invisible
ProcSubset=pid
RestrictNamespaces=yes
RestrictRealtime=yes
LockPersonality=yes
MemoryDenyWriteExecute=yes
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged
SystemCallErrorNumber=EPERM
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK

[Install]
WantedBy=multi-user.target
`, documentationPrefix, ControllerEnvFile, ControllerExec, ControllerDataDir)
	return []byte(b.String())
}

// AgentEnv is the default AgentEnvFile, a conffile of the kiln-agent
// package.
const AgentEnv = `# Extra arguments of kiln-agent run (kiln-agent.service), e.g.
#   KILN_AGENT_ARGS="--metrics-listen 127.0.0.1:7442 --log-level debug"
# The unit already passes --data-dir /var/lib/kiln-agent --listen :7441 and
# systemctl as the reboot and power-off commands. Enroll first:
#   kiln-agent enroll --controller ADDR --token-file FILE --ca-hash sha256:... --install-unit
# (docs/packages.md). Then: systemctl restart kiln-agent
KILN_AGENT_ARGS=
`

// ControllerEnv is the default ControllerEnvFile, a conffile of the
// kiln-controller package.
const ControllerEnv = `# Extra arguments of kiln-controller run (kiln-controller.service), e.g.
#   KILN_CONTROLLER_ARGS="--server-name kiln.example.org --metrics-listen 127.0.0.1:9443"
# The unit already passes --data-dir /var/lib/kiln-controller; the API
# listens on :7443 unless --listen says otherwise (docs/controller.md).
# Then: systemctl restart kiln-controller
KILN_CONTROLLER_ARGS=
`
