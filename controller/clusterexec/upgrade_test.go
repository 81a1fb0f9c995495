package clusterexec_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"sigs.k8s.io/yaml"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/clusterexec"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store/storetest"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
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

// upgradeWorld is a one-member control plane at v1.33.13 (a spare host,
// rolloutMaxSurge 1) against the simulated kubeadm, with the cluster's API
// server played by client-go's fake clientset.
type upgradeWorld struct {
	*world
	cs *fake.Clientset
}

func newUpgradeWorld(t *testing.T, cs *fake.Clientset) *upgradeWorld {
	prev := kubetools.Previous()
	w := newWorld(t, 0)
	w.kube = func([]byte) (kubernetes.Interface, error) { return cs, nil }
	now := timestamppb.Now()
	meta := func(name string) *typesv1.ObjectMeta {
		return &typesv1.ObjectMeta{Name: name, Generation: 1, CreationTimestamp: now}
	}
	w.create("images", sim.ImageName, &typesv1.Image{Metadata: meta(sim.ImageName), Spec: &typesv1.ImageSpec{
		Url: "http://images.sim/" + sim.ImageName + ".raw.zst", Format: "raw.zst", Sha256: strings.Repeat("ab", 32)}})
	for _, name := range []string{"h1", "h2"} {
		w.create("hosts", name, &typesv1.Host{Metadata: meta(name),
			Spec: &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "redfish", Address: "sim://" + name}, RootDiskHint: "/dev/sda", Online: true}})
	}
	w.create("clusters", "c1", &typesv1.Cluster{Metadata: meta("c1"), Spec: &typesv1.ClusterSpec{
		KubernetesVersion: prev.Kubernetes, PodCidr: "10.244.0.0/16", ServiceCidr: "10.96.0.0/12", ControlPlaneEndpoint: "10.0.0.10:6443", DnsDomain: "cluster.local"}})
	w.create("controlplanes", "cp", &typesv1.ControlPlane{Metadata: meta("cp"), Spec: &typesv1.ControlPlaneSpec{
		Cluster: "c1", Replicas: 1, Version: prev.Kubernetes, Image: sim.ImageName, RolloutMaxSurge: 1}})
	return &upgradeWorld{world: w, cs: cs}
}

// bootstrapped waits for the first member and gives the cluster an admin
// kubeconfig (the simulated kubeadm init returns none; w.kube answers any).
func (w *upgradeWorld) bootstrapped() *typesv1.Machine {
	t := w.t
	old := w.waitRunning(1)[0]
	require.Equal(t, kubetools.Previous().Kubernetes, old.GetSpec().GetVersion())
	boot, err := clusterexec.LoadBootstrap(w.ctx, w.st, "c1")
	require.NoError(t, err)
	boot.Kubeconfig = "apiVersion: v1\nkind: Config\n"
	b, err := json.Marshal(boot)
	require.NoError(t, err)
	require.NoError(t, w.st.PutSecret(w.ctx, clusterexec.BootstrapSecretPath("c1"), b))
	return old
}

// upgradeTo stores an Image for version carrying addons (nil: none, as
// an image built before kiln-imagebuilder recorded them) and moves the
// control plane to it.
func (w *upgradeWorld) upgradeTo(version, image string, addons *typesv1.ImageAddons) {
	t := w.t
	w.create("images", image, &typesv1.Image{Metadata: &typesv1.ObjectMeta{Name: image, Generation: 1, CreationTimestamp: timestamppb.Now()},
		Spec: &typesv1.ImageSpec{Url: "http://images.sim/" + image + ".raw.zst", Format: "raw.zst", Sha256: strings.Repeat("cd", 32),
			KubernetesVersion: version, Addons: addons}})
	// The executor writes the ControlPlane's status meanwhile.
	storetest.Modify(t, w.st, "controlplanes", "cp", func(cp *typesv1.ControlPlane) {
		cp.Spec.Version, cp.Spec.Image = version, image
	})
}

