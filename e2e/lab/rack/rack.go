// Package rack runs a lab rack on one Linux machine: an nftables guard
// that keeps lab traffic off the machine's uplink, a bridge on a lab-only
// subnet, N hosts (e2e/lab/netns machines, e2e/lab/qemu VMs with
// Backend "qemu", or e2e/lab/libvirt domains with Backend "libvirt") each
// behind its own Redfish emulator on loopback, and K more behind real
// ipmi_sim BMCs. VM hosts sit on the same bridge (a tap per VM) and get
// their addresses from a dnsmasq bound to that bridge only.
//
// The BMC emulators must outlive the command that starts the lab, so the
// lab is served by a long-running supervisor process (Serve; `kilnctl lab
// serve`), which Up starts in the background and waits for. Everything
// the lab creates — the nft table, the bridge, namespaces, veths, mounts,
// loop devices, cgroups and the PIDs of every process — is written to a
// state file in the state directory before it is created (processes right
// after they start), so Down can remove all of it even after the
// supervisor crashed. Status reads the state file.
//
// BMC credentials are generated per host and kept in credentials.json
// (mode 0600) in the state directory; they are lab-only, still they never
// go to logs or to the state file.
package rack

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kilnhq/kiln/e2e/lab/netns"
	"github.com/kilnhq/kiln/e2e/lab/redfish"
	"github.com/kilnhq/kiln/internal/atomicfile"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// File names in the state directory.
const (
	StateFile       = "state.json"
	CredentialsFile = "credentials.json"
	OptionsFile     = "options.json"
	ServeLog        = "serve.log"
	// CmdlineExtra, in a host's directory, is added to the kernel command
	// line of the host's next PXE or virtual-media boot (for a per-boot
	// token: "kiln.token=ID.SECRET").
	CmdlineExtra = "cmdline.extra"
)

// Resource kinds of the rack itself (besides netns' kinds).
const (
	KindNFT = "nft" // an nftables table: "inet kiln-lab-NAME"
	// KindDomain is a libvirt domain (its name) defined at the lab's
	// libvirtd (State.LibvirtSocket).
	KindDomain = "libvirt-domain"
	// KindDHCP is the lab's dnsmasq, by its configuration file: recorded
	// before dnsmasq starts (its PID is recorded after), so Down finds a
	// dnsmasq whose PID never reached the state file.
	KindDHCP = "dnsmasq"
)

// Machine backends.
const (
	BackendNetns = "netns" // network namespace + systemd-nspawn hosts (e2e/lab/netns)
	BackendQEMU  = "qemu"  // QEMU VMs (e2e/lab/qemu)
	// BackendLibvirt: libvirt domains (e2e/lab/libvirt) at the system
	// libvirtd when its socket answers, else at a private one.
	BackendLibvirt = "libvirt"
)

// isVM reports whether backend's hosts are VMs (qemu, libvirt): one
// virtio disk, SeaBIOS, a NIC on the lab bridge with its address from the
// lab's dnsmasq.
func isVM(backend string) bool { return backend == BackendQEMU || backend == BackendLibvirt }

// MaxQEMUHosts is how many QEMU (or libvirt) hosts a lab may have under
// TCG: this machine runs one busy VM at a time. KILN_QEMU_ACCEL=kvm lifts
// it.
const MaxQEMUHosts = 2

// Phases of a lab.
const (
	PhaseStarting = "starting"
	PhaseReady    = "ready"
	PhaseFailed   = "failed"
	PhaseStopped  = "stopped"
)

// BMC protocols.
const (
	ProtocolRedfish = "redfish"
	ProtocolIPMI    = "ipmi"
)

