package validation

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func meta(name string) *typesv1.ObjectMeta { return &typesv1.ObjectMeta{Name: name} }

func validHost() *typesv1.Host {
	return &typesv1.Host{ApiVersion: APIVersion, Kind: "Host", Metadata: meta("rack1-01"), Spec: &typesv1.HostSpec{
		Bmc:     &typesv1.BMCSpec{Protocol: "redfish", Address: "https://10.0.0.5", Username: "admin", Password: "s3cret-pw"},
		BootMac: "52:54:00:12:34:56",
	}}
}

func validImage() *typesv1.Image {
	return &typesv1.Image{ApiVersion: APIVersion, Kind: "Image", Metadata: meta("debian12-k8s1.34.4-20261202"), Spec: &typesv1.ImageSpec{
		Url:    "http://images.lab/debian12-k8s1.34.4-20261202.raw.zst",
		Sha256: strings.Repeat("ab", 32),
		Format: "raw.zst",
	}}
}

func validCluster() *typesv1.Cluster {
	return &typesv1.Cluster{ApiVersion: APIVersion, Kind: "Cluster", Metadata: meta("lab"), Spec: &typesv1.ClusterSpec{
		KubernetesVersion: "v1.34.4", PodCidr: "10.244.0.0/16", ServiceCidr: "10.96.0.0/12", DnsDomain: "cluster.local",
	}}
}

func validCP() *typesv1.ControlPlane {
	return &typesv1.ControlPlane{Metadata: meta("lab-cp"), Spec: &typesv1.ControlPlaneSpec{Cluster: "lab", Replicas: 3, Version: "v1.34.4", RolloutMaxSurge: 1}}
}

func validMD() *typesv1.MachineDeployment {
	return &typesv1.MachineDeployment{Metadata: meta("lab-workers"), Spec: &typesv1.MachineDeploymentSpec{
		Cluster: "lab", Replicas: 2, Version: "v1.34.4",
		Strategy: &typesv1.RolloutStrategy{Type: "RollingUpdate", MaxSurge: "1", MaxUnavailable: "0", NodeDrainTimeout: "5m"},
	}}
}

func validMachine() *typesv1.Machine {
	return &typesv1.Machine{Metadata: meta("lab-workers-abc12"), Spec: &typesv1.MachineSpec{
		Cluster: "lab", Role: "worker", Host: "rack1-02", Version: "v1.34.4", Owner: "MachineDeployment/lab-workers",
	}}
}

func validHC() *typesv1.HealthCheck {
	return &typesv1.HealthCheck{Metadata: meta("lab-nodes"), Spec: &typesv1.HealthCheckSpec{
		Cluster: "lab", NodeStartupTimeout: "10m", MaxUnhealthy: "40%",
		UnhealthyConditions: []*typesv1.UnhealthyCondition{{Type: "NodeReady", Status: "False", Timeout: "5m"}},
	}}
}

func host(f func(*typesv1.Host)) *controllerv1.Resource {
	h := validHost()
	f(h)
	return &controllerv1.Resource{Kind: &controllerv1.Resource_Host{Host: h}}
}

func image(f func(*typesv1.Image)) *controllerv1.Resource {
	x := validImage()
	f(x)
	return &controllerv1.Resource{Kind: &controllerv1.Resource_Image{Image: x}}
}

func cluster(f func(*typesv1.Cluster)) *controllerv1.Resource {
	x := validCluster()
	f(x)
	return &controllerv1.Resource{Kind: &controllerv1.Resource_Cluster{Cluster: x}}
}

func cp(f func(*typesv1.ControlPlane)) *controllerv1.Resource {
	x := validCP()
	f(x)
	return &controllerv1.Resource{Kind: &controllerv1.Resource_ControlPlane{ControlPlane: x}}
}

func md(f func(*typesv1.MachineDeployment)) *controllerv1.Resource {
	x := validMD()
	f(x)
	return &controllerv1.Resource{Kind: &controllerv1.Resource_MachineDeployment{MachineDeployment: x}}
}

func machine(f func(*typesv1.Machine)) *controllerv1.Resource {
	x := validMachine()
	f(x)
	return &controllerv1.Resource{Kind: &controllerv1.Resource_Machine{Machine: x}}
}

