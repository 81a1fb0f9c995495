// Package validation decides whether a resource may be stored: the rules a
// resource must satisfy on its own (Validate) and the rules that depend on
// objects already in the store (ValidateAgainst). The controller calls both
// in Apply; kilnctl calls Validate before sending anything so a bad file is
// refused locally with the same message.
//
// Every problem found in one resource is reported in one
// errdefs.InvalidArgument error, each naming the field (in the YAML spelling
// kilnctl reads, e.g. spec.podCidr) and how to fix it.
package validation

import (
	"fmt"
	"slices"
	"strings"

	"github.com/kilnhq/kiln/internal/diskhint"
	"github.com/kilnhq/kiln/internal/errdefs"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// APIVersion is the only apiVersion resources carry.
const APIVersion = "kiln.dev/v1"

// FieldError is one problem with one field of a resource.
type FieldError struct {
	// Field is the path in YAML spelling: "spec.podCidr",
	// "spec.unhealthyConditions[0].timeout".
	Field string
	// Message says what is wrong and how to fix it.
	Message string
}

// Error is the error Validate and ValidateAgainst return: every problem
// of one resource. It is of class errdefs.ErrInvalidArgument.
type Error struct {
	Kind, Name string
	Fields     []FieldError
}

// Error returns `Kind "name" is invalid: field: message; field: message`.
func (e *Error) Error() string {
	name := e.Name
	if name == "" {
		name = "(unnamed)"
	}
	parts := make([]string, len(e.Fields))
	for i, f := range e.Fields {
		parts[i] = f.Field + ": " + f.Message
	}
	return fmt.Sprintf("%s %q is invalid: %s", e.Kind, name, strings.Join(parts, "; "))
}

// Is makes errdefs.IsInvalidArgument(e) true.
func (e *Error) Is(target error) bool { return target == errdefs.ErrInvalidArgument }

// problems collects the findings for one resource.
type problems []FieldError

func (p *problems) add(field, format string, args ...any) {
	*p = append(*p, FieldError{Field: field, Message: fmt.Sprintf(format, args...)})
}

// err returns nil when there are no problems, else an *Error naming the
// resource and listing every problem.
func (p problems) err(kind, name string) error {
	if len(p) == 0 {
		return nil
	}
	return &Error{Kind: kind, Name: name, Fields: p}
}

// Validate checks r on its own: names, formats, ranges and the rules of
// each kind. It returns nil or an *Error (class errdefs.InvalidArgument)
// listing every problem of r; a Resource with no kind set is a plain
// InvalidArgument error. It does no I/O.
func Validate(r *controllerv1.Resource) error {
	kind, name := KindName(r)
	var p problems
	// Sizes first: the other checks may quote a value, and an oversized
	// one must not reach an error message (nor its name).
	if checkSizes(&p, r); len(p) > 0 {
		return p.err(kind, short(name))
	}
	switch o := r.GetKind().(type) {
	case nil:
		return errdefs.InvalidArgument("resource has no kind: set one of Host, Image, Cluster, ControlPlane, MachineDeployment, Machine, HealthCheck, ClusterClass, Rollout, GitSource")
	case *controllerv1.Resource_Host:
		checkHeader(&p, "Host", o.Host.GetApiVersion(), o.Host.GetKind(), o.Host.GetMetadata())
		checkHost(&p, o.Host.GetSpec())
	case *controllerv1.Resource_Image:
		checkHeader(&p, "Image", o.Image.GetApiVersion(), o.Image.GetKind(), o.Image.GetMetadata())
		checkImage(&p, o.Image.GetSpec())
	case *controllerv1.Resource_Cluster:
		checkHeader(&p, "Cluster", o.Cluster.GetApiVersion(), o.Cluster.GetKind(), o.Cluster.GetMetadata())
		checkCluster(&p, o.Cluster.GetSpec())
	case *controllerv1.Resource_ControlPlane:
		checkHeader(&p, "ControlPlane", o.ControlPlane.GetApiVersion(), o.ControlPlane.GetKind(), o.ControlPlane.GetMetadata())
		checkControlPlane(&p, o.ControlPlane.GetSpec())
	case *controllerv1.Resource_MachineDeployment:
		checkHeader(&p, "MachineDeployment", o.MachineDeployment.GetApiVersion(), o.MachineDeployment.GetKind(), o.MachineDeployment.GetMetadata())
		checkMachineDeployment(&p, o.MachineDeployment.GetSpec())
	case *controllerv1.Resource_Machine:
		checkHeader(&p, "Machine", o.Machine.GetApiVersion(), o.Machine.GetKind(), o.Machine.GetMetadata())
		checkMachine(&p, o.Machine.GetSpec())
	case *controllerv1.Resource_HealthCheck:
		checkHeader(&p, "HealthCheck", o.HealthCheck.GetApiVersion(), o.HealthCheck.GetKind(), o.HealthCheck.GetMetadata())
		checkHealthCheck(&p, o.HealthCheck.GetSpec())
	case *controllerv1.Resource_ClusterClass:
		checkHeader(&p, "ClusterClass", o.ClusterClass.GetApiVersion(), o.ClusterClass.GetKind(), o.ClusterClass.GetMetadata())
		checkClusterClass(&p, o.ClusterClass.GetSpec())
	case *controllerv1.Resource_Rollout:
		checkHeader(&p, "Rollout", o.Rollout.GetApiVersion(), o.Rollout.GetKind(), o.Rollout.GetMetadata())
		checkRollout(&p, o.Rollout.GetSpec())
	case *controllerv1.Resource_GitSource:
		checkHeader(&p, "GitSource", o.GitSource.GetApiVersion(), o.GitSource.GetKind(), o.GitSource.GetMetadata())
		checkGitSource(&p, o.GitSource.GetSpec())
	}
	return p.err(kind, name)
}

// KindName returns the kind ("Host", "ControlPlane", ...) and the
// metadata name of r; both are empty for a Resource with no kind set.
func KindName(r *controllerv1.Resource) (kind, name string) {
	switch o := r.GetKind().(type) {
	case *controllerv1.Resource_Host:
		return "Host", o.Host.GetMetadata().GetName()
	case *controllerv1.Resource_Image:
		return "Image", o.Image.GetMetadata().GetName()
	case *controllerv1.Resource_Cluster:
		return "Cluster", o.Cluster.GetMetadata().GetName()
	case *controllerv1.Resource_ControlPlane:
		return "ControlPlane", o.ControlPlane.GetMetadata().GetName()
	case *controllerv1.Resource_MachineDeployment:
		return "MachineDeployment", o.MachineDeployment.GetMetadata().GetName()
	case *controllerv1.Resource_Machine:
		return "Machine", o.Machine.GetMetadata().GetName()
	case *controllerv1.Resource_HealthCheck:
		return "HealthCheck", o.HealthCheck.GetMetadata().GetName()
	case *controllerv1.Resource_ClusterClass:
		return "ClusterClass", o.ClusterClass.GetMetadata().GetName()
	case *controllerv1.Resource_Rollout:
		return "Rollout", o.Rollout.GetMetadata().GetName()
	case *controllerv1.Resource_GitSource:
		return "GitSource", o.GitSource.GetMetadata().GetName()
	}
	return "", ""
}

func checkHeader(p *problems, kind, apiVersion, gotKind string, md *typesv1.ObjectMeta) {
	if apiVersion != "" && apiVersion != APIVersion {
		p.add("apiVersion", "%q is not served: use %s", apiVersion, APIVersion)
	}
	if gotKind != "" && gotKind != kind {
		p.add("kind", "%q does not match the %s it holds", gotKind, kind)
	}
	if md.GetName() == "" {
		p.add("metadata.name", "required: a lowercase DNS-1123 name such as rack1-01")
	} else if msg := dnsSubdomain(md.GetName()); msg != "" {
		p.add("metadata.name", "%q %s", md.GetName(), msg)
	}
	checkLabels(p, "metadata.labels", md.GetLabels())
}

func checkHost(p *problems, s *typesv1.HostSpec) {
	bmc := s.GetBmc()
	switch proto := bmc.GetProtocol(); proto {
	case "":
		p.add("spec.bmc.protocol", "required: use redfish, ipmi or none (none for hosts enrolled with kiln-agent enroll)")
	case "none":
		if bmc.GetAddress() != "" {
			p.add("spec.bmc.address", "must be empty for protocol none: remove it, or set the protocol to redfish or ipmi")
		}
		if bmc.GetUsername() != "" || bmc.GetPassword() != "" {
			p.add("spec.bmc", "username and password are unused for protocol none: remove them")
		}
	case "redfish":
		if bmc.GetAddress() == "" {
			p.add("spec.bmc.address", "required for protocol redfish: a URL such as https://10.0.0.5")
		} else if carriesCredentials(bmc.GetAddress()) {
			// Do not echo an address that may carry a password, even one
			// that does not parse as a URL.
			p.add("spec.bmc.address", "%s", errCredentialsInURL)
		} else if msg := redfishAddress(bmc.GetAddress()); msg == errCredentialsInURL {
			// Do not echo an address that carries a password.
			p.add("spec.bmc.address", "%s", msg)
		} else if msg != "" {
			p.add("spec.bmc.address", "%q %s", bmc.GetAddress(), msg)
		}
	case "ipmi":
		if bmc.GetAddress() == "" {
			p.add("spec.bmc.address", "required for protocol ipmi: host or host:port such as 10.0.0.5:623")
		} else if carriesCredentials(bmc.GetAddress()) {
			p.add("spec.bmc.address", "%s", errCredentialsInURL)
		} else if msg := ipmiAddress(bmc.GetAddress()); msg != "" {
			p.add("spec.bmc.address", "%q %s", bmc.GetAddress(), msg)
		}
	default:
		p.add("spec.bmc.protocol", "%q is not supported: use redfish, ipmi or none", proto)
	}
	switch a := bmc.GetAuth(); {
	case a == "":
	case bmc.GetProtocol() != "redfish":
		p.add("spec.bmc.auth", "is for protocol redfish only: remove it")
	case a != "auto" && a != "session" && a != "basic":
		p.add("spec.bmc.auth", "%q is not supported: use auto (session where the service offers one, else basic), session or basic", a)
	}
	if mac := s.GetBootMac(); mac != "" {
		if msg := macAddress(mac); msg != "" {
			p.add("spec.bootMac", "%q %s", mac, msg)
		}
	}
	switch s.GetBootMode() {
	case "", "uefi", "legacy":
	default:
		p.add("spec.bootMode", "%q is not supported: use uefi or legacy", s.GetBootMode())
	}
	checkRootDisk(p, s)
}

// checkRootDisk checks the root-disk hints on their own; whether they name
// one disk of the host only the agent can tell, from its facts, when it
// lays.
func checkRootDisk(p *problems, s *typesv1.HostSpec) {
	if hint := s.GetRootDiskHint(); hint != "" {
		if msg := diskhint.ValidateString(hint); msg != "" {
			p.add("spec.rootDiskHint", "%s", msg)
		}
	}
	h := s.GetRootDeviceHints()
	if h == nil {
		return
	}
	if s.GetRootDiskHint() != "" {
		p.add("spec.rootDiskHint", "set together with spec.rootDeviceHints: keep one (rootDiskHint: /dev/sda, or rootDeviceHints: {deviceName: /dev/sda})")
	}
	for _, pr := range diskhint.Validate(h) {
		field := "spec.rootDeviceHints"
		if pr.Field != "" {
			field += "." + pr.Field
		}
		p.add(field, "%s", pr.Message)
	}
}

func checkImage(p *problems, s *typesv1.ImageSpec) {
	if s.GetUrl() == "" {
		p.add("spec.url", "required: the http(s) URL of the image file")
	} else if msg := httpURL(s.GetUrl()); msg != "" {
		p.add("spec.url", "%q %s", s.GetUrl(), msg)
	}
	if s.GetManifestUrl() != "" {
		if msg := httpURL(s.GetManifestUrl()); msg != "" {
			p.add("spec.manifestUrl", "%q %s", s.GetManifestUrl(), msg)
		}
	}
	if s.GetSha256() == "" {
		p.add("spec.sha256", "required: the 64 hex digits of the image file's sha256 (sha256sum FILE)")
	} else if msg := sha256Hex(s.GetSha256()); msg != "" {
		p.add("spec.sha256", "%q %s", s.GetSha256(), msg)
	}
	if s.GetRawSha256() != "" {
		if msg := sha256Hex(s.GetRawSha256()); msg != "" {
			p.add("spec.rawSha256", "%q %s", s.GetRawSha256(), msg)
		}
	}
	switch s.GetFormat() {
	case "raw", "raw.zst":
	case "":
		p.add("spec.format", "required: use raw or raw.zst")
	default:
		p.add("spec.format", "%q is not supported: use raw or raw.zst", s.GetFormat())
	}
	if v := s.GetKubernetesVersion(); v != "" {
		if _, err := ParseVersion(v); err != nil {
			p.add("spec.kubernetesVersion", "%v", err)
		}
	}
}

func checkCluster(p *problems, s *typesv1.ClusterSpec) {
	// A topology cluster takes its version from spec.topology.version and
	// may take its CIDRs from its class (filled in at apply).
	topology := s.GetTopology() != nil
	if topology {
		checkTopology(p, s)
	} else if s.GetKubernetesVersion() == "" {
		p.add("spec.kubernetesVersion", "required: a pinned version such as v1.34.4")
	} else if _, err := ParseVersion(s.GetKubernetesVersion()); err != nil {
		p.add("spec.kubernetesVersion", "%v", err)
	}
	pod, podOK := checkCIDR(p, "spec.podCidr", s.GetPodCidr(), !topology)
	svc, svcOK := checkCIDR(p, "spec.serviceCidr", s.GetServiceCidr(), false)
	if !svcOK || s.GetServiceCidr() == "" {
		svcOK = false
	}
	if podOK && svcOK && pod.Overlaps(svc) {
		p.add("spec.serviceCidr", "%s overlaps spec.podCidr %s: pick ranges that do not overlap, e.g. podCidr 10.244.0.0/16 and serviceCidr 10.96.0.0/12", svc, pod)
	}
	if d := s.GetDnsDomain(); d != "" {
		if msg := dnsSubdomain(d); msg != "" {
			p.add("spec.dnsDomain", "%q %s (the default is cluster.local)", d, msg)
		}
	}
	switch s.GetCloudProvider() {
	case "", "external":
	default:
		p.add("spec.cloudProvider", "%q is not supported: leave it empty, or use external to run a cloud-controller-manager", s.GetCloudProvider())
	}
	if s.GetCloudProvider() == "external" && s.GetCcmManifest() == "" {
		p.add("spec.ccmManifest", "required when cloudProvider is external: nodes stay tainted uninitialized until a cloud-controller-manager runs")
	}
	if ep := s.GetControlPlaneEndpoint(); ep != "" {
		if msg := hostPort(ep, true); msg != "" {
			p.add("spec.controlPlaneEndpoint", "%q %s", ep, msg)
		}
	}
	if s.GetCertificateRenewalDays() < 0 {
		p.add("spec.certificateRenewalDays", "%d is negative: use 0 to disable or a number of days such as 30", s.GetCertificateRenewalDays())
	}
}

func checkControlPlane(p *problems, s *typesv1.ControlPlaneSpec) {
	checkClusterRef(p, s.GetCluster())
	switch r := s.GetReplicas(); {
	case r < 1:
		p.add("spec.replicas", "%d is too few: a control plane needs at least 1 member; use 1, 3 or 5", r)
	case r%2 == 0:
		p.add("spec.replicas", "%d is even: an even number of control-plane members cannot keep etcd quorum better than one less: use 1, 3 or 5", r)
	}
	if v := s.GetVersion(); v != "" {
		if _, err := ParseVersion(v); err != nil {
			p.add("spec.version", "%v", err)
		}
	}
	checkImageRef(p, s.GetImage())
	checkImageSelector(p, s.GetImage(), s.GetImageSelector())
	checkLabels(p, "spec.hostSelector", s.GetHostSelector())
	if m := s.GetRolloutMaxSurge(); m != 0 && m != 1 {
		p.add("spec.rolloutMaxSurge", "%d is not supported: use 1 to roll out onto a spare host first (3→4→3) or 0 to reimage in place", m)
	}
}

func checkMachineDeployment(p *problems, s *typesv1.MachineDeploymentSpec) {
	checkClusterRef(p, s.GetCluster())
	if r := s.GetReplicas(); r < 0 {
		p.add("spec.replicas", "%d is negative: use 0 or more", r)
	}
	if v := s.GetVersion(); v != "" {
		if _, err := ParseVersion(v); err != nil {
			p.add("spec.version", "%v", err)
		}
	}
	checkImageRef(p, s.GetImage())
	checkImageSelector(p, s.GetImage(), s.GetImageSelector())
	checkLabels(p, "spec.hostSelector", s.GetHostSelector())
	st := s.GetStrategy()
	switch st.GetType() {
	case "", "RollingUpdate", "OnDelete":
	default:
		p.add("spec.strategy.type", "%q is not supported: use RollingUpdate or OnDelete", st.GetType())
	}
	surge, surgeOK := checkIntOrPercent(p, "spec.strategy.maxSurge", st.GetMaxSurge(), IntOrPercent{Value: 1})
	unavail, unavailOK := checkIntOrPercent(p, "spec.strategy.maxUnavailable", st.GetMaxUnavailable(), IntOrPercent{})
	if surgeOK && unavailOK && surge.Value == 0 && unavail.Value == 0 && st.GetType() != "OnDelete" {
		p.add("spec.strategy", "maxSurge and maxUnavailable are both zero, so a rollout could never make progress: set maxSurge to 1 (uses a spare host) or maxUnavailable to 1 (reimages in place)")
	}
	if d := st.GetNodeDrainTimeout(); d != "" {
		checkDuration(p, "spec.strategy.nodeDrainTimeout", d, true)
	}
}

func checkMachine(p *problems, s *typesv1.MachineSpec) {
	checkClusterRef(p, s.GetCluster())
	switch s.GetRole() {
	case "control-plane", "worker":
	case "":
		p.add("spec.role", "required: use control-plane or worker")
	default:
		p.add("spec.role", "%q is not supported: use control-plane or worker", s.GetRole())
	}
	if h := s.GetHost(); h != "" {
		if msg := dnsSubdomain(h); msg != "" {
			p.add("spec.host", "%q %s", h, msg)
		}
	}
	if v := s.GetVersion(); v != "" {
		if _, err := ParseVersion(v); err != nil {
			p.add("spec.version", "%v", err)
		}
	}
	checkImageRef(p, s.GetImage())
	if o := s.GetOwner(); o != "" {
		kind, name, ok := strings.Cut(o, "/")
		if !ok || (kind != "ControlPlane" && kind != "MachineDeployment") || dnsSubdomain(name) != "" {
			p.add("spec.owner", "%q is not an owner: use ControlPlane/NAME or MachineDeployment/NAME", o)
		}
	}
}

// MachineConditions are the condition types a Machine carries, which a
// HealthCheck can watch: the agent's probes of the node (agent/probe) and
// the executor's own.
var MachineConditions = []string{
	"NodeReady", "KubeletHealthy", "ContainerdHealthy", "APIServerReady", "ClusterDNSResolves",
	"CertificatesValid", "EtcdMemberHealthy", "CloudProviderInitialized",
}

func checkHealthCheck(p *problems, s *typesv1.HealthCheckSpec) {
	checkClusterRef(p, s.GetCluster())
	checkLabels(p, "spec.selector", s.GetSelector())
	for i, c := range s.GetUnhealthyConditions() {
		f := fmt.Sprintf("spec.unhealthyConditions[%d]", i)
		switch t := c.GetType(); {
		case t == "":
			p.add(f+".type", "required: a machine condition such as NodeReady")
		case !slices.Contains(MachineConditions, t):
			hint := ""
			if t == "Ready" {
				hint = " (the node's Ready is NodeReady on a Machine)"
			}
			p.add(f+".type", "%q is not a condition the controller sets on Machines%s: use one of %s", t, hint, strings.Join(MachineConditions, ", "))
		}
		switch c.GetStatus() {
		case "True", "False", "Unknown":
		case "":
			p.add(f+".status", "required: use True, False or Unknown")
		default:
			p.add(f+".status", "%q is not a condition status: use True, False or Unknown", c.GetStatus())
		}
		if c.GetTimeout() == "" {
			p.add(f+".timeout", "required: how long the condition must hold before remediation, e.g. 5m")
		} else {
			checkDuration(p, f+".timeout", c.GetTimeout(), false)
		}
	}
	if d := s.GetNodeStartupTimeout(); d != "" {
		checkDuration(p, "spec.nodeStartupTimeout", d, false)
	}
	if m := s.GetMaxUnhealthy(); m != "" {
		checkIntOrPercent(p, "spec.maxUnhealthy", m, IntOrPercent{})
	}
}

func checkClusterRef(p *problems, c string) {
	if c == "" {
		p.add("spec.cluster", "required: the name of the Cluster this belongs to")
	} else if msg := dnsSubdomain(c); msg != "" {
		p.add("spec.cluster", "%q %s", c, msg)
	}
}

// checkImageSelector refuses an image named both ways.
func checkImageSelector(p *problems, img string, sel map[string]string) {
	if len(sel) == 0 {
		return
	}
	if img != "" {
		p.add("spec.imageSelector", "set together with spec.image %q: name the image (spec.image) or choose it by labels (spec.imageSelector), not both", img)
	}
	checkLabels(p, "spec.imageSelector", sel)
}

func checkImageRef(p *problems, img string) {
	if img == "" {
		return
	}
	if msg := dnsSubdomain(img); msg != "" {
		p.add("spec.image", "%q %s: name an Image resource", img, msg)
	}
}
