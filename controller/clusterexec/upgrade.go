package clusterexec

import (
	"context"
	"fmt"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/version"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/yaml"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/clusterplan"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// A minor (or patch) upgrade by reimaging does to the cluster what
// `kubeadm upgrade apply` does besides the static pods:
//
//   - before the first control-plane member of a newer version joins, its
//     upload-config phase: kube-system/kubeadm-config's
//     ClusterConfiguration.kubernetesVersion becomes that version (and the
//     etcd and CoreDNS image tags when the config pins them). kubeadm join
//     --control-plane writes the static pods of the version in that
//     ConfigMap, whose images a newer offline image does not hold;
//   - once that member's node is Ready, its addon phase: the kube-proxy
//     DaemonSet and the CoreDNS Deployment move to the new release's images
//     (the tags of imagebuilder/kubetools' release recipe).
//
// Both go through client-go with the cluster's admin kubeconfig, are
// idempotent, record an event on the Cluster when they change something and
// are retried on the next pass when they fail.

// KubeClientFunc builds a client of a cluster from its admin kubeconfig.
type KubeClientFunc func(kubeconfig []byte) (kubernetes.Interface, error)

// KubeadmConfigMap is kubeadm's cluster-wide configuration
// (namespace kube-system).
const KubeadmConfigMap = "kubeadm-config"

// kubeCallTimeout bounds the API calls of one upgrade step.
const kubeCallTimeout = 30 * time.Second

func defaultKubeClient(kubeconfig []byte) (kubernetes.Interface, error) {
	cfg, err := clientcmd.RESTConfigFromKubeConfig(kubeconfig)
	if err != nil {
		return nil, err
	}
	cfg.Timeout = kubeCallTimeout
	return kubernetes.NewForConfig(cfg)
}

func (e *Executor) kubeClient(kubeconfig string) (kubernetes.Interface, error) {
	f := e.deps.KubeClient
	if f == nil {
		f = defaultKubeClient
	}
	return f([]byte(kubeconfig))
}

// SetKubeadmVersion sets ClusterConfiguration.kubernetesVersion in
// kube-system/kubeadm-config to r.Kubernetes when it is older, and the
// pinned etcd.local.imageTag and dns.imageTag (only if set) to r's. It
// returns what it changed ("" when nothing). A config that is already at
// r's version or newer is left as it is.
func SetKubeadmVersion(ctx context.Context, cs kubernetes.Interface, r kubetools.Release) (string, error) {
	cms := cs.CoreV1().ConfigMaps(metav1.NamespaceSystem)
	cm, err := cms.Get(ctx, KubeadmConfigMap, metav1.GetOptions{})
	if err != nil {
		return "", fmt.Errorf("read kube-system/%s: %w", KubeadmConfigMap, err)
	}
	raw := cm.Data["ClusterConfiguration"]
	var cfg map[string]any
	if err := yaml.Unmarshal([]byte(raw), &cfg); err != nil || cfg == nil {
		return "", fmt.Errorf("kube-system/%s: ClusterConfiguration is not YAML: %v", KubeadmConfigMap, err)
	}
	have, _ := cfg["kubernetesVersion"].(string)
	want, err := version.ParseSemantic(r.Kubernetes)
	if err != nil {
		return "", err
	}
	if hv, err := version.ParseSemantic(have); err == nil && !hv.LessThan(want) {
		return "", nil
	}
	var changed []string
	cfg["kubernetesVersion"] = r.Kubernetes
	changed = append(changed, fmt.Sprintf("kubernetesVersion %s -> %s", have, r.Kubernetes))
	if etcd, ok := cfg["etcd"].(map[string]any); ok {
		if local, ok := etcd["local"].(map[string]any); ok {
			if tag, ok := local["imageTag"].(string); ok && tag != "" && tag != r.Etcd {
				local["imageTag"] = r.Etcd
				changed = append(changed, fmt.Sprintf("etcd imageTag %s -> %s", tag, r.Etcd))
			}
		}
	}
	if dns, ok := cfg["dns"].(map[string]any); ok {
		if tag, ok := dns["imageTag"].(string); ok && tag != "" && tag != r.CoreDNS {
			dns["imageTag"] = r.CoreDNS
			changed = append(changed, fmt.Sprintf("dns imageTag %s -> %s", tag, r.CoreDNS))
		}
	}
	out, err := yaml.Marshal(cfg)
	if err != nil {
		return "", err
	}
	cm.Data["ClusterConfiguration"] = string(out)
	if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		return "", fmt.Errorf("update kube-system/%s: %w", KubeadmConfigMap, err)
	}
	return "kube-system/" + KubeadmConfigMap + ": " + strings.Join(changed, ", "), nil
}

