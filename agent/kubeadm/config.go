package kubeadm

import (
	"fmt"
	"net"
	"regexp"
	"strings"
	"unicode"
	"unicode/utf8"

	"sigs.k8s.io/yaml"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// Defaults written into the generated configuration.
const (
	// CRISocket is containerd's CRI endpoint.
	CRISocket = "unix:///run/containerd/containerd.sock"
	// KubeletResolvConf is the resolv.conf the kubelet gives pods with
	// dnsPolicy Default and CoreDNS for upstream queries. Kiln creates it
	// empty when it is missing (no upstream resolver: cluster DNS never
	// asks outside); an operator who wants upstream DNS writes nameservers
	// into it.
	KubeletResolvConf = "/etc/kiln/kubelet-resolv.conf"
	// DefaultCgroupDriver is the kubelet's cgroup driver when the cluster
	// does not name one (kubeadm's default too).
	DefaultCgroupDriver = "systemd"
	// DefaultDNSDomain is the cluster's DNS domain when none is given.
	DefaultDNSDomain = "cluster.local"
	// APIServerPort is the API server's bind port.
	APIServerPort = 6443
	// UninitializedTaint marks a node an external cloud provider has not
	// initialised yet.
	UninitializedTaint = "node.cloudprovider.kubernetes.io/uninitialized"
)

// Roles of ClusterConfig.Role.
const (
	RoleControlPlane = "control-plane"
	RoleWorker       = "worker"
)

var (
	versionRE = regexp.MustCompile(`^v(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$`)
	tokenRE   = regexp.MustCompile(`^[a-z0-9]{6}\.[a-z0-9]{16}$`)
	certKeyRE = regexp.MustCompile(`^[a-f0-9]{64}$`)
	// nodeNameRE is a DNS-1123 subdomain, as Kubernetes requires of node names.
	nodeNameRE = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)
)

// ValidateVersion returns nil when v is a pinned release version of the
// form vX.Y.Z, and an InvalidArgument error otherwise: an empty version,
// "stable", "latest" or a label would make kubeadm look the version up on
// the internet, which Kiln never does.
func ValidateVersion(v string) error {
	if v == "" {
		return errdefs.InvalidArgument("kubernetes version is empty: it must be pinned (vX.Y.Z), never looked up")
	}
	if !versionRE.MatchString(v) {
		return errdefs.InvalidArgument("kubernetes version %q: want a pinned release vX.Y.Z (labels such as stable or latest are never looked up)", v)
	}
	return nil
}

// ValidateToken returns an InvalidArgument error unless t has the form
// of a bootstrap token, [a-z0-9]{6}.[a-z0-9]{16}. The token is not echoed.
func ValidateToken(t string) error {
	if !tokenRE.MatchString(t) {
		return errdefs.InvalidArgument("join token is malformed: want the form [a-z0-9]{6}.[a-z0-9]{16}")
	}
	return nil
}