// Options configure a lab.
type Options struct {
	// Name of the lab: 1–8 lowercase letters or digits (default "kiln").
	Name string `json:"name"`
	// Hosts is the number of hosts behind Redfish emulators.
	Hosts int `json:"hosts"`
	// IPMI is the number of further hosts behind ipmi_sim BMCs.
	IPMI int `json:"ipmi"`
	// RedfishAuth is the authentication mode of each Redfish emulator in
	// host order: "both" (sessions and basic auth, the default for hosts
	// past the list's end), "basic" (no SessionService, basic auth only)
	// or "session" (basic auth refused). See redfish.Config.Auth.
	RedfishAuth []string `json:"redfishAuth,omitempty"`
	// Backend is the machine backend: "netns" (the default), "qemu" or
	// "libvirt" (at most MaxQEMUHosts hosts without KVM; on the lab
	// bridge, addresses from the lab's dnsmasq).
	Backend string `json:"backend"`
	// MemoryMB and CPUs of each VM host (default 1024 and 1; kubeadm's
	// preflight wants 2 CPUs and about 1700 MiB for a control plane).
	// VM backends only.
	MemoryMB int `json:"memoryMB,omitempty"`
	CPUs     int `json:"cpus,omitempty"`
	// StateDir holds the state file, credentials, host disks and logs
	// (default /var/lib/kiln/lab/NAME).
	StateDir string `json:"stateDir"`
	// Subnet is the lab's IPv4 /24 (default: a free 10.251.X.0/24); the
	// bridge takes .1, hosts .2 onwards.
	Subnet string `json:"subnet,omitempty"`
	// AgentBinary is the boot media's program: PXE and virtual-media
	// boots run `AGENT run --data-dir HOSTDIR/agent --file-targets` (the
	// disks are files). Empty: they boot nothing.
	AgentBinary string `json:"agentBinary,omitempty"`
	// ControllerURL and CAHash go on the boot agent's kernel command line
	// (kiln.controller=, kiln.ca_hash=). The controller must listen on
	// the bridge address to be reachable from the hosts.
	ControllerURL string `json:"controllerURL,omitempty"`
	CAHash        string `json:"caHash,omitempty"`
	// BootURL is the URL template of a host's iPXE script, for example
	// "http://{gateway}:8080/boot/ipxe/{host}" (the boot server's
	// /boot/ipxe/ route): {host} is the host's Host resource name
	// (ResourceName: NAME-hI), {gateway} the bridge address. When set, a
	// netns host's PXE boot fetches that script from inside its namespace
	// and boots the agent with the script's kernel arguments; empty keeps
	// the static command line (kiln.host=, kiln.controller=,
	// kiln.ca_hash=). Virtual-media boots always read the inserted ISO's
	// kernel command line. For VM hosts the lab's dnsmasq hands the
	// script's URL to their NIC's iPXE (so the template must end in
	// /boot/ipxe/{host}, the boot server's route).
	BootURL string `json:"bootURL,omitempty"`
	// APIServerLB runs the lab's load balancer for Kubernetes API servers
	// on the gateway (GATEWAY:6443, see LoadBalancer): a cluster's
	// controlPlaneEndpoint that survives control-plane replacement.
	APIServerLB bool `json:"apiServerLB,omitempty"`
	// DiskSize of each host's sparse disk (default 8 GiB).
	DiskSize int64 `json:"diskSize,omitempty"`
	// ServeCommand starts the supervisor, for example {"kilnctl", "lab",
	// "serve", "--state-dir", DIR}; ServeEnv is added to its environment.
	ServeCommand []string `json:"serveCommand"`
	ServeEnv     []string `json:"serveEnv,omitempty"`
	// ChassisCommand is the chassis_control program of the ipmi_sim BMCs
	// (kiln-chassis, or {"kilnctl", "lab", "chassis"}); required when
	// IPMI > 0.
	ChassisCommand []string `json:"chassisCommand,omitempty"`
	// ReadyTimeout bounds Up's wait for the supervisor (default 2 min; 10
	// min for libvirt, whose private libvirtd waits for another one to
	// stop).
	ReadyTimeout time.Duration `json:"readyTimeout,omitempty"`
}

// ResourceName is the Host resource name of host (h1, h2, ...) in lab:
// "LAB-HOST", e.g. "kiln-h1". It is the {host} of Options.BootURL, the
// kiln.host= of the static command line and what `kilnctl lab hosts`
// prints.
func ResourceName(lab, host string) string {
	if lab == "" {
		lab = "kiln"
	}
	return lab + "-" + host
}

// BootScriptURL expands an Options.BootURL template for one host.
func BootScriptURL(template, resource, gateway string) string {
	return strings.NewReplacer("{host}", resource, "{gateway}", gateway).Replace(template)
}

// DefaultStateDir is where a lab keeps its state unless told otherwise.
func DefaultStateDir(name string) string {
	if name == "" {
		name = "kiln"
	}
	return filepath.Join("/var/lib/kiln/lab", name)
}