func hc(f func(*typesv1.HealthCheck)) *controllerv1.Resource {
	x := validHC()
	f(x)
	return &controllerv1.Resource{Kind: &controllerv1.Resource_HealthCheck{HealthCheck: x}}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name string
		r    *controllerv1.Resource
		want []string // substrings of the error; none means valid
	}{
		// Valid objects of every kind.
		{"valid host", host(func(*typesv1.Host) {}), nil},
		{"valid image", image(func(*typesv1.Image) {}), nil},
		{"valid cluster", cluster(func(*typesv1.Cluster) {}), nil},
		{"valid control plane", cp(func(*typesv1.ControlPlane) {}), nil},
		{"valid machine deployment", md(func(*typesv1.MachineDeployment) {}), nil},
		{"valid machine", machine(func(*typesv1.Machine) {}), nil},
		{"valid health check", hc(func(*typesv1.HealthCheck) {}), nil},
		{"no kind", &controllerv1.Resource{}, []string{"resource has no kind"}},

		// Names and metadata.
		{"name missing", host(func(h *typesv1.Host) { h.Metadata = nil }), []string{`Host "(unnamed)" is invalid`, "metadata.name: required"}},
		{"name uppercase", host(func(h *typesv1.Host) { h.Metadata.Name = "Rack1" }), []string{`metadata.name: "Rack1" is not a DNS-1123 name`, `"rack1" would do`}},
		{"name underscore", host(func(h *typesv1.Host) { h.Metadata.Name = "rack_1" }), []string{`metadata.name: "rack_1" is not a DNS-1123 name`}},
		{"name trailing dash", host(func(h *typesv1.Host) { h.Metadata.Name = "rack-" }), []string{"is not a DNS-1123 name"}},
		{"name too long", host(func(h *typesv1.Host) { h.Metadata.Name = strings.Repeat("a", 254) }), []string{"is 254 characters long: use at most 253"}},
		{"label key bad", host(func(h *typesv1.Host) { h.Metadata.Labels = map[string]string{"-rack": "1"} }), []string{`metadata.labels: key "-rack" is not a label key`}},
		{"label value bad", host(func(h *typesv1.Host) { h.Metadata.Labels = map[string]string{"rack": "a b"} }), []string{`metadata.labels.rack: value "a b" is not a label value`}},
		{"label prefixed ok", host(func(h *typesv1.Host) { h.Metadata.Labels = map[string]string{"kiln.dev/rack": "r1", "class": ""} }), nil},
		{"api version", host(func(h *typesv1.Host) { h.ApiVersion = "v1" }), []string{`apiVersion: "v1" is not served: use kiln.dev/v1`}},
		{"kind mismatch", host(func(h *typesv1.Host) { h.Kind = "Image" }), []string{`kind: "Image" does not match the Host`}},

		// Host.
		{"bmc missing", host(func(h *typesv1.Host) { h.Spec.Bmc = nil }), []string{"spec.bmc.protocol: required: use redfish, ipmi or none"}},
		{"bmc protocol unknown", host(func(h *typesv1.Host) { h.Spec.Bmc.Protocol = "amt" }), []string{`spec.bmc.protocol: "amt" is not supported: use redfish, ipmi or none`}},
		{"redfish auth basic", host(func(h *typesv1.Host) { h.Spec.Bmc.Auth = "basic" }), nil},
		{"redfish auth unknown", host(func(h *typesv1.Host) { h.Spec.Bmc.Auth = "digest" }), []string{`spec.bmc.auth: "digest" is not supported: use auto`}},
		{"ipmi auth", host(func(h *typesv1.Host) {
			h.Spec.Bmc.Protocol, h.Spec.Bmc.Address, h.Spec.Bmc.Auth = "ipmi", "10.0.0.5", "session"
		}), []string{"spec.bmc.auth: is for protocol redfish only"}},
		{"redfish address missing", host(func(h *typesv1.Host) { h.Spec.Bmc.Address = "" }), []string{"spec.bmc.address: required for protocol redfish"}},
		{"redfish address scheme", host(func(h *typesv1.Host) { h.Spec.Bmc.Address = "ftp://10.0.0.5" }), []string{`spec.bmc.address: "ftp://10.0.0.5" has scheme "ftp": use https`}},
		{"redfish address port", host(func(h *typesv1.Host) { h.Spec.Bmc.Address = "https://10.0.0.5:99999" }), []string{`has port "99999": use a number from 1 to 65535`}},
		{"redfish address credentials", host(func(h *typesv1.Host) { h.Spec.Bmc.Address = "https://root:pw@10.0.0.5" }), []string{"carries credentials"}},
		{"redfish emulator url", host(func(h *typesv1.Host) { h.Spec.Bmc.Address = "redfish+http://127.0.0.1:8000" }), nil},
		{"redfish bare host", host(func(h *typesv1.Host) { h.Spec.Bmc.Address = "bmc-rack1-01.example" }), nil},
		{"ipmi ok", host(func(h *typesv1.Host) { h.Spec.Bmc.Protocol, h.Spec.Bmc.Address = "ipmi", "127.0.0.1:9001" }), nil},
		{"ipmi missing address", host(func(h *typesv1.Host) { h.Spec.Bmc.Protocol, h.Spec.Bmc.Address = "ipmi", "" }), []string{"spec.bmc.address: required for protocol ipmi"}},
		{"ipmi url", host(func(h *typesv1.Host) { h.Spec.Bmc.Protocol, h.Spec.Bmc.Address = "ipmi", "https://10.0.0.5" }), []string{"is a URL: IPMI takes host or host:port"}},
		{"ipmi bad host", host(func(h *typesv1.Host) { h.Spec.Bmc.Protocol, h.Spec.Bmc.Address = "ipmi", "10.0.0.5:abc" }), []string{`has port "abc"`}},
		{"none ok", host(func(h *typesv1.Host) { h.Spec.Bmc = &typesv1.BMCSpec{Protocol: "none"} }), nil},
		{"none with address", host(func(h *typesv1.Host) { h.Spec.Bmc.Protocol = "none" }), []string{"spec.bmc.address: must be empty for protocol none", "spec.bmc: username and password are unused"}},
		// passwordSet is output only; it is accepted (and ignored by the
		// controller) so that `kilnctl get -o yaml` output applies again.
		{"password set is accepted", host(func(h *typesv1.Host) { h.Spec.Bmc.PasswordSet = true }), nil},
		{"boot mac bad", host(func(h *typesv1.Host) { h.Spec.BootMac = "52:54:00" }), []string{`spec.bootMac: "52:54:00" is not a MAC address`}},
		{"boot mode bad", host(func(h *typesv1.Host) { h.Spec.BootMode = "bios" }), []string{`spec.bootMode: "bios" is not supported: use uefi or legacy`}},
		{"root disk hint serial", host(func(h *typesv1.Host) { h.Spec.RootDiskHint = "S45PNA0M512345" }), nil},
		{"root disk hint with spaces", host(func(h *typesv1.Host) { h.Spec.RootDiskHint = "/dev/sda /dev/sdb" }), []string{`spec.rootDiskHint: "/dev/sda /dev/sdb" holds spaces`}},
		{"root device hints", host(func(h *typesv1.Host) {
			h.Spec.RootDiskHint = ""
			h.Spec.RootDeviceHints = &typesv1.RootDeviceHints{Wwn: "0x5000c500a0b1c2d3", MinSizeGigabytes: 100}
		}), nil},
		{"root device hints and hint", host(func(h *typesv1.Host) {
			h.Spec.RootDiskHint = "/dev/sda"
			h.Spec.RootDeviceHints = &typesv1.RootDeviceHints{Serial: "X"}
		}), []string{"spec.rootDiskHint: set together with spec.rootDeviceHints: keep one"}},
		{"root device hints bad", host(func(h *typesv1.Host) {
			h.Spec.RootDiskHint = ""
			h.Spec.RootDeviceHints = &typesv1.RootDeviceHints{DeviceName: "sda", MinSizeGigabytes: 900, MaxSizeGigabytes: 100}
		}), []string{`spec.rootDeviceHints.deviceName: "sda" is not a path`, "spec.rootDeviceHints.minSizeGigabytes: 900 is larger than maxSizeGigabytes 100"}},
		{"root device hints empty", host(func(h *typesv1.Host) { h.Spec.RootDeviceHints = &typesv1.RootDeviceHints{} }), []string{"spec.rootDeviceHints: sets no hint"}},

		// Image.
		{"image sha short", image(func(i *typesv1.Image) { i.Spec.Sha256 = "abc" }), []string{`spec.sha256: "abc" has 3 characters: a sha256 is 64 hex digits`}},
		{"image sha not hex", image(func(i *typesv1.Image) { i.Spec.Sha256 = strings.Repeat("g", 64) }), []string{"has 'g': a sha256 is 64 hex digits"}},
		{"image sha prefix", image(func(i *typesv1.Image) { i.Spec.Sha256 = "sha256:" + strings.Repeat("a", 64) }), []string{"has a sha256: prefix"}},
		{"image sha missing", image(func(i *typesv1.Image) { i.Spec.Sha256 = "" }), []string{"spec.sha256: required"}},
		{"image format bad", image(func(i *typesv1.Image) { i.Spec.Format = "qcow2" }), []string{`spec.format: "qcow2" is not supported: use raw or raw.zst`}},
		{"image format missing", image(func(i *typesv1.Image) { i.Spec.Format = "" }), []string{"spec.format: required: use raw or raw.zst"}},
		{"image url scheme", image(func(i *typesv1.Image) { i.Spec.Url = "file:///srv/img.raw" }), []string{`spec.url: "file:///srv/img.raw" has scheme "file": images are fetched over http or https`}},
		{"image url missing", image(func(i *typesv1.Image) { i.Spec.Url = "" }), []string{"spec.url: required"}},
		{"image version", image(func(i *typesv1.Image) { i.Spec.KubernetesVersion = "1.34.4" }), []string{`spec.kubernetesVersion: "1.34.4" is missing the leading v: use v1.34.4`}},

		// Cluster.
		{"cluster version missing", cluster(func(c *typesv1.Cluster) { c.Spec.KubernetesVersion = "" }), []string{"spec.kubernetesVersion: required"}},
		{"cluster version stable", cluster(func(c *typesv1.Cluster) { c.Spec.KubernetesVersion = "stable" }), []string{`"stable" is not a pinned Kubernetes version: use the form v1.34.4`}},
		{"cluster version short", cluster(func(c *typesv1.Cluster) { c.Spec.KubernetesVersion = "v1.34" }), []string{`"v1.34" is not a pinned Kubernetes version`}},
		{"cluster version prerelease", cluster(func(c *typesv1.Cluster) { c.Spec.KubernetesVersion = "v1.34.0-rc.1" }), []string{"is not a pinned Kubernetes version"}},
		{"cluster pod cidr bad", cluster(func(c *typesv1.Cluster) { c.Spec.PodCidr = "10.244.0.0" }), []string{`spec.podCidr: "10.244.0.0" is not a CIDR`}},
		{"cluster pod cidr host bits", cluster(func(c *typesv1.Cluster) { c.Spec.PodCidr = "10.244.1.0/16" }), []string{`spec.podCidr: "10.244.1.0/16" has host bits set: use 10.244.0.0/16`}},
		{"cluster pod cidr missing", cluster(func(c *typesv1.Cluster) { c.Spec.PodCidr = "" }), []string{"spec.podCidr: required"}},
		{"cluster service cidr optional", cluster(func(c *typesv1.Cluster) { c.Spec.ServiceCidr = "" }), nil},
		{"cluster cidrs overlap", cluster(func(c *typesv1.Cluster) { c.Spec.ServiceCidr = "10.244.128.0/20" }), []string{"spec.serviceCidr: 10.244.128.0/20 overlaps spec.podCidr 10.244.0.0/16: pick ranges that do not overlap"}},
		{"cluster dns domain", cluster(func(c *typesv1.Cluster) { c.Spec.DnsDomain = "Cluster_Local" }), []string{`spec.dnsDomain: "Cluster_Local" is not a DNS-1123 name`}},
		{"cluster cloud provider", cluster(func(c *typesv1.Cluster) { c.Spec.CloudProvider = "aws" }), []string{`spec.cloudProvider: "aws" is not supported: leave it empty, or use external`}},
		{"cluster external needs ccm", cluster(func(c *typesv1.Cluster) { c.Spec.CloudProvider = "external" }), []string{"spec.ccmManifest: required when cloudProvider is external"}},
		{"cluster endpoint", cluster(func(c *typesv1.Cluster) { c.Spec.ControlPlaneEndpoint = "10.0.0.10" }), []string{`spec.controlPlaneEndpoint: "10.0.0.10" is not host:port`}},
		{"cluster renewal days", cluster(func(c *typesv1.Cluster) { c.Spec.CertificateRenewalDays = -1 }), []string{"spec.certificateRenewalDays: -1 is negative"}},
		{"cluster all problems in one message", cluster(func(c *typesv1.Cluster) { c.Spec.KubernetesVersion, c.Spec.PodCidr = "", "x" }),
			[]string{`Cluster "lab" is invalid: spec.kubernetesVersion: required`, `; spec.podCidr: "x" is not a CIDR`}},

		// ControlPlane.
		{"cp replicas even", cp(func(c *typesv1.ControlPlane) { c.Spec.Replicas = 2 }), []string{"spec.replicas: 2 is even: an even number of control-plane members cannot keep etcd quorum better than one less: use 1, 3 or 5"}},
		{"cp replicas zero", cp(func(c *typesv1.ControlPlane) { c.Spec.Replicas = 0 }), []string{"spec.replicas: 0 is too few"}},
		{"cp replicas one", cp(func(c *typesv1.ControlPlane) { c.Spec.Replicas = 1 }), nil},
		{"cp image selector", cp(func(c *typesv1.ControlPlane) {
			c.Spec.ImageSelector = map[string]string{"os": "debian12", "kubernetes": "v1.34.4"}
		}), nil},
		{"cp image and selector", cp(func(c *typesv1.ControlPlane) {
			c.Spec.Image, c.Spec.ImageSelector = "debian12-k8s1.34.4-20261202", map[string]string{"os": "debian12"}
		}), []string{`spec.imageSelector: set together with spec.image "debian12-k8s1.34.4-20261202"`}},
		{"md image selector bad label", md(func(d *typesv1.MachineDeployment) {
			d.Spec.ImageSelector = map[string]string{"os": "a b"}
		}), []string{`spec.imageSelector.os: value "a b" is not a label value`}},
		{"cp version", cp(func(c *typesv1.ControlPlane) { c.Spec.Version = "v1.34.x" }), []string{`spec.version: "v1.34.x" is not a pinned Kubernetes version`}},
		{"cp surge", cp(func(c *typesv1.ControlPlane) { c.Spec.RolloutMaxSurge = 2 }), []string{"spec.rolloutMaxSurge: 2 is not supported: use 1"}},
		{"cp cluster missing", cp(func(c *typesv1.ControlPlane) { c.Spec.Cluster = "" }), []string{"spec.cluster: required"}},
		{"cp image ref", cp(func(c *typesv1.ControlPlane) { c.Spec.Image = "Debian 12" }), []string{`spec.image: "Debian 12" is not a DNS-1123 name`}},
		{"cp selector", cp(func(c *typesv1.ControlPlane) { c.Spec.HostSelector = map[string]string{"rack": "r 1"} }), []string{"spec.hostSelector.rack: value"}},

		// MachineDeployment.
		{"md replicas negative", md(func(m *typesv1.MachineDeployment) { m.Spec.Replicas = -1 }), []string{"spec.replicas: -1 is negative"}},
		{"md replicas zero ok", md(func(m *typesv1.MachineDeployment) { m.Spec.Replicas = 0 }), nil},
		{"md surge percent", md(func(m *typesv1.MachineDeployment) { m.Spec.Strategy.MaxSurge = "25%" }), nil},
		{"md surge bad", md(func(m *typesv1.MachineDeployment) { m.Spec.Strategy.MaxSurge = "one" }), []string{`spec.strategy.maxSurge: "one" is not a count or a percentage`}},
		{"md unavailable over 100", md(func(m *typesv1.MachineDeployment) { m.Spec.Strategy.MaxUnavailable = "150%" }), []string{`spec.strategy.maxUnavailable: "150%" is not a count or a percentage`}},
		{"md unavailable negative", md(func(m *typesv1.MachineDeployment) { m.Spec.Strategy.MaxUnavailable = "-1" }), []string{`"-1" is not a count or a percentage`}},
		{"md both zero", md(func(m *typesv1.MachineDeployment) { m.Spec.Strategy.MaxSurge = "0" }), []string{"spec.strategy: maxSurge and maxUnavailable are both zero"}},
		{"md both zero percent", md(func(m *typesv1.MachineDeployment) {
			m.Spec.Strategy.MaxSurge, m.Spec.Strategy.MaxUnavailable = "0%", "0%"
		}), []string{"are both zero"}},
		{"md defaults ok", md(func(m *typesv1.MachineDeployment) { m.Spec.Strategy = nil }), nil},
		{"md on delete both zero ok", md(func(m *typesv1.MachineDeployment) {
			m.Spec.Strategy = &typesv1.RolloutStrategy{Type: "OnDelete", MaxSurge: "0"}
		}), nil},
		{"md strategy type", md(func(m *typesv1.MachineDeployment) { m.Spec.Strategy.Type = "Recreate" }), []string{`spec.strategy.type: "Recreate" is not supported: use RollingUpdate or OnDelete`}},
		{"md drain timeout", md(func(m *typesv1.MachineDeployment) { m.Spec.Strategy.NodeDrainTimeout = "5 minutes" }), []string{`spec.strategy.nodeDrainTimeout: "5 minutes" is not a duration: use a Go duration such as 90s`}},
		{"md drain timeout zero ok", md(func(m *typesv1.MachineDeployment) { m.Spec.Strategy.NodeDrainTimeout = "0s" }), nil},
		{"md drain timeout negative", md(func(m *typesv1.MachineDeployment) { m.Spec.Strategy.NodeDrainTimeout = "-5m" }), []string{`"-5m" is negative`}},
		{"md version", md(func(m *typesv1.MachineDeployment) { m.Spec.Version = "latest" }), []string{`spec.version: "latest" is not a pinned Kubernetes version`}},

		// Machine.
		{"machine role", machine(func(m *typesv1.Machine) { m.Spec.Role = "master" }), []string{`spec.role: "master" is not supported: use control-plane or worker`}},
		{"machine role missing", machine(func(m *typesv1.Machine) { m.Spec.Role = "" }), []string{"spec.role: required"}},
		{"machine owner", machine(func(m *typesv1.Machine) { m.Spec.Owner = "Deployment/x" }), []string{`spec.owner: "Deployment/x" is not an owner: use ControlPlane/NAME or MachineDeployment/NAME`}},
		{"machine host", machine(func(m *typesv1.Machine) { m.Spec.Host = "Rack 1" }), []string{`spec.host: "Rack 1" is not a DNS-1123 name`}},

		// HealthCheck.
		{"hc timeout bad", hc(func(h *typesv1.HealthCheck) { h.Spec.UnhealthyConditions[0].Timeout = "5" }), []string{`spec.unhealthyConditions[0].timeout: "5" is not a duration`}},
		{"hc timeout zero", hc(func(h *typesv1.HealthCheck) { h.Spec.UnhealthyConditions[0].Timeout = "0s" }), []string{`spec.unhealthyConditions[0].timeout: "0s" is zero`}},
		{"hc timeout missing", hc(func(h *typesv1.HealthCheck) { h.Spec.UnhealthyConditions[0].Timeout = "" }), []string{"spec.unhealthyConditions[0].timeout: required"}},
		{"hc status", hc(func(h *typesv1.HealthCheck) { h.Spec.UnhealthyConditions[0].Status = "false" }), []string{`spec.unhealthyConditions[0].status: "false" is not a condition status: use True, False or Unknown`}},
		{"hc node Ready is NodeReady", hc(func(h *typesv1.HealthCheck) { h.Spec.UnhealthyConditions[0].Type = "Ready" }), []string{`spec.unhealthyConditions[0].type: "Ready" is not a condition the controller sets on Machines (the node's Ready is NodeReady on a Machine): use one of NodeReady`}},
		{"hc type missing", hc(func(h *typesv1.HealthCheck) { h.Spec.UnhealthyConditions[0].Type = "" }), []string{"spec.unhealthyConditions[0].type: required"}},
		{"hc startup timeout", hc(func(h *typesv1.HealthCheck) { h.Spec.NodeStartupTimeout = "ten minutes" }), []string{`spec.nodeStartupTimeout: "ten minutes" is not a duration`}},
		{"hc max unhealthy", hc(func(h *typesv1.HealthCheck) { h.Spec.MaxUnhealthy = "40 %" }), []string{`spec.maxUnhealthy: "40 %" is not a count or a percentage`}},
		{"hc max unhealthy count", hc(func(h *typesv1.HealthCheck) { h.Spec.MaxUnhealthy = "2" }), nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := Validate(tt.r)
			if len(tt.want) == 0 {
				if err != nil {
					t.Fatalf("Validate(%s) = %v, want nil", tt.name, err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate(%s) = nil, want error containing %q", tt.name, tt.want)
			}
			if !errdefs.IsInvalidArgument(err) {
				t.Errorf("Validate(%s) = %v, want an InvalidArgument error", tt.name, err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Validate(%s) = %q, want it to contain %q", tt.name, err, w)
				}
			}
		})
	}
}