// validateCluster checks the fields every generated configuration uses.
func validateCluster(c *agentv1.ClusterConfig) error {
	if c == nil {
		return errdefs.InvalidArgument("cluster is required")
	}
	if err := ValidateVersion(c.GetKubernetesVersion()); err != nil {
		return err
	}
	// Free-text fields go into the YAML kubeadm reads: text only, so that
	// what kubeadm reads is what was sent (invalid UTF-8 became U+FFFD;
	// found by FuzzConfig).
	for _, f := range []struct{ name, v string }{
		{"cluster name", c.GetName()}, {"control-plane endpoint", c.GetControlPlaneEndpoint()},
		{"DNS domain", c.GetDnsDomain()}, {"image repository", c.GetImageRepository()},
	} {
		if !utf8.ValidString(f.v) || strings.ContainsFunc(f.v, unicode.IsControl) {
			return errdefs.InvalidArgument("%s %q: holds invalid UTF-8 or control characters", f.name, f.v)
		}
	}
	if ep := c.GetControlPlaneEndpoint(); ep != "" && validateEndpoint(ep) != nil &&
		net.ParseIP(strings.Trim(ep, "[]")) == nil && strings.ContainsAny(ep, " :/[]") {
		return errdefs.InvalidArgument("control-plane endpoint %q: want host or host:port", ep)
	}
	if n := c.GetNodeName(); n != "" && (len(n) > 253 || !nodeNameRE.MatchString(n)) {
		return errdefs.InvalidArgument("node name %q: want a lower-case DNS-1123 subdomain", n)
	}
	if a := c.GetAdvertiseAddress(); a != "" && net.ParseIP(a) == nil {
		return errdefs.InvalidArgument("advertise address %q: want an IP address", a)
	}
	for _, f := range []struct{ name, v string }{{"pod CIDR", c.GetPodCidr()}, {"service CIDR", c.GetServiceCidr()}} {
		if f.v == "" {
			continue
		}
		if _, _, err := net.ParseCIDR(f.v); err != nil {
			return errdefs.InvalidArgument("%s %q: want a CIDR such as 10.244.0.0/16", f.name, f.v)
		}
	}
	switch c.GetCgroupDriver() {
	case "", "systemd", "cgroupfs":
	default:
		return errdefs.InvalidArgument("cgroup driver %q: want systemd or cgroupfs", c.GetCgroupDriver())
	}
	switch c.GetCloudProvider() {
	case "", "external":
	default:
		return errdefs.InvalidArgument("cloud provider %q: only \"external\" (a cloud-controller-manager) or none is supported", c.GetCloudProvider())
	}
	switch c.GetRole() {
	case "", RoleControlPlane, RoleWorker:
	default:
		return errdefs.InvalidArgument("role %q: want %s or %s", c.GetRole(), RoleControlPlane, RoleWorker)
	}
	return nil
}

// The kubeadm v1beta4 and kubelet v1beta1 documents Kiln writes. Only the
// fields Kiln sets are modelled; kubeadm defaults the rest.

type typeMeta struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
}

type arg struct {
	Name  string `json:"name"`
	Value string `json:"value"`
}

type nodeRegistration struct {
	Name             string `json:"name,omitempty"`
	CRISocket        string `json:"criSocket"`
	ImagePullPolicy  string `json:"imagePullPolicy"`
	KubeletExtraArgs []arg  `json:"kubeletExtraArgs,omitempty"`
}

type apiEndpoint struct {
	AdvertiseAddress string `json:"advertiseAddress,omitempty"`
	BindPort         int    `json:"bindPort"`
}

// patches is kubeadm's patches option: a directory of patch files named
// target[suffix][+patchtype].extension (kubeletconfiguration+merge.yaml).
type patches struct {
	Directory string `json:"directory"`
}

// timeouts is kubeadm's timeouts option (v1beta4).
type timeouts struct {
	ControlPlaneComponentHealthCheck string `json:"controlPlaneComponentHealthCheck"`
	KubeletHealthCheck               string `json:"kubeletHealthCheck"`
}

// HealthCheckTimeout is how long kubeadm init and join wait for the
// kubelet and for the control-plane components to answer (kubeadm's
// default: 4 minutes each). A TCG VM's API server took longer than 4
// minutes (TestVMEndToEnd: "kube-apiserver check failed at
// https://...:6443/livez: context deadline exceeded"), and a failed init
// leaves the static pods running, so that every retry's preflight finds
// their ports in use. On a healthy machine the wait ends in seconds;
// only a broken one waits the longer time out.
const HealthCheckTimeout = "10m0s"

func healthTimeouts() *timeouts {
	return &timeouts{ControlPlaneComponentHealthCheck: HealthCheckTimeout, KubeletHealthCheck: HealthCheckTimeout}
}

type initConfiguration struct {
	typeMeta         `json:",inline"`
	LocalAPIEndpoint *apiEndpoint     `json:"localAPIEndpoint,omitempty"`
	NodeRegistration nodeRegistration `json:"nodeRegistration"`
	CertificateKey   string           `json:"certificateKey,omitempty"`
	Patches          *patches         `json:"patches,omitempty"`
	Timeouts         *timeouts        `json:"timeouts,omitempty"`
}

type networking struct {
	PodSubnet     string `json:"podSubnet,omitempty"`
	ServiceSubnet string `json:"serviceSubnet,omitempty"`
	DNSDomain     string `json:"dnsDomain"`
}

type controlPlaneComponent struct {
	ExtraArgs []arg `json:"extraArgs,omitempty"`
}