func (w *upgradeWorld) cluster() *typesv1.Cluster {
	c := &typesv1.Cluster{}
	_, err := w.st.Get(w.ctx, "clusters", "c1", c)
	require.NoError(w.t, err)
	return c
}

func TestRecipeFromImage(t *testing.T) {
	full := &typesv1.ImageAddons{KubeProxy: "v1.35.2", Coredns: "v1.13.1", Etcd: "3.6.6-0", Pause: "3.10.1"}
	img := func(v string, a *typesv1.ImageAddons) *typesv1.Image {
		return &typesv1.Image{Spec: &typesv1.ImageSpec{KubernetesVersion: v, Addons: a}}
	}
	for _, tc := range []struct {
		name    string
		img     *typesv1.Image
		imgName string
		want    kubetools.Release
		wantErr []string
	}{
		// A version Kiln has no table entry for: the image is the recipe.
		{name: "from the image", img: img("v1.35.2", full), imgName: "debian12-k8s1.35.2",
			want: kubetools.Release{Kubernetes: "v1.35.2", Etcd: "3.6.6-0", CoreDNS: "v1.13.1", Pause: "3.10.1"}},
		{name: "no addon tags", img: img("v1.35.2", nil), imgName: "debian12-k8s1.35.2",
			wantErr: []string{"Kubernetes v1.35.2", `Image "debian12-k8s1.35.2" carries no addon tags`, "rebuild the image with kiln-imagebuilder"}},
		{name: "missing coredns", img: img("v1.35.2", &typesv1.ImageAddons{KubeProxy: "v1.35.2", Etcd: "3.6.6-0", Pause: "3.10.1"}), imgName: "x",
			wantErr: []string{`coredns ""`}},
		{name: "another version", img: img("v1.34.4", full), imgName: "debian12-k8s1.34.4",
			wantErr: []string{`Image "debian12-k8s1.34.4" is for Kubernetes v1.34.4`}},
		{name: "no such image", imgName: "gone", wantErr: []string{`Image "gone" not found`, "kiln-imagebuilder"}},
		{name: "no image named", wantErr: []string{"name no Image"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := clusterexec.RecipeFromImage(tc.img, tc.imgName, "v1.35.2")
			if tc.wantErr == nil {
				require.NoError(t, err)
				require.Equal(t, tc.want, got)
				return
			}
			require.True(t, errdefs.IsFailedPrecondition(err), "RecipeFromImage(%s) = %v, want FailedPrecondition", tc.name, err)
			for _, want := range tc.wantErr {
				require.ErrorContains(t, err, want)
			}
		})
	}
}