// withTag returns image with its tag replaced by tag (the repository kept).
func withTag(image, tag string) string {
	repo := image
	if i := strings.LastIndex(image, ":"); i > strings.LastIndex(image, "/") {
		repo = image[:i]
	}
	if i := strings.Index(repo, "@"); i >= 0 {
		repo = repo[:i]
	}
	return repo + ":" + tag
}

// SetAddonImages moves the kube-proxy DaemonSet's kube-proxy container to
// kube-proxy:r.Kubernetes and the coredns Deployment's coredns container to
// coredns:r.CoreDNS (kube-system; the repository of each image is kept). A
// missing addon is skipped (a cluster may run without either). It returns
// what it changed.
func SetAddonImages(ctx context.Context, cs kubernetes.Interface, r kubetools.Release) ([]string, error) {
	var changed []string
	dss := cs.AppsV1().DaemonSets(metav1.NamespaceSystem)
	ds, err := dss.Get(ctx, "kube-proxy", metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
	case err != nil:
		return changed, fmt.Errorf("read DaemonSet kube-system/kube-proxy: %w", err)
	default:
		upd, msg := false, []string(nil)
		for i, c := range ds.Spec.Template.Spec.Containers {
			if c.Name != "kube-proxy" {
				continue
			}
			if img := withTag(c.Image, r.Kubernetes); img != c.Image {
				ds.Spec.Template.Spec.Containers[i].Image = img
				msg = append(msg, "DaemonSet kube-system/kube-proxy: "+c.Image+" -> "+img)
				upd = true
			}
		}
		if upd {
			if _, err := dss.Update(ctx, ds, metav1.UpdateOptions{}); err != nil {
				return nil, fmt.Errorf("update DaemonSet kube-system/kube-proxy: %w", err)
			}
			changed = append(changed, msg...)
		}
	}
	deps := cs.AppsV1().Deployments(metav1.NamespaceSystem)
	d, err := deps.Get(ctx, "coredns", metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
	case err != nil:
		return changed, fmt.Errorf("read Deployment kube-system/coredns: %w", err)
	default:
		upd, msg := false, []string(nil)
		for i, c := range d.Spec.Template.Spec.Containers {
			if c.Name != "coredns" {
				continue
			}
			if img := withTag(c.Image, r.CoreDNS); img != c.Image {
				d.Spec.Template.Spec.Containers[i].Image = img
				msg = append(msg, "Deployment kube-system/coredns: "+c.Image+" -> "+img)
				upd = true
			}
		}
		if upd {
			if _, err := deps.Update(ctx, d, metav1.UpdateOptions{}); err != nil {
				return changed, fmt.Errorf("update Deployment kube-system/coredns: %w", err)
			}
			changed = append(changed, msg...)
		}
	}
	return changed, nil
}

func (e *Executor) clusterEvent(ctx context.Context, cluster, typ, reason, msg string) {
	if e.deps.Recorder != nil {
		e.deps.Recorder.Record(ctx, ClustersKind, cluster, typ, reason, msg)
	}
}