func (o *Options) defaults() error {
	if o.Name == "" {
		o.Name = "kiln"
	}
	if len(o.Name) > 8 {
		return errdefs.InvalidArgument("lab name %q: at most 8 characters (it names interfaces)", o.Name)
	}
	for _, r := range o.Name {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9') {
			return errdefs.InvalidArgument("lab name %q: lowercase letters and digits only", o.Name)
		}
	}
	if o.Backend == "" {
		o.Backend = "netns"
	}
	if o.Backend != BackendNetns && !isVM(o.Backend) {
		return errdefs.NotSupported("lab backend %q: want netns, qemu or libvirt", o.Backend)
	}
	if o.Hosts < 0 || o.IPMI < 0 || o.Hosts+o.IPMI == 0 || o.Hosts+o.IPMI > 200 {
		return errdefs.InvalidArgument("lab: %d Redfish and %d IPMI hosts: want 1 to 200 in all", o.Hosts, o.IPMI)
	}
	if len(o.RedfishAuth) > o.Hosts {
		return errdefs.InvalidArgument("lab: %d Redfish auth modes for %d Redfish hosts", len(o.RedfishAuth), o.Hosts)
	}
	for _, a := range o.RedfishAuth {
		switch a {
		case redfish.AuthBoth, redfish.AuthBasicOnly, redfish.AuthSessionOnly:
		default:
			return errdefs.InvalidArgument("lab: Redfish auth %q: want both, basic or session", a)
		}
	}
	if isVM(o.Backend) && o.Hosts+o.IPMI > MaxQEMUHosts && os.Getenv("KILN_QEMU_ACCEL") != "kvm" {
		return errdefs.InvalidArgument("lab: %d %s hosts: at most %d under TCG emulation (a TCG VM takes a core; KVM lifts the limit: KILN_QEMU_ACCEL=kvm)", o.Hosts+o.IPMI, o.Backend, MaxQEMUHosts)
	}
	if o.BootURL != "" {
		u, err := url.Parse(BootScriptURL(o.BootURL, "kiln-h1", "10.251.0.1"))
		switch {
		case err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "":
			return errdefs.InvalidArgument("lab boot URL %q: want an http(s) URL such as http://{gateway}:8080/boot/ipxe/{host}", o.BootURL)
		case !strings.Contains(o.BootURL, "{host}"):
			return errdefs.InvalidArgument("lab boot URL %q: {host} (the Host resource name) is missing: every host would boot the same script", o.BootURL)
		case isVM(o.Backend) && !strings.HasSuffix(u.Path, "/boot/ipxe/kiln-h1"):
			return errdefs.InvalidArgument("lab boot URL %q: %s hosts PXE boot through the lab's dnsmasq, which hands iPXE the boot server's script: want http://{gateway}:PORT/boot/ipxe/{host}", o.BootURL, o.Backend)
		}
	}
	if o.IPMI > 0 && len(o.ChassisCommand) == 0 {
		return errdefs.InvalidArgument("lab: IPMI hosts need a chassis command (kiln-chassis)")
	}
	if o.StateDir == "" {
		o.StateDir = DefaultStateDir(o.Name)
	}
	if !filepath.IsAbs(o.StateDir) {
		abs, err := filepath.Abs(o.StateDir)
		if err != nil {
			return fmt.Errorf("lab: state dir: %w", err)
		}
		o.StateDir = abs
	}
	if o.DiskSize == 0 {
		o.DiskSize = 8 << 30
	}
	if o.MemoryMB < 0 || o.CPUs < 0 || (o.MemoryMB > 0 || o.CPUs > 0) && !isVM(o.Backend) {
		return errdefs.InvalidArgument("lab: memory %d MiB, %d CPUs: for the qemu and libvirt backends only", o.MemoryMB, o.CPUs)
	}
	if isVM(o.Backend) {
		if o.MemoryMB == 0 {
			o.MemoryMB = 1024
		}
		if o.CPUs == 0 {
			o.CPUs = 1
		}
	}
	if o.ReadyTimeout == 0 {
		o.ReadyTimeout = 2 * time.Minute
		if o.Backend == BackendLibvirt {
			// A private libvirtd waits for another one to stop
			// (libvirt.LockFile).
			o.ReadyTimeout = 10 * time.Minute
		}
	}
	return nil
}

