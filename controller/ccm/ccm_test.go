package ccm

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
)

func read(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	require.NoError(t, err)
	return b
}

func TestCheckCCM(t *testing.T) {
	tests := []struct {
		file string
		// want are the fixes the error must name; none means no error.
		want []string
	}{
		{file: "ccm-openstack.yaml"},
		{file: "ccm-affinity.yaml"},
		{file: "ccm-pending.yaml", want: []string{
			"Deployment/acme-cloud-controller-manager: spec.template.spec.hostNetwork is not true",
			"set hostNetwork: true",
			`add nodeSelector node-role.kubernetes.io/control-plane: ""`,
			"no toleration for node.cloudprovider.kubernetes.io/uninitialized: add {key: node.cloudprovider.kubernetes.io/uninitialized, operator: Exists, effect: NoSchedule}",
			"no toleration for node.kubernetes.io/not-ready",
		}},
		// A CNI manifest is not a CCM: flannel tolerates everything and
		// runs on the host network, but not on control planes only.
		{file: "kube-flannel.yml", want: []string{"DaemonSet/kube-flannel-ds: not placed on control-plane nodes"}},
		{file: "tigera-installation.yaml", want: []string{"no Deployment or DaemonSet"}},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			err := CheckCCM(read(t, tt.file))
			if len(tt.want) == 0 {
				if err != nil {
					t.Errorf("CheckCCM(%q) = %v, want nil", tt.file, err)
				}
				return
			}
			if !errdefs.IsInvalidArgument(err) {
				t.Fatalf("CheckCCM(%q) = %v, want an InvalidArgument error", tt.file, err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("CheckCCM(%q) = %q, want it to contain %q", tt.file, err, w)
				}
			}
		})
	}
}

func TestCheckCCMNamesEachMissingToleration(t *testing.T) {
	err := CheckCCM(read(t, "ccm-pending.yaml"))
	var p *Problems
	require.True(t, errors.As(err, &p), "CheckCCM = %v, want *Problems", err)
	// hostNetwork, placement, uninitialized, not-ready; the control-plane
	// toleration is there.
	if len(p.Items) != 4 {
		t.Errorf("CheckCCM(ccm-pending.yaml) = %d problems %q, want 4", len(p.Items), p.Items)
	}
	if strings.Contains(err.Error(), "no toleration for node-role.kubernetes.io/control-plane") {
		t.Errorf("CheckCCM(ccm-pending.yaml) = %q, want no complaint about the control-plane toleration it has", err)
	}
}

func TestTolerationValueMustMatch(t *testing.T) {
	m := strings.Replace(string(read(t, "ccm-openstack.yaml")), `value: "true"`, `value: "yes"`, 1)
	err := CheckCCM([]byte(m))
	if err == nil || !strings.Contains(err.Error(), "no toleration for node.cloudprovider.kubernetes.io/uninitialized") {
		t.Errorf("CheckCCM(openstack with value yes) = %v, want the uninitialized toleration reported missing", err)
	}
}

func TestCheckCNI(t *testing.T) {
	tests := []struct {
		file, podCIDR string
		want          string // "" means accepted
	}{
		{"kube-flannel.yml", "10.244.0.0/16", ""},
		{"kube-flannel.yml", "10.200.0.0/16", "flannel ConfigMap/kube-flannel-cfg net-conf.json Network 10.244.0.0/16 disagrees with the cluster's podCidr 10.200.0.0/16: set it to 10.200.0.0/16"},
		{"calico.yaml", "192.168.0.0/16", ""},
		{"calico.yaml", "10.244.0.0/16", "calico DaemonSet/calico-node container calico-node env CALICO_IPV4POOL_CIDR 192.168.0.0/16 disagrees with the cluster's podCidr 10.244.0.0/16"},
		{"tigera-installation.yaml", "192.168.0.0/16", ""},
		{"tigera-installation.yaml", "10.244.0.0/16", "calico Installation spec.calicoNetwork.ipPools cidr 192.168.0.0/16 disagrees"},
		// A CCM manifest declares no pod network: nothing to disagree with.
		{"ccm-openstack.yaml", "10.244.0.0/16", ""},
	}
	for _, tt := range tests {
		err := CheckCNI(read(t, tt.file), tt.podCIDR)
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("CheckCNI(%q, %q) = %v, want nil", tt.file, tt.podCIDR, err)
		case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
			t.Errorf("CheckCNI(%q, %q) = %v, want an error containing %q", tt.file, tt.podCIDR, err, tt.want)
		case tt.want != "" && !errdefs.IsInvalidArgument(err):
			t.Errorf("CheckCNI(%q, %q) = %v, want class InvalidArgument", tt.file, tt.podCIDR, err)
		}
	}
}

func TestPodNetworks(t *testing.T) {
	nets, err := PodNetworks(read(t, "kube-flannel.yml"))
	require.NoError(t, err)
	if len(nets) != 1 || nets[0].CIDR != "10.244.0.0/16" {
		t.Errorf("PodNetworks(kube-flannel.yml) = %v, want one network 10.244.0.0/16", nets)
	}
}

func TestBadManifest(t *testing.T) {
	for _, m := range []string{"kind: [unclosed", "kind: ConfigMap\ndata:\n  net-conf.json: '{not json'\n"} {
		if err := CheckCNI([]byte(m), "10.244.0.0/16"); !errdefs.IsInvalidArgument(err) {
			t.Errorf("CheckCNI(%q) = %v, want InvalidArgument", m, err)
		}
	}
	if err := CheckCNI(read(t, "kube-flannel.yml"), "not-a-cidr"); !errdefs.IsInvalidArgument(err) {
		t.Errorf("CheckCNI(podCIDR not-a-cidr) = %v, want InvalidArgument", err)
	}
}