// TestMinorUpgradeMovesKubeadmConfigAndAddons rolls a one-member control
// plane from v1.33.13 to v1.34.4 onto an Image carrying v1.34.4's addon
// tags (spec.addons), whose first kubeadm-config update fails: the new
// member joins only after kubeadm-config says v1.34.4, kube-proxy and
// CoreDNS end at the image's tags, and the Cluster's events and its
// AddonUpgrade condition say so.
func TestMinorUpgradeMovesKubeadmConfigAndAddons(t *testing.T) {
	prev := kubetools.Previous()
	// The tags of the target image: deliberately not kubetools.Pinned's,
	// so that only the image can have supplied them.
	want := kubetools.Release{Kubernetes: "v1.34.4", Etcd: "3.6.99-0", CoreDNS: "v1.99.0", Pause: "3.10.1"}
	objs := append(addons("registry.k8s.io/kube-proxy:"+prev.Kubernetes, "registry.k8s.io/coredns/coredns:"+prev.CoreDNS),
		kubeadmConfig(clusterConfiguration133))
	cs := fake.NewClientset(objs...)
	w := newUpgradeWorld(t, cs)
	var mu sync.Mutex
	failed, joinsBeforeConfig := false, -1
	cs.PrependReactor("update", "configmaps", func(k8stesting.Action) (bool, runtime.Object, error) {
		mu.Lock()
		defer mu.Unlock()
		if !failed {
			failed = true
			return true, nil, errors.New("etcdserver: leader changed")
		}
		joinsBeforeConfig = count(w.kubeadm.Calls(), "KubeadmJoin", false)
		return false, nil, nil
	})
	stop := w.start()
	defer stop()
	old := w.bootstrapped()
	require.Equal(t, prev.Kubernetes, clusterConfigOf(t, cs)["kubernetesVersion"], "kubeadm-config moved before any upgrade")

	w.upgradeTo(want.Kubernetes, "debian12-k8s1.34.4-new", &typesv1.ImageAddons{KubeProxy: want.Kubernetes, Coredns: want.CoreDNS, Etcd: want.Etcd, Pause: want.Pause})

	var now1 *typesv1.Machine
	done := func() bool {
		ms := w.machines()
		if len(ms) != 1 || ms[0].GetSpec().GetVersion() != want.Kubernetes || ms[0].GetStatus().GetPhase() != clusterexec.PhaseRunning {
			return false
		}
		now1 = ms[0]
		proxy, dns := images(t, cs)
		return proxy == "registry.k8s.io/kube-proxy:"+want.Kubernetes && dns == "registry.k8s.io/coredns/coredns:"+want.CoreDNS
	}
	for deadline := time.Now().Add(40 * time.Second); !done(); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			for _, m := range w.machines() {
				t.Logf("machine %s %s %s %v", m.GetMetadata().GetName(), m.GetSpec().GetVersion(), m.GetStatus().GetPhase(), m.GetStatus().GetConditions())
			}
			proxy, dns := images(t, cs)
			t.Fatalf("control plane never at %s with its addons: kubeadm-config %v, kube-proxy %s, coredns %s",
				want.Kubernetes, clusterConfigOf(t, cs)["kubernetesVersion"], proxy, dns)
		}
	}
	require.NotEqual(t, old.GetMetadata().GetUid(), now1.GetMetadata().GetUid())

	cfg := clusterConfigOf(t, cs)
	require.Equal(t, want.Kubernetes, cfg["kubernetesVersion"])
	require.Equal(t, want.Etcd, cfg["etcd"].(map[string]any)["local"].(map[string]any)["imageTag"], "etcd tag from the image")
	mu.Lock()
	require.True(t, failed, "the injected update failure was not hit")
	require.Equal(t, 0, joinsBeforeConfig, "the new member joined before kubeadm-config said %s", want.Kubernetes)
	mu.Unlock()

	evs, err := w.rec.List(w.ctx, "clusters", "c1", 0)
	require.NoError(t, err)
	reasons := map[string]string{}
	for _, ev := range evs {
		reasons[ev.GetReason()] = ev.GetMessage()
	}
	require.Contains(t, reasons["KubeadmConfigUpgraded"], "kubernetesVersion "+prev.Kubernetes+" -> "+want.Kubernetes)
	require.Contains(t, reasons["AddonsUpgraded"], "registry.k8s.io/kube-proxy:"+want.Kubernetes)
	require.Contains(t, reasons["AddonsUpgraded"], "registry.k8s.io/coredns/coredns:"+want.CoreDNS)
	require.Contains(t, reasons["AddonsUpgraded"], `Image "debian12-k8s1.34.4-new"`)
	require.NotContains(t, reasons, clusterexec.ReasonRecipeUnknown)
	au := conditions.Get(w.cluster().GetStatus().GetConditions(), clusterexec.ConditionAddonUpgrade)
	require.NotNil(t, au, "no AddonUpgrade condition on the Cluster")
	require.Equal(t, conditions.True, au.GetStatus())
	require.Equal(t, clusterexec.ReasonAddonsUpgraded, au.GetReason())
}