// State is the lab as recorded in the state file.
type State struct {
	Name    string `json:"name"`
	Backend string `json:"backend"`
	Phase   string `json:"phase"`
	// Error says why the lab failed to come up.
	Error string `json:"error,omitempty"`
	// Serve is the supervisor's process ("PID:STARTTIME").
	Serve    string `json:"serve,omitempty"`
	NFTTable string `json:"nftTable,omitempty"`
	// Uplink is the interface the guard keeps lab traffic off.
	Uplink  string `json:"uplink,omitempty"`
	Bridge  string `json:"bridge,omitempty"`
	Subnet  string `json:"subnet,omitempty"`
	Gateway string `json:"gateway,omitempty"`
	// APIServer is the API load balancer's address (Options.APIServerLB).
	APIServer string `json:"apiServer,omitempty"`
	// DHCP is the lab's dnsmasq on the bridge ("PID:STARTTIME"; VM
	// backends), its process also a resource.
	DHCP string `json:"dhcp,omitempty"`
	// LibvirtSocket is the libvirtd of a libvirt lab; LibvirtPrivate says
	// it is a private one the supervisor started (its PID is a resource).
	LibvirtSocket  string `json:"libvirtSocket,omitempty"`
	LibvirtPrivate bool   `json:"libvirtPrivate,omitempty"`
	Hosts          []Host `json:"hosts,omitempty"`
	// Resources is everything created, in order of creation.
	Resources []netns.Resource `json:"resources,omitempty"`
	Updated   time.Time        `json:"updated"`
}

// Host is one lab host.
type Host struct {
	// Name is the host's name in the lab (h1, h2, ...): its directory,
	// namespace and credentials key.
	Name string `json:"name"`
	// Resource is the name of its Host resource and of its boot media at
	// the boot server (kiln.host=): ResourceName(lab, Name).
	Resource  string `json:"resource"`
	Namespace string `json:"namespace"`
	Machine   string `json:"machine"`
	Address   string `json:"address"`
	MAC       string `json:"mac"`
	Disk      string `json:"disk"`
	Dir       string `json:"dir"`
	BMC       BMC    `json:"bmc"`
}

// BMC is how to reach a host's emulated BMC.
type BMC struct {
	Protocol string `json:"protocol"`
	// Address is the Redfish base URL or the IPMI host:port.
	Address string `json:"address,omitempty"`
	// Insecure: the Redfish emulator's certificate is self-signed.
	Insecure bool `json:"insecure,omitempty"`
	// Auth is the Redfish emulator's authentication mode ("both", "basic"
	// or "session").
	Auth string `json:"auth,omitempty"`
}

// Credentials are a BMC's user and password.
type Credentials struct {
	Username string `json:"username"`
	Password string `json:"password"`
}

// ReadState reads the state file of the lab in dir. It returns NotFound
// when there is none.
func ReadState(dir string) (*State, error) {
	b, err := os.ReadFile(filepath.Join(dir, StateFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil, errdefs.NotFound("no lab in %s (no %s)", dir, StateFile)
	}
	if err != nil {
		return nil, fmt.Errorf("lab state: %w", err)
	}
	var s State
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("lab state %s: %w", filepath.Join(dir, StateFile), err)
	}
	return &s, nil
}

// ReadCredentials reads the BMC credentials of the lab in dir, by host.
func ReadCredentials(dir string) (map[string]Credentials, error) {
	b, err := os.ReadFile(filepath.Join(dir, CredentialsFile))
	if errors.Is(err, os.ErrNotExist) {
		return map[string]Credentials{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("lab credentials: %w", err)
	}
	c := map[string]Credentials{}
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, fmt.Errorf("lab credentials: %w", err)
	}
	return c, nil
}

// writeJSON writes v to path atomically with mode perm.
func writeJSON(path string, v any, perm os.FileMode) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return atomicfile.Write(path, append(b, '\n'), perm)
}

// Report is a lab's state as Status and Up return it.
type Report struct {
	*State
	// Running: the supervisor process is alive.
	Running bool
	// Credentials of each host's BMC, by host name.
	Credentials map[string]Credentials
}

// Status reads the lab in dir. It returns NotFound when there is none.
func Status(dir string) (*Report, error) {
	st, err := ReadState(dir)
	if err != nil {
		return nil, err
	}
	creds, err := ReadCredentials(dir)
	if err != nil {
		return nil, err
	}
	return &Report{State: st, Running: st.Serve != "" && netns.ProcessAlive(st.Serve), Credentials: creds}, nil
}