func TestValidateNeverShowsPassword(t *testing.T) {
	r := host(func(h *typesv1.Host) { h.Spec.Bmc.Protocol = "none"; h.Spec.Bmc.Password = "hunter2-secret" })
	err := Validate(r)
	require.Error(t, err)
	if strings.Contains(err.Error(), "hunter2-secret") {
		t.Errorf("Validate() = %q, want no password in the message", err)
	}
	// The last two were found by FuzzValidate: an address that does not
	// parse as a URL, and an IPMI host:port, were quoted whole.
	for _, a := range []struct{ protocol, addr string }{
		{"redfish", "https://root:hunter2-secret@10.0.0.5"},
		{"redfish", "ftp://root:hunter2-secret@10.0.0.5:99999"},
		{"redfish", "https://root:hunter2-secret%zz@10.0.0.5"},
		{"ipmi", "root:hunter2-secret@10.0.0.5:623"},
	} {
		addr := a.addr
		err = Validate(host(func(h *typesv1.Host) { h.Spec.Bmc.Protocol, h.Spec.Bmc.Address = a.protocol, addr }))
		require.Error(t, err)
		if strings.Contains(err.Error(), "hunter2-secret") || !strings.Contains(err.Error(), "spec.bmc.address: carries credentials") {
			t.Errorf("Validate(address %q) = %q, want a credentials error without the password", addr, err)
		}
	}
}

