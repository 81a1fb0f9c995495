package kubeadm

import (
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

var update = flag.Bool("update", false, "rewrite testdata/*.yaml from the generated configuration")

func labCluster() *agentv1.ClusterConfig {
	return &agentv1.ClusterConfig{
		Name:                 "lab",
		KubernetesVersion:    "v1.34.4",
		PodCidr:              "172.20.0.0/16",
		ServiceCidr:          "172.21.0.0/16",
		ControlPlaneEndpoint: "10.251.0.2:6443",
		DnsDomain:            "cluster.local",
		CgroupDriver:         "cgroupfs",
		Role:                 RoleControlPlane,
		NodeName:             "node-1",
		AdvertiseAddress:     "10.251.0.2",
	}
}

const (
	testToken   = "abcdef.0123456789abcdef"
	testHash    = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	testCertKey = "f0e1d2c3b4a5968778695a4b3c2d1e0ff0e1d2c3b4a5968778695a4b3c2d1e0f"
)

func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	p := filepath.Join("testdata", name)
	if *update {
		require.NoError(t, os.WriteFile(p, got, 0o644))
	}
	want, err := os.ReadFile(p)
	require.NoError(t, err, "run go test ./agent/kubeadm -update to create it")
	if string(got) != string(want) {
		t.Errorf("%s differs from the generated configuration (go test ./agent/kubeadm -update, then review the diff):\n--- got\n%s\n--- want\n%s", p, got, want)
	}
}

func TestInitConfigGolden(t *testing.T) {
	external := labCluster()
	external.CloudProvider = "external"
	minimal := &agentv1.ClusterConfig{KubernetesVersion: "v1.34.4"}
	tests := []struct {
		name     string
		c        *agentv1.ClusterConfig
		certKey  string
		patchDir string
	}{
		{"init-lab.yaml", labCluster(), "", ""},
		{"init-upload-certs.yaml", labCluster(), testCertKey, ""},
		{"init-cloud-external.yaml", external, "", ""},
		{"init-minimal.yaml", minimal, "", ""},
		{"init-patches.yaml", labCluster(), "", "/etc/kiln/kubeadm-patches"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := InitConfig(tt.c, tt.certKey, tt.patchDir)
			require.NoError(t, err)
			golden(t, tt.name, got)
		})
	}
}

func TestJoinConfigGolden(t *testing.T) {
	worker := labCluster()
	worker.Role, worker.NodeName, worker.AdvertiseAddress = RoleWorker, "node-2", "10.251.0.3"
	cp := labCluster()
	cp.NodeName, cp.AdvertiseAddress = "node-3", "10.251.0.4"
	tests := []struct {
		name string
		c    *agentv1.ClusterConfig
		r    JoinRequest
	}{
		{"join-worker.yaml", worker, JoinRequest{APIServerEndpoint: "10.251.0.2:6443", Token: testToken, CAHash: testHash}},
		{"join-control-plane.yaml", cp, JoinRequest{APIServerEndpoint: "10.251.0.2:6443", Token: testToken, CAHash: testHash, ControlPlane: true, CertificateKey: testCertKey}},
		{"join-patches.yaml", worker, JoinRequest{APIServerEndpoint: "10.251.0.2:6443", Token: testToken, CAHash: testHash, PatchDir: "/etc/kiln/kubeadm-patches"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := JoinConfig(tt.c, tt.r)
			require.NoError(t, err)
			golden(t, tt.name, got)
		})
	}
}

func TestInitConfigPinsVersion(t *testing.T) {
	tests := []struct {
		version string
		ok      bool
	}{
		{"v1.34.4", true},
		{"v1.35.0", true},
		{"", false},
		{"stable", false},
		{"stable-1", false},
		{"latest", false},
		{"1.34.4", false},
		{"v1.34", false},
		{"v1.34.4-rc.0", false},
		{"v01.34.4", false},
		{"ci/latest", false},
	}
	for _, tt := range tests {
		c := labCluster()
		c.KubernetesVersion = tt.version
		got, err := InitConfig(c, "", "")
		if tt.ok {
			if err != nil {
				t.Errorf("InitConfig(version %q) = %v, want no error", tt.version, err)
				continue
			}
			if !strings.Contains(string(got), "kubernetesVersion: "+tt.version+"\n") {
				t.Errorf("InitConfig(version %q) does not pin kubernetesVersion:\n%s", tt.version, got)
			}
			continue
		}
		if !errdefs.IsInvalidArgument(err) {
			t.Errorf("InitConfig(version %q) = %v, want InvalidArgument", tt.version, err)
		}
	}
}

