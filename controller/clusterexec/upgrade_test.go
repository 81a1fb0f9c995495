package clusterexec_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"sigs.k8s.io/yaml"

	"github.com/kilnhq/kiln/controller/clusterexec"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
)

// What kubeadm init v1.33 uploads (kubeadm config view), with the etcd tag
// pinned and the DNS tag not.
const clusterConfiguration133 = `apiServer: {}
apiVersion: kubeadm.k8s.io/v1beta4
caCertificateValidityPeriod: 87600h0m0s
certificateValidityPeriod: 8760h0m0s
certificatesDir: /etc/kubernetes/pki
clusterName: lab
controlPlaneEndpoint: 10.251.248.1:6443
controllerManager: {}
dns: {}
encryptionAlgorithm: RSA-2048
etcd:
  local:
    dataDir: /var/lib/etcd
    imageTag: 3.5.24-0
imageRepository: registry.k8s.io
kind: ClusterConfiguration
kubernetesVersion: v1.33.13
networking:
  dnsDomain: cluster.local
  podSubnet: 10.244.0.0/16
  serviceSubnet: 10.96.0.0/12
proxy: {}
scheduler: {}
`

func kubeadmConfig(cc string) *corev1.ConfigMap {
	return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: clusterexec.KubeadmConfigMap, Namespace: "kube-system"},
		Data: map[string]string{"ClusterConfiguration": cc}}
}

func clusterConfigOf(t *testing.T, cs *fake.Clientset) map[string]any {
	t.Helper()
	cm, err := cs.CoreV1().ConfigMaps("kube-system").Get(context.Background(), clusterexec.KubeadmConfigMap, metav1.GetOptions{})
	require.NoError(t, err)
	var cfg map[string]any
	require.NoError(t, yaml.Unmarshal([]byte(cm.Data["ClusterConfiguration"]), &cfg))
	return cfg
}

func TestSetKubeadmVersionMovesTheClusterToTheNewMinor(t *testing.T) {
	ctx := context.Background()
	cs := fake.NewClientset(kubeadmConfig(clusterConfiguration133))
	r := kubetools.Pinned()

	what, err := clusterexec.SetKubeadmVersion(ctx, cs, r)
	require.NoError(t, err)
	require.Contains(t, what, "kubernetesVersion v1.33.13 -> v1.34.4")
	require.Contains(t, what, "etcd imageTag 3.5.24-0 -> 3.6.5-0")
	require.NotContains(t, what, "dns")

	cfg := clusterConfigOf(t, cs)
	require.Equal(t, "v1.34.4", cfg["kubernetesVersion"])
	require.Equal(t, "3.6.5-0", cfg["etcd"].(map[string]any)["local"].(map[string]any)["imageTag"])
	require.Equal(t, "/var/lib/etcd", cfg["etcd"].(map[string]any)["local"].(map[string]any)["dataDir"])
	require.Equal(t, map[string]any{}, cfg["dns"], "an unpinned DNS tag stays unpinned")
	require.Equal(t, "10.251.248.1:6443", cfg["controlPlaneEndpoint"])
	require.Equal(t, "10.244.0.0/16", cfg["networking"].(map[string]any)["podSubnet"])

	// Again: nothing to do, no write.
	cs.ClearActions()
	what, err = clusterexec.SetKubeadmVersion(ctx, cs, r)
	require.NoError(t, err)
	require.Empty(t, what)
	for _, a := range cs.Actions() {
		require.NotEqual(t, "update", a.GetVerb(), "second pass wrote %v", a)
	}
}

func TestSetKubeadmVersionLeavesANewerConfig(t *testing.T) {
	cs := fake.NewClientset(kubeadmConfig(`kind: ClusterConfiguration
kubernetesVersion: v1.34.4
`))
	what, err := clusterexec.SetKubeadmVersion(context.Background(), cs, kubetools.Previous())
	require.NoError(t, err)
	require.Empty(t, what)
	require.Equal(t, "v1.34.4", clusterConfigOf(t, cs)["kubernetesVersion"])
}

func TestSetKubeadmVersionErrors(t *testing.T) {
	ctx := context.Background()
	_, err := clusterexec.SetKubeadmVersion(ctx, fake.NewClientset(), kubetools.Pinned())
	require.ErrorContains(t, err, "read kube-system/kubeadm-config")

	cs := fake.NewClientset(kubeadmConfig(clusterConfiguration133))
	cs.PrependReactor("update", "configmaps", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("etcdserver: request timed out")
	})
	_, err = clusterexec.SetKubeadmVersion(ctx, cs, kubetools.Pinned())
	require.ErrorContains(t, err, "update kube-system/kubeadm-config: etcdserver: request timed out")
	require.Equal(t, "v1.33.13", clusterConfigOf(t, cs)["kubernetesVersion"])
}