// TestUpgradeWithoutRecipeBlocks moves the control plane to a version
// whose Image carries no addon tags (built before kiln-imagebuilder
// recorded them): the Cluster's AddonUpgrade condition turns False with
// reason RecipeUnknown and a message naming the version, the image and the
// fix; the new member does not join, and kubeadm-config, kube-proxy and
// CoreDNS are untouched. An image rebuilt with the tags then lifts it.
func TestUpgradeWithoutRecipeBlocks(t *testing.T) {
	prev := kubetools.Previous()
	const target, image = "v1.34.5", "debian12-k8s1.34.5-old" // a patch Kiln has no table entry for
	cs := fake.NewClientset(append(addons("registry.k8s.io/kube-proxy:"+prev.Kubernetes, "registry.k8s.io/coredns/coredns:"+prev.CoreDNS),
		kubeadmConfig(clusterConfiguration133))...)
	w := newUpgradeWorld(t, cs)
	stop := w.start()
	defer stop()
	w.bootstrapped()
	cs.ClearActions()

	w.upgradeTo(target, image, nil)

	var au *typesv1.Condition
	for deadline := time.Now().Add(40 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		au = conditions.Get(w.cluster().GetStatus().GetConditions(), clusterexec.ConditionAddonUpgrade)
		if au != nil {
			break
		}
		if time.Now().After(deadline) {
			for _, m := range w.machines() {
				t.Logf("machine %s %s %s %v", m.GetMetadata().GetName(), m.GetSpec().GetVersion(), m.GetStatus().GetPhase(), m.GetStatus().GetConditions())
			}
			t.Fatalf("no %s condition on the Cluster: %v", clusterexec.ConditionAddonUpgrade, w.cluster().GetStatus().GetConditions())
		}
	}
	t.Logf("Cluster c1: %s=%s %s: %s", au.GetType(), au.GetStatus(), au.GetReason(), au.GetMessage())
	require.Equal(t, conditions.False, au.GetStatus())
	require.Equal(t, clusterexec.ReasonRecipeUnknown, au.GetReason())
	for _, want := range []string{"Kubernetes " + target, `Image "` + image + `"`, "rebuild the image with kiln-imagebuilder"} {
		require.Contains(t, au.GetMessage(), want)
	}

	// Blocked: the new member never joined and no addon step ran.
	require.Zero(t, count(w.kubeadm.Calls(), "KubeadmJoin", false), "a member joined without a recipe")
	for _, a := range cs.Actions() {
		require.NotEqual(t, "update", a.GetVerb(), "an addon step ran without a recipe: %v", a)
	}
	require.Equal(t, prev.Kubernetes, clusterConfigOf(t, cs)["kubernetesVersion"])
	proxy, dns := images(t, cs)
	require.Equal(t, "registry.k8s.io/kube-proxy:"+prev.Kubernetes, proxy)
	require.Equal(t, "registry.k8s.io/coredns/coredns:"+prev.CoreDNS, dns)
	for _, m := range w.machines() {
		if m.GetSpec().GetVersion() == target {
			require.NotEqual(t, clusterexec.PhaseRunning, m.GetStatus().GetPhase(), "machine %s at %s Running", m.GetMetadata().GetName(), target)
		}
	}
	evs, err := w.rec.List(w.ctx, "clusters", "c1", 0)
	require.NoError(t, err)
	warned := false
	for _, ev := range evs {
		warned = warned || (ev.GetReason() == clusterexec.ReasonRecipeUnknown && ev.GetType() == "Warning")
	}
	require.True(t, warned, "no RecipeUnknown warning event on the Cluster")

	// The fix the message names: an image of that version with its tags,
	// and the waiting member (laid with the old image) deleted.
	w.upgradeTo(target, "debian12-k8s1.34.5-new", &typesv1.ImageAddons{KubeProxy: target, Coredns: "v1.12.1", Etcd: "3.6.5-0", Pause: "3.10.1"})
	for _, m := range w.machines() {
		if m.GetSpec().GetImage() == image {
			require.NoError(t, w.st.Delete(w.ctx, "machines", m.GetMetadata().GetName(), 0))
		}
	}
	for deadline := time.Now().Add(40 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		au = conditions.Get(w.cluster().GetStatus().GetConditions(), clusterexec.ConditionAddonUpgrade)
		proxy, _ := images(t, cs)
		if au.GetStatus() == conditions.True && proxy == "registry.k8s.io/kube-proxy:"+target {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the rebuilt image: %s %v, kube-proxy %s", clusterexec.ConditionAddonUpgrade, au, proxy)
		}
	}
	require.Equal(t, target, clusterConfigOf(t, cs)["kubernetesVersion"])
}