func TestInitConfigRefusesBadFields(t *testing.T) {
	tests := []struct {
		name   string
		modify func(*agentv1.ClusterConfig)
	}{
		{"nil-safe pod cidr", func(c *agentv1.ClusterConfig) { c.PodCidr = "172.20.0.0" }},
		{"service cidr", func(c *agentv1.ClusterConfig) { c.ServiceCidr = "not-a-cidr" }},
		{"advertise address", func(c *agentv1.ClusterConfig) { c.AdvertiseAddress = "node-1" }},
		{"node name", func(c *agentv1.ClusterConfig) { c.NodeName = "Node_1" }},
		{"cgroup driver", func(c *agentv1.ClusterConfig) { c.CgroupDriver = "cgroupv2" }},
		{"cloud provider", func(c *agentv1.ClusterConfig) { c.CloudProvider = "aws" }},
		{"role", func(c *agentv1.ClusterConfig) { c.Role = "master" }},
		// Found by FuzzConfig: free text went into the YAML as is, and
		// invalid UTF-8 reached kubeadm as U+FFFD.
		{"endpoint not UTF-8", func(c *agentv1.ClusterConfig) { c.ControlPlaneEndpoint = "\xd8" }},
		{"endpoint with a path", func(c *agentv1.ClusterConfig) { c.ControlPlaneEndpoint = "https://10.0.0.1:6443/x" }},
		{"repository with a newline", func(c *agentv1.ClusterConfig) { c.ImageRepository = "registry.lab\nx" }},
	}
	for _, tt := range tests {
		c := labCluster()
		tt.modify(c)
		if _, err := InitConfig(c, "", ""); !errdefs.IsInvalidArgument(err) {
			t.Errorf("InitConfig(%s) = %v, want InvalidArgument", tt.name, err)
		}
	}
	if _, err := InitConfig(nil, "", ""); !errdefs.IsInvalidArgument(err) {
		t.Errorf("InitConfig(nil) = %v, want InvalidArgument", err)
	}
	if _, err := InitConfig(labCluster(), "short", ""); !errdefs.IsInvalidArgument(err) {
		t.Errorf("InitConfig(certKey %q) = %v, want InvalidArgument", "short", err)
	}
}

func TestJoinConfigRefusesMalformed(t *testing.T) {
	good := JoinRequest{APIServerEndpoint: "10.251.0.2:6443", Token: testToken, CAHash: testHash}
	tests := []struct {
		name   string
		modify func(*JoinRequest)
	}{
		{"hash without algorithm", func(r *JoinRequest) { r.CAHash = strings.TrimPrefix(testHash, "sha256:") }},
		{"hash md5", func(r *JoinRequest) { r.CAHash = "md5:0123456789abcdef0123456789abcdef" }},
		{"hash short", func(r *JoinRequest) { r.CAHash = "sha256:0123" }},
		{"hash not hex", func(r *JoinRequest) { r.CAHash = "sha256:" + strings.Repeat("zz", 32) }},
		{"empty hash", func(r *JoinRequest) { r.CAHash = "" }},
		{"token", func(r *JoinRequest) { r.Token = "abcdef0123456789abcdef" }},
		{"token upper", func(r *JoinRequest) { r.Token = "ABCDEF.0123456789abcdef" }},
		{"endpoint", func(r *JoinRequest) { r.APIServerEndpoint = "10.251.0.2" }},
		{"control plane without key", func(r *JoinRequest) { r.ControlPlane = true }},
	}
	for _, tt := range tests {
		r := good
		tt.modify(&r)
		_, err := JoinConfig(labCluster(), r)
		if !errdefs.IsInvalidArgument(err) {
			t.Errorf("JoinConfig(%s) = %v, want InvalidArgument", tt.name, err)
			continue
		}
		if strings.Contains(err.Error(), "0123456789abcdef") && strings.HasPrefix(tt.name, "token") {
			t.Errorf("JoinConfig(%s) error %q contains the token", tt.name, err)
		}
	}
}

func TestRedact(t *testing.T) {
	r := newRedactor(testCertKey)
	tests := []struct{ in, want string }{
		{"kubeadm join 10.0.0.1:6443 --token abcdef.0123456789abcdef \\", "kubeadm join 10.0.0.1:6443 --token <redacted> \\"},
		{"\t--control-plane --certificate-key " + testCertKey, "\t--control-plane --certificate-key <redacted>"},
		{testCertKey, "<redacted>"},
		{"[bootstrap-token] Using token: zzzzzz.yyyyyyyyyyyyyyyy", "[bootstrap-token] Using token: <redacted>"},
		{"--discovery-token-ca-cert-hash " + testHash, "--discovery-token-ca-cert-hash " + testHash},
	}
	for _, tt := range tests {
		if got := r.redact(tt.in); got != tt.want {
			t.Errorf("redact(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}