func addons(proxyImage, dnsImage string) []runtime.Object {
	return []runtime.Object{
		&appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "kube-proxy", Namespace: "kube-system"},
			Spec: appsv1.DaemonSetSpec{Template: corev1.PodTemplateSpec{Spec: corev1.PodSpec{
				Containers: []corev1.Container{{Name: "kube-proxy", Image: proxyImage, Command: []string{"/usr/local/bin/kube-proxy"}}}}}}},
		&appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: "coredns", Namespace: "kube-system"},
			Spec: appsv1.DeploymentSpec{Template: corev1.PodTemplateSpec{Spec: corev1.PodSpec{
				Containers: []corev1.Container{{Name: "coredns", Image: dnsImage}}}}}},
	}
}

func images(t *testing.T, cs *fake.Clientset) (proxy, dns string) {
	t.Helper()
	ds, err := cs.AppsV1().DaemonSets("kube-system").Get(context.Background(), "kube-proxy", metav1.GetOptions{})
	require.NoError(t, err)
	d, err := cs.AppsV1().Deployments("kube-system").Get(context.Background(), "coredns", metav1.GetOptions{})
	require.NoError(t, err)
	return ds.Spec.Template.Spec.Containers[0].Image, d.Spec.Template.Spec.Containers[0].Image
}

func TestSetAddonImagesMovesKubeProxyAndCoreDNS(t *testing.T) {
	ctx := context.Background()
	cs := fake.NewClientset(addons("registry.k8s.io/kube-proxy:v1.33.13", "registry.k8s.io/coredns/coredns:v1.12.0")...)

	changed, err := clusterexec.SetAddonImages(ctx, cs, kubetools.Pinned())
	require.NoError(t, err)
	require.Equal(t, []string{
		"DaemonSet kube-system/kube-proxy: registry.k8s.io/kube-proxy:v1.33.13 -> registry.k8s.io/kube-proxy:v1.34.4",
		"Deployment kube-system/coredns: registry.k8s.io/coredns/coredns:v1.12.0 -> registry.k8s.io/coredns/coredns:v1.12.1",
	}, changed)
	proxy, dns := images(t, cs)
	require.Equal(t, "registry.k8s.io/kube-proxy:v1.34.4", proxy)
	require.Equal(t, "registry.k8s.io/coredns/coredns:v1.12.1", dns)

	changed, err = clusterexec.SetAddonImages(ctx, cs, kubetools.Pinned())
	require.NoError(t, err)
	require.Empty(t, changed, "second pass")
}

func TestSetAddonImagesKeepsTheRepository(t *testing.T) {
	cs := fake.NewClientset(addons("mirror.example:5000/k8s/kube-proxy:v1.33.13", "mirror.example:5000/coredns@sha256:abc")...)
	_, err := clusterexec.SetAddonImages(context.Background(), cs, kubetools.Pinned())
	require.NoError(t, err)
	proxy, dns := images(t, cs)
	require.Equal(t, "mirror.example:5000/k8s/kube-proxy:v1.34.4", proxy)
	require.Equal(t, "mirror.example:5000/coredns:v1.12.1", dns)
}

func TestSetAddonImagesWithoutAddons(t *testing.T) {
	changed, err := clusterexec.SetAddonImages(context.Background(), fake.NewClientset(), kubetools.Pinned())
	require.NoError(t, err)
	require.Empty(t, changed)
}

func TestSetAddonImagesUpdateFails(t *testing.T) {
	cs := fake.NewClientset(addons("registry.k8s.io/kube-proxy:v1.33.13", "registry.k8s.io/coredns/coredns:v1.12.0")...)
	cs.PrependReactor("update", "deployments", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("the object has been modified")
	})
	changed, err := clusterexec.SetAddonImages(context.Background(), cs, kubetools.Pinned())
	require.ErrorContains(t, err, "update Deployment kube-system/coredns: the object has been modified")
	require.Len(t, changed, 1)
	proxy, dns := images(t, cs)
	require.Equal(t, "registry.k8s.io/kube-proxy:v1.34.4", proxy)
	require.Equal(t, "registry.k8s.io/coredns/coredns:v1.12.0", dns, "left for the next pass")
}