type clusterConfiguration struct {
	typeMeta             `json:",inline"`
	KubernetesVersion    string                 `json:"kubernetesVersion"`
	ClusterName          string                 `json:"clusterName,omitempty"`
	ControlPlaneEndpoint string                 `json:"controlPlaneEndpoint,omitempty"`
	ImageRepository      string                 `json:"imageRepository,omitempty"`
	Networking           networking             `json:"networking"`
	ControllerManager    *controlPlaneComponent `json:"controllerManager,omitempty"`
}

type kubeletConfiguration struct {
	typeMeta     `json:",inline"`
	CgroupDriver string `json:"cgroupDriver"`
	FailSwapOn   bool   `json:"failSwapOn"`
	FailCgroupV1 bool   `json:"failCgroupV1"`
	ResolvConf   string `json:"resolvConf"`
}

type kubeProxyConfiguration struct {
	typeMeta  `json:",inline"`
	Mode      string `json:"mode"`
	Conntrack struct {
		// MaxPerCore 0 leaves nf_conntrack_max as the host has it:
		// Prepare owns sysctls, and a node in a container cannot set it.
		MaxPerCore int `json:"maxPerCore"`
	} `json:"conntrack"`
}

type bootstrapTokenDiscovery struct {
	APIServerEndpoint string   `json:"apiServerEndpoint"`
	Token             string   `json:"token"`
	CACertHashes      []string `json:"caCertHashes"`
}

type joinControlPlane struct {
	LocalAPIEndpoint *apiEndpoint `json:"localAPIEndpoint,omitempty"`
	CertificateKey   string       `json:"certificateKey"`
}

type joinConfiguration struct {
	typeMeta  `json:",inline"`
	Discovery struct {
		BootstrapToken bootstrapTokenDiscovery `json:"bootstrapToken"`
	} `json:"discovery"`
	NodeRegistration nodeRegistration  `json:"nodeRegistration"`
	ControlPlane     *joinControlPlane `json:"controlPlane,omitempty"`
	Patches          *patches          `json:"patches,omitempty"`
	Timeouts         *timeouts         `json:"timeouts,omitempty"`
}

const (
	kubeadmAPI = "kubeadm.k8s.io/v1beta4"
	kubeletAPI = "kubelet.config.k8s.io/v1beta1"
	proxyAPI   = "kubeproxy.config.k8s.io/v1alpha1"
)

func nodeReg(c *agentv1.ClusterConfig) nodeRegistration {
	nr := nodeRegistration{Name: c.GetNodeName(), CRISocket: CRISocket, ImagePullPolicy: "Never"}
	if a := c.GetAdvertiseAddress(); a != "" {
		nr.KubeletExtraArgs = append(nr.KubeletExtraArgs, arg{"node-ip", a})
	}
	if c.GetCloudProvider() == "external" {
		nr.KubeletExtraArgs = append(nr.KubeletExtraArgs, arg{"cloud-provider", "external"})
	}
	return nr
}

// patchesOpt is kubeadm's patches option for dir, or nil when dir is
// empty.
func patchesOpt(dir string) *patches {
	if dir == "" {
		return nil
	}
	return &patches{Directory: dir}
}

