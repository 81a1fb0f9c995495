package kubeadm

import (
	"os"
	"path/filepath"
	"testing"
)

func TestAdvertisedEndpoint(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct{ name, manifest, want string }{
		{"kubeadm's annotation", `apiVersion: v1
kind: Pod
metadata:
  annotations:
    kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint: 10.251.7.2:6443
  name: kube-apiserver
`, "10.251.7.2:6443"},
		{"quoted IPv6", `    "kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint": "[fd00::2]:6443"` + "\n", "[fd00::2]:6443"},
		{"no annotation", "kind: Pod\n", ""},
		{"not an endpoint", "    kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint: nowhere\n", ""},
		// Found by FuzzOutput: a port without a host was taken.
		{"no host", "kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint::6443\n", ""},
	} {
		p := filepath.Join(dir, tc.name)
		if err := os.WriteFile(p, []byte(tc.manifest), 0o600); err != nil {
			t.Fatal(err)
		}
		if got := advertisedEndpoint(p); got != tc.want {
			t.Errorf("advertisedEndpoint(%s) = %q, want %q", tc.name, got, tc.want)
		}
	}
	if got := advertisedEndpoint(filepath.Join(dir, "missing")); got != "" {
		t.Errorf("advertisedEndpoint(missing file) = %q, want \"\"", got)
	}
}