// TestRestartMidUpgradeKeepsAddonSteps rolls a one-member control plane
// to v1.34.4 and restarts the executor (a new instance over the same
// store, as a new leader) mid-upgrade: after the addons moved to the new
// release and while the old member's drain is held up (a
// PodDisruptionBudget). The new executor takes the rollout up where it was
// (it drains the old member again) and does not run the addon step again:
// the Cluster's status.addons records it, not the old executor's memory.
func TestRestartMidUpgradeKeepsAddonSteps(t *testing.T) {
	prev := kubetools.Previous()
	want := kubetools.Release{Kubernetes: "v1.34.4", Etcd: "3.6.99-0", CoreDNS: "v1.99.0", Pause: "3.10.1"}
	cs := fake.NewClientset(append(addons("registry.k8s.io/kube-proxy:"+prev.Kubernetes, "registry.k8s.io/coredns/coredns:"+prev.CoreDNS),
		kubeadmConfig(clusterConfiguration133))...)
	w := newUpgradeWorld(t, cs)
	drains := &stuckDrainer{prefix: "h1", stuck: map[string]int{}, done: map[string]int{}}
	w.drain = drains.Drain
	stop := w.start()
	old := w.bootstrapped()
	require.Equal(t, "h1", old.GetSpec().GetHost())

	w.upgradeTo(want.Kubernetes, "debian12-k8s1.34.4-new", &typesv1.ImageAddons{KubeProxy: want.Kubernetes, Coredns: want.CoreDNS, Etcd: want.Etcd, Pause: want.Pause})
	require.Eventually(t, func() bool {
		proxy, dns := images(t, cs)
		return proxy == "registry.k8s.io/kube-proxy:"+want.Kubernetes && dns == "registry.k8s.io/coredns/coredns:"+want.CoreDNS &&
			w.cluster().GetStatus().GetAddons().GetVersion() == want.Kubernetes && drains.started("h1") >= 1
	}, 60*time.Second, 20*time.Millisecond, "addons never moved to %s with the old member's drain under way", want.Kubernetes)
	require.Equal(t, want.Kubernetes, w.cluster().GetStatus().GetAddons().GetKubeadmConfigVersion(), "kubeadm-config step recorded")
	stop()

	cs.ClearActions()
	obs := &reconciles{now: time.Now}
	w.observer = obs
	stop = w.start()
	defer stop()
	require.Eventually(t, func() bool { return drains.started("h1") >= 2 && len(obs.times()) >= 3 }, 60*time.Second, 20*time.Millisecond,
		"the new executor did not take up the rollout (drains of h1 %d, reconciles %d)", drains.started("h1"), len(obs.times()))
	ms := w.machines()
	stillOld := false
	for _, m := range ms {
		stillOld = stillOld || m.GetMetadata().GetUid() == old.GetMetadata().GetUid()
	}
	require.True(t, stillOld, "the old member is gone: the restart was not mid-upgrade")
	for _, a := range cs.Actions() {
		switch a.GetResource().Resource {
		case "daemonsets", "deployments", "configmaps":
			t.Errorf("the new executor ran an addon step again: %s %s", a.GetVerb(), a.GetResource().Resource)
		}
	}
}