// InitConfig returns the kubeadm configuration (InitConfiguration,
// ClusterConfiguration, KubeletConfiguration, KubeProxyConfiguration) for
// `kubeadm init` of cluster c. certKey, when not empty, is the key that
// encrypts the control-plane certificates uploaded for joining control
// planes (64 hex digits). patchDir, when not empty, is the directory of
// kubeadm patch files (kubeadm applies them to the components and the
// kubelet configuration it writes on this node). It returns
// InvalidArgument for an unpinned version or a malformed field.
func InitConfig(c *agentv1.ClusterConfig, certKey, patchDir string) ([]byte, error) {
	if err := validateCluster(c); err != nil {
		return nil, err
	}
	if certKey != "" && !certKeyRE.MatchString(certKey) {
		return nil, errdefs.InvalidArgument("certificate key is malformed: want 64 hex digits")
	}
	ic := initConfiguration{
		typeMeta:         typeMeta{kubeadmAPI, "InitConfiguration"},
		NodeRegistration: nodeReg(c),
		CertificateKey:   certKey,
		Patches:          patchesOpt(patchDir),
		Timeouts:         healthTimeouts(),
	}
	if a := c.GetAdvertiseAddress(); a != "" {
		ic.LocalAPIEndpoint = &apiEndpoint{AdvertiseAddress: a, BindPort: APIServerPort}
	}
	domain := c.GetDnsDomain()
	if domain == "" {
		domain = DefaultDNSDomain
	}
	cc := clusterConfiguration{
		typeMeta:             typeMeta{kubeadmAPI, "ClusterConfiguration"},
		KubernetesVersion:    c.GetKubernetesVersion(),
		ClusterName:          c.GetName(),
		ControlPlaneEndpoint: c.GetControlPlaneEndpoint(),
		ImageRepository:      c.GetImageRepository(),
		Networking:           networking{PodSubnet: c.GetPodCidr(), ServiceSubnet: c.GetServiceCidr(), DNSDomain: domain},
	}
	if c.GetCloudProvider() == "external" {
		cc.ControllerManager = &controlPlaneComponent{ExtraArgs: []arg{{"cloud-provider", "external"}}}
	}
	driver := c.GetCgroupDriver()
	if driver == "" {
		driver = DefaultCgroupDriver
	}
	kc := kubeletConfiguration{
		typeMeta:     typeMeta{kubeletAPI, "KubeletConfiguration"},
		CgroupDriver: driver,
		FailSwapOn:   false,
		FailCgroupV1: false,
		ResolvConf:   KubeletResolvConf,
	}
	pc := kubeProxyConfiguration{typeMeta: typeMeta{proxyAPI, "KubeProxyConfiguration"}, Mode: "iptables"}
	return documents(ic, cc, kc, pc)
}

// JoinRequest is what JoinConfig needs besides the cluster.
type JoinRequest struct {
	APIServerEndpoint string
	Token             string
	CAHash            string
	ControlPlane      bool
	CertificateKey    string
	// PatchDir, when not empty, is the directory of kubeadm patch files
	// (see InitConfig).
	PatchDir string
}

// JoinConfig returns the JoinConfiguration for `kubeadm join` of a node of
// cluster c. It returns InvalidArgument for an unpinned version, a
// malformed token or CA hash, or a control-plane join without a
// certificate key. Secrets are never part of an error.
func JoinConfig(c *agentv1.ClusterConfig, r JoinRequest) ([]byte, error) {
	if err := validateCluster(c); err != nil {
		return nil, err
	}
	if err := validateEndpoint(r.APIServerEndpoint); err != nil {
		return nil, err
	}
	if err := ValidateToken(r.Token); err != nil {
		return nil, err
	}
	if _, err := pki.ParseHash(r.CAHash); err != nil {
		return nil, err
	}
	jc := joinConfiguration{
		typeMeta:         typeMeta{kubeadmAPI, "JoinConfiguration"},
		NodeRegistration: nodeReg(c),
		Patches:          patchesOpt(r.PatchDir),
		Timeouts:         healthTimeouts(),
	}
	jc.Discovery.BootstrapToken = bootstrapTokenDiscovery{
		APIServerEndpoint: r.APIServerEndpoint,
		Token:             r.Token,
		CACertHashes:      []string{r.CAHash},
	}
	if r.ControlPlane {
		if !certKeyRE.MatchString(r.CertificateKey) {
			return nil, errdefs.InvalidArgument("control-plane join: certificate key is missing or malformed: want the 64 hex digits init returned")
		}
		jc.ControlPlane = &joinControlPlane{CertificateKey: r.CertificateKey}
		if a := c.GetAdvertiseAddress(); a != "" {
			jc.ControlPlane.LocalAPIEndpoint = &apiEndpoint{AdvertiseAddress: a, BindPort: APIServerPort}
		}
	}
	return documents(jc)
}

// validateEndpoint wants host:port.
func validateEndpoint(ep string) error {
	host, port, err := net.SplitHostPort(ep)
	if err != nil || host == "" || port == "" {
		return errdefs.InvalidArgument("API server endpoint %q: want host:port", ep)
	}
	return nil
}

// documents marshals each value as one YAML document.
func documents(docs ...any) ([]byte, error) {
	var parts []string
	for _, d := range docs {
		b, err := yaml.Marshal(d)
		if err != nil {
			return nil, fmt.Errorf("marshal %T: %w", d, err)
		}
		parts = append(parts, string(b))
	}
	return []byte(strings.Join(parts, "---\n")), nil
}