func TestValidateAgainst(t *testing.T) {
	withCluster := func(f func(*typesv1.Cluster)) *controllerv1.Resource { return cluster(f) }
	withCP := func(v string) *controllerv1.Resource { return cp(func(c *typesv1.ControlPlane) { c.Spec.Version = v }) }
	lab := []netip.Prefix{netip.MustParsePrefix("10.244.5.0/24"), netip.MustParsePrefix("192.168.1.0/24")}

	tests := []struct {
		name string
		r    *controllerv1.Resource
		o    Observed
		want []string
	}{
		{"new control plane", withCP("v1.34.4"), Observed{}, nil},
		{"cp patch upgrade", withCP("v1.34.5"), Observed{Current: withCP("v1.34.4")}, nil},
		{"cp minor upgrade", withCP("v1.35.0"), Observed{Current: withCP("v1.34.4")}, nil},
		{"cp skips a minor", withCP("v1.34.0"), Observed{Current: withCP("v1.32.3")},
			[]string{"spec.version: v1.32 -> v1.34 skips v1.33; upgrade one minor at a time (apply v1.33.x first)"}},
		{"cp skips two minors", withCP("v1.35.0"), Observed{Current: withCP("v1.32.3")}, []string{"skips v1.33, v1.34;"}},
		{"cp downgrade", withCP("v1.33.2"), Observed{Current: withCP("v1.34.4")}, []string{"spec.version: v1.34.4 -> v1.33.2 is a downgrade"}},
		{"cp major", withCP("v2.0.0"), Observed{Current: withCP("v1.34.4")}, []string{"changes the major version"}},
		{"cluster skips a minor", withCluster(func(c *typesv1.Cluster) { c.Spec.KubernetesVersion = "v1.34.4" }),
			Observed{Current: withCluster(func(c *typesv1.Cluster) { c.Spec.KubernetesVersion = "v1.32.0" })},
			[]string{"spec.kubernetesVersion: v1.32 -> v1.34 skips v1.33; upgrade one minor at a time"}},
		{"cluster pod cidr overlaps lab", cluster(func(c *typesv1.Cluster) {}), Observed{Networks: lab},
			[]string{"spec.podCidr: 10.244.0.0/16 overlaps host network 10.244.5.0/24", "e.g. 172.20.0.0/16"}},
		{"cluster service cidr overlaps lab", cluster(func(c *typesv1.Cluster) { c.Spec.PodCidr, c.Spec.ServiceCidr = "172.20.0.0/16", "192.168.0.0/16" }), Observed{Networks: lab},
			[]string{"spec.serviceCidr: 192.168.0.0/16 overlaps host network 192.168.1.0/24", "e.g. 10.96.0.0/12"}},
		{"cluster clear of lab", cluster(func(c *typesv1.Cluster) { c.Spec.PodCidr = "10.245.0.0/16" }), Observed{Networks: lab}, nil},
		// A running cluster's nodes report its own pod network (cni0);
		// applying it again unchanged is fine.
		{"existing cluster reapplied", cluster(func(c *typesv1.Cluster) {}), Observed{Current: cluster(func(*typesv1.Cluster) {}), Networks: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/24")}}, nil},
		{"cluster pod cidr changed", cluster(func(c *typesv1.Cluster) { c.Spec.PodCidr = "10.245.0.0/16" }), Observed{Current: cluster(func(*typesv1.Cluster) {})},
			[]string{"spec.podCidr: cannot change from 10.244.0.0/16 to 10.245.0.0/16 on an existing cluster"}},
		{"md same as cp", md(func(*typesv1.MachineDeployment) {}), Observed{ControlPlaneVersion: "v1.34.4"}, nil},
		{"md older than cp", md(func(m *typesv1.MachineDeployment) { m.Spec.Version = "v1.33.1" }), Observed{ControlPlaneVersion: "v1.34.4"}, nil},
		{"md newer minor than cp", md(func(m *typesv1.MachineDeployment) { m.Spec.Version = "v1.35.0" }), Observed{ControlPlaneVersion: "v1.34.4"},
			[]string{"spec.version: v1.35.0 is newer than the control plane's v1.34.4: a kubelet is never newer than its API server; upgrade the ControlPlane first"}},
		{"md newer patch than cp", md(func(m *typesv1.MachineDeployment) { m.Spec.Version = "v1.34.5" }), Observed{ControlPlaneVersion: "v1.34.4"}, []string{"is newer than the control plane's"}},
		{"md too far behind", md(func(m *typesv1.MachineDeployment) { m.Spec.Version = "v1.30.0" }), Observed{ControlPlaneVersion: "v1.34.4"},
			[]string{"spec.version: v1.30.0 is 4 minors behind the control plane's v1.34.4", "use v1.31 or newer"}},
		{"md unknown cp", md(func(m *typesv1.MachineDeployment) { m.Spec.Version = "v1.35.0" }), Observed{}, nil},
		{"machine immutable", machine(func(m *typesv1.Machine) { m.Spec.Image = "other" }), Observed{Current: machine(func(*typesv1.Machine) {})},
			[]string{"spec: a Machine is immutable"}},
		{"machine unchanged", machine(func(*typesv1.Machine) {}), Observed{Current: machine(func(*typesv1.Machine) {})}, nil},
		{"worker machine newer than cp", machine(func(*typesv1.Machine) {}), Observed{ControlPlaneVersion: "v1.33.0"}, []string{"is newer than the control plane's v1.33.0"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			require.NoError(t, Validate(tt.r), "precondition: the resource is valid on its own")
			err := ValidateAgainst(tt.r, tt.o)
			if len(tt.want) == 0 {
				if err != nil {
					t.Fatalf("ValidateAgainst(%s) = %v, want nil", tt.name, err)
				}
				return
			}
			if err == nil {
				t.Fatalf("ValidateAgainst(%s) = nil, want error containing %q", tt.name, tt.want)
			}
			if !errdefs.IsInvalidArgument(err) {
				t.Errorf("ValidateAgainst(%s) = %v, want an InvalidArgument error", tt.name, err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("ValidateAgainst(%s) = %q, want it to contain %q", tt.name, err, w)
				}
			}
		})
	}
}

func TestParseVersion(t *testing.T) {
	tests := []struct {
		in   string
		want Version
		ok   bool
	}{
		{"v1.34.4", Version{1, 34, 4}, true},
		{"v1.0.0", Version{1, 0, 0}, true},
		{"1.34.4", Version{}, false},
		{"v1.34", Version{}, false},
		{"v1.34.04", Version{}, false},
		{"v1.+34.4", Version{}, false},
		{"v1.34.4-rc.0", Version{}, false},
		{"", Version{}, false},
	}
	for _, tt := range tests {
		got, err := ParseVersion(tt.in)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("ParseVersion(%q) = %v, %v, want %v, ok=%v", tt.in, got, err, tt.want, tt.ok)
		}
	}
}

func TestIntOrPercentScaled(t *testing.T) {
	tests := []struct {
		in      string
		total   int
		roundUp bool
		want    int
	}{
		{"1", 10, true, 1},
		{"25%", 10, true, 3},
		{"25%", 10, false, 2},
		{"100%", 3, false, 3},
		{"0%", 5, true, 0},
	}
	for _, tt := range tests {
		v, err := ParseIntOrPercent(tt.in, IntOrPercent{})
		require.NoError(t, err)
		if got := v.Scaled(tt.total, tt.roundUp); got != tt.want {
			t.Errorf("ParseIntOrPercent(%q).Scaled(%d, %v) = %d, want %d", tt.in, tt.total, tt.roundUp, got, tt.want)
		}
	}
}

func TestKindName(t *testing.T) {
	r := md(func(*typesv1.MachineDeployment) {})
	kind, name := KindName(r)
	if kind != "MachineDeployment" || name != "lab-workers" {
		t.Errorf("KindName(md) = %q, %q, want MachineDeployment, lab-workers", kind, name)
	}
	// The resource is not modified by validation.
	before := proto.Clone(r)
	_ = Validate(r)
	_ = ValidateAgainst(r, Observed{ControlPlaneVersion: "v1.30.0"})
	if !proto.Equal(before, r) {
		t.Errorf("Validate modified its argument")
	}
}

func TestErrorFieldsAndGRPC(t *testing.T) {
	err := Validate(cp(func(c *typesv1.ControlPlane) { c.Spec.Replicas, c.Spec.RolloutMaxSurge = 4, 3 }))
	var verr *Error
	require.ErrorAs(t, err, &verr)
	var fields []string
	for _, f := range verr.Fields {
		fields = append(fields, f.Field)
	}
	if got, want := strings.Join(fields, ","), "spec.replicas,spec.rolloutMaxSurge"; got != want {
		t.Errorf("Validate(cp).Fields = %s, want %s", got, want)
	}
	// The message survives the gRPC edge with its class.
	back := errgrpc.FromGRPC(errgrpc.ToGRPC(err))
	if !errdefs.IsInvalidArgument(back) || back.Error() != err.Error() {
		t.Errorf("FromGRPC(ToGRPC(%q)) = %q, want the same InvalidArgument message", err, back)
	}
}

// TestValidateBoundsSizes is hole 6's field-size attack: a 1 MB
// rootDiskHint was accepted, and five such hosts made `kilnctl get hosts`
// fail for everyone. Every string of metadata and spec is bounded, and
// lists and maps; the refusal names the field and the size, never the
// value, and comes before any check that would quote it.
func TestValidateBoundsSizes(t *testing.T) {
	big := strings.Repeat("x y", 1<<20/3)
	tests := []struct {
		name string
		r    *controllerv1.Resource
		want string
	}{
		{"1 MB rootDiskHint", host(func(h *typesv1.Host) { h.Spec.RootDiskHint = big }), "spec.rootDiskHint: is 1048575 bytes long: at most 4096"},
		{"1 MB password", host(func(h *typesv1.Host) { h.Spec.Bmc.Password = big }), "spec.bmc.password: is 1048575 bytes long: at most 4096"},
		{"1 MB name", host(func(h *typesv1.Host) { h.Metadata.Name = big }), "metadata.name: is 1048575 bytes long"},
		{"1 MB label value", host(func(h *typesv1.Host) { h.Metadata.Labels = map[string]string{"rack": big} }), "metadata.labels[rack]: is 1048575 bytes long"},
		{"2000 labels", host(func(h *typesv1.Host) {
			h.Metadata.Labels = map[string]string{}
			for i := range 2000 {
				h.Metadata.Labels[fmt.Sprintf("l%d", i)] = "v"
			}
		}), "metadata.labels: has 2000 entries: at most 1024"},
		{"2000 unhealthy conditions", hc(func(x *typesv1.HealthCheck) {
			for range 2000 {
				x.Spec.UnhealthyConditions = append(x.Spec.UnhealthyConditions, x.Spec.UnhealthyConditions[0])
			}
		}), "spec.unhealthyConditions: has 2001 items: at most 1024"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := Validate(tc.r)
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.want)
			require.Less(t, len(err.Error()), 1024, "the refusal quotes the value: %.200s", err.Error())
		})
	}
	// At the bound is fine.
	require.NoError(t, Validate(host(func(h *typesv1.Host) { h.Spec.RootDiskHint = "/dev/" + strings.Repeat("a", MaxFieldBytes-5) })))
}

// TestValidateRefusesCIDRsOfEverything: ::/0 and 0.0.0.0/0 were accepted
// as a cluster's pod or service range (hole 6).
func TestValidateRefusesCIDRsOfEverything(t *testing.T) {
	for _, c := range []string{"0.0.0.0/0", "::/0"} {
		err := Validate(cluster(func(x *typesv1.Cluster) { x.Spec.PodCidr = c }))
		require.ErrorContains(t, err, "spec.podCidr: \""+c+"\" covers every address")
		err = Validate(cluster(func(x *typesv1.Cluster) { x.Spec.ServiceCidr = c }))
		require.ErrorContains(t, err, "spec.serviceCidr: \""+c+"\" covers every address")
	}
}