// prepareJoin runs before a control-plane member joins: when the member's
// version is newer than the cluster's kubeadm-config, it sets the config to
// it (upload-config).
func (e *Executor) prepareJoin(ctx context.Context, c *typesv1.Cluster, m *typesv1.Machine, boot *Bootstrap) error {
	if boot == nil || boot.Kubeconfig == "" {
		return nil
	}
	v := clusterConfig(c, m, &typesv1.Host{}).GetKubernetesVersion()
	mv, err := version.ParseSemantic(v)
	if err != nil {
		return nil
	}
	// Only while older members run: a cluster's first version is kubeadm
	// init's own.
	items, err := listAll(ctx, e.deps.Store, MachinesKind, func() proto.Message { return &typesv1.Machine{} })
	if err != nil {
		return err
	}
	older := false
	for _, it := range items {
		o := it.Msg.(*typesv1.Machine)
		if o.GetSpec().GetCluster() != c.GetMetadata().GetName() || !conditions.IsTrue(o.GetStatus().GetConditions(), ConditionBootstrapped) {
			continue
		}
		if ov, err := version.ParseSemantic(clusterConfig(c, o, &typesv1.Host{}).GetKubernetesVersion()); err == nil && ov.LessThan(mv) {
			older = true
		}
	}
	if !older {
		return nil
	}
	r, err := kubetools.ReleaseFor(v)
	if err != nil {
		return nil // no recipe: nothing known to set
	}
	cs, err := e.kubeClient(boot.Kubeconfig)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, kubeCallTimeout)
	defer cancel()
	what, err := SetKubeadmVersion(ctx, cs, r)
	if err != nil {
		return fmt.Errorf("before joining %s at %s: %w", m.GetMetadata().GetName(), v, err)
	}
	if what != "" {
		e.clusterEvent(ctx, c.GetMetadata().GetName(), "Normal", "KubeadmConfigUpgraded",
			fmt.Sprintf("before %s joins at %s: %s", m.GetMetadata().GetName(), v, what))
	}
	return nil
}

// syncAddons moves kube-proxy and CoreDNS to the release of the newest
// control-plane version whose node is Ready while machines of an older
// version remain (a rollout by reimaging is under way). Done once per
// version and cluster for the life of this executor.
func (e *Executor) syncAddons(ctx context.Context, c *typesv1.Cluster, machines []*typesv1.Machine) error {
	name := c.GetMetadata().GetName()
	var newest *version.Version
	for _, m := range machines {
		if m.GetSpec().GetRole() != clusterplan.RoleControlPlane || m.GetMetadata().GetDeletionTimestamp() != nil ||
			!conditions.IsTrue(m.GetStatus().GetConditions(), ConditionBootstrapped) ||
			!conditions.IsTrue(m.GetStatus().GetConditions(), clusterplan.MachineNodeReady) {
			continue
		}
		v, err := version.ParseSemantic(clusterConfig(c, m, &typesv1.Host{}).GetKubernetesVersion())
		if err == nil && (newest == nil || newest.LessThan(v)) {
			newest = v
		}
	}
	if newest == nil {
		return nil
	}
	older := false
	for _, m := range machines {
		if v, err := version.ParseSemantic(clusterConfig(c, m, &typesv1.Host{}).GetKubernetesVersion()); err == nil && v.LessThan(newest) {
			older = true
		}
	}
	want := "v" + newest.String()
	e.mu.Lock()
	done := e.addons[name] == want
	e.mu.Unlock()
	if !older || done {
		return nil
	}
	r, err := kubetools.ReleaseFor(want)
	if err != nil {
		return nil // no recipe: the images are not known
	}
	boot, err := LoadBootstrap(ctx, e.deps.Store, name)
	if err != nil || boot.Kubeconfig == "" {
		return err
	}
	cs, err := e.kubeClient(boot.Kubeconfig)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, kubeCallTimeout)
	defer cancel()
	changed, err := SetAddonImages(ctx, cs, r)
	if len(changed) > 0 {
		e.clusterEvent(ctx, name, "Normal", "AddonsUpgraded", "control plane at "+want+" Ready: "+strings.Join(changed, "; "))
	}
	if err != nil {
		e.clusterEvent(ctx, name, "Warning", "AddonsUpgradeFailed", err.Error())
		return fmt.Errorf("addons to %s: %w", want, err)
	}
	e.mu.Lock()
	e.addons[name] = want
	e.mu.Unlock()
	return nil
}
