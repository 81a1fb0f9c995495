package clusterexec

import (
	"context"
	"fmt"
	"strconv"
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
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
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
//     (the tags the new version's Image carries, see RecipeFromImage).
//
// Both go through client-go with the cluster's admin kubeconfig, are
// idempotent, record an event on the Cluster when they change something and
// are retried on the next pass when they fail.
//
// The recipe (which etcd, CoreDNS, kube-proxy and pause tags a version
// wants) comes from the Image the new members boot: kiln-imagebuilder
// records what the image's own kubeadm pins (spec.addons). Kiln keeps no
// table of versions. An image without them, or for another version, is an
// unknown recipe: the Cluster's AddonUpgrade condition turns False with
// reason RecipeUnknown, the new member does not join, and no addon is
// touched until the image is rebuilt.

// ConditionAddonUpgrade is the Cluster condition of the addon steps of an
// upgrade by reimaging.
const ConditionAddonUpgrade = "AddonUpgrade"

// Reasons of ConditionAddonUpgrade.
const (
	// ReasonRecipeUnknown: the target version's Image carries no addon
	// tags (or is missing, or is for another version); the rollout waits.
	ReasonRecipeUnknown = "RecipeUnknown"
	// ReasonRecipeFromImage: the target version's Image carries its
	// recipe (after an earlier RecipeUnknown).
	ReasonRecipeFromImage = "RecipeFromImage"
	// ReasonKubeadmConfigUpgraded: kubeadm-config moved to the new version.
	ReasonKubeadmConfigUpgraded = "KubeadmConfigUpgraded"
	// ReasonAddonsUpgraded: kube-proxy and CoreDNS moved to the new version.
	ReasonAddonsUpgraded = "AddonsUpgraded"
)

// RecipeFromImage returns the addon recipe of Kubernetes version from img,
// the Image a member of that version boots: its spec.addons, recorded by
// kiln-imagebuilder from the image's kubeadm. It returns a
// FailedPrecondition error, naming the version and the image and saying to
// rebuild the image, when img is nil (named imageName but not found), is
// for another Kubernetes version, or carries no complete addon tags.
func RecipeFromImage(img *typesv1.Image, imageName, version string) (kubetools.Release, error) {
	rebuild := "rebuild the image with kiln-imagebuilder of this Kiln (it records the addon tags its kubeadm pins) " +
		"with kubernetesVersion " + version + ", apply it and point the ControlPlane's image at it"
	switch {
	case imageName == "":
		return kubetools.Release{}, errdefs.FailedPrecondition("no addon recipe for Kubernetes %s: its machines name no Image; %s", version, rebuild)
	case img == nil:
		return kubetools.Release{}, errdefs.FailedPrecondition("no addon recipe for Kubernetes %s: Image %q not found; %s", version, imageName, rebuild)
	}
	if iv := img.GetSpec().GetKubernetesVersion(); iv != "" && iv != version {
		return kubetools.Release{}, errdefs.FailedPrecondition("no addon recipe for Kubernetes %s: Image %q is for Kubernetes %s; %s", version, imageName, iv, rebuild)
	}
	a := img.GetSpec().GetAddons()
	if a.GetKubeProxy() == "" || a.GetCoredns() == "" || a.GetEtcd() == "" || a.GetPause() == "" {
		return kubetools.Release{}, errdefs.FailedPrecondition("no addon recipe for Kubernetes %s: Image %q carries no addon tags (spec.addons: kube-proxy %q, coredns %q, etcd %q, pause %q); %s",
			version, imageName, a.GetKubeProxy(), a.GetCoredns(), a.GetEtcd(), a.GetPause(), rebuild)
	}
	if a.GetKubeProxy() != version {
		return kubetools.Release{}, errdefs.FailedPrecondition("no addon recipe for Kubernetes %s: Image %q pins kube-proxy %s; %s", version, imageName, a.GetKubeProxy(), rebuild)
	}
	return kubetools.Release{Kubernetes: version, Etcd: a.GetEtcd(), CoreDNS: a.GetCoredns(), Pause: a.GetPause()}, nil
}

// recipe loads the Image named imageName and returns its recipe for
// version (RecipeFromImage). When the recipe is unknown it sets the
// Cluster's AddonUpgrade condition to False, RecipeUnknown, records a
// Warning event when that is new, and returns the error.
func (e *Executor) recipe(ctx context.Context, cluster, imageName, version string) (kubetools.Release, error) {
	var img *typesv1.Image
	if imageName != "" {
		x := &typesv1.Image{}
		_, err := e.deps.Store.Get(ctx, ImagesKind, imageName, x)
		switch {
		case err == nil:
			img = x
		case !errdefs.IsNotFound(err):
			return kubetools.Release{}, fmt.Errorf("read Image %q: %w", imageName, err)
		}
	}
	r, err := RecipeFromImage(img, imageName, version)
	if err != nil {
		if e.setClusterCondition(ctx, cluster, conditions.New(ConditionAddonUpgrade, conditions.False, ReasonRecipeUnknown, err.Error())) {
			e.clusterEvent(ctx, cluster, "Warning", ReasonRecipeUnknown, err.Error())
		}
		return r, err
	}
	// A rebuilt image lifts an earlier RecipeUnknown.
	c := &typesv1.Cluster{}
	if _, gerr := e.deps.Store.Get(ctx, ClustersKind, cluster, c); gerr == nil &&
		conditions.Get(c.GetStatus().GetConditions(), ConditionAddonUpgrade).GetReason() == ReasonRecipeUnknown {
		e.setClusterCondition(ctx, cluster, conditions.New(ConditionAddonUpgrade, conditions.True, ReasonRecipeFromImage,
			fmt.Sprintf("recipe of Kubernetes %s from Image %q", version, imageName)))
	}
	return r, nil
}

// setClusterCondition sets c on the Cluster's status; it reports whether
// that changed the condition's status, reason or message.
func (e *Executor) setClusterCondition(ctx context.Context, cluster string, c *typesv1.Condition) bool {
	changed := false
	e.storeStatus(ctx, ClustersKind, cluster, &typesv1.Cluster{}, func(m proto.Message) {
		x := m.(*typesv1.Cluster)
		if x.Status == nil {
			x.Status = &typesv1.ClusterStatus{}
		}
		old := conditions.Get(x.Status.Conditions, c.GetType())
		changed = old == nil || old.GetStatus() != c.GetStatus() || old.GetReason() != c.GetReason() || old.GetMessage() != c.GetMessage()
		x.Status.Conditions, _ = conditions.Set(x.Status.Conditions, c, e.cfg.Clock())
	})
	return changed
}

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
// kube-proxy:r.Kubernetes (kubeadm tags kube-proxy with the version) and the coredns Deployment's coredns container to
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

// prepareJoin runs before a control-plane member joins: when
// clusterplan.PlanKubeadmConfig says so (older members run, and the
// Cluster's status.addons does not record the member's version), it sets
// the cluster's kubeadm-config to the member's version (upload-config),
// with the recipe of the member's Image, and records that in the Cluster's
// status. An unknown recipe is an error (and the Cluster's AddonUpgrade
// condition): the member does not join.
func (e *Executor) prepareJoin(ctx context.Context, c *typesv1.Cluster, m *typesv1.Machine, boot *Bootstrap) error {
	if boot == nil || boot.Kubeconfig == "" {
		return nil
	}
	items, err := store.ListAll(ctx, e.deps.Store, MachinesKind, func() proto.Message { return &typesv1.Machine{} })
	if err != nil {
		return err
	}
	ms := make([]*typesv1.Machine, len(items))
	for i, it := range items {
		ms[i] = it.Msg.(*typesv1.Machine)
	}
	v, ok := clusterplan.PlanKubeadmConfig(c, ms, m)
	if !ok {
		return nil
	}
	r, err := e.recipe(ctx, c.GetMetadata().GetName(), m.GetSpec().GetImage(), v)
	if err != nil {
		return fmt.Errorf("before joining %s at %s: %w", m.GetMetadata().GetName(), v, err)
	}
	cs, err := e.kubeClient(boot.Kubeconfig)
	if err != nil {
		return err
	}
	callCtx, cancel := context.WithTimeout(ctx, kubeCallTimeout)
	defer cancel()
	what, err := SetKubeadmVersion(callCtx, cs, r)
	if err != nil {
		return fmt.Errorf("before joining %s at %s: %w", m.GetMetadata().GetName(), v, err)
	}
	if what != "" {
		msg := fmt.Sprintf("before %s joins at %s (recipe of Image %q): %s", m.GetMetadata().GetName(), v, m.GetSpec().GetImage(), what)
		e.clusterEvent(ctx, c.GetMetadata().GetName(), "Normal", ReasonKubeadmConfigUpgraded, msg)
		e.setClusterCondition(ctx, c.GetMetadata().GetName(), conditions.New(ConditionAddonUpgrade, conditions.True, ReasonKubeadmConfigUpgraded, msg))
	}
	return e.recordAddons(ctx, c.GetMetadata().GetName(), func(a *typesv1.ClusterAddons) { a.KubeadmConfigVersion = v })
}

// syncAddons runs the addon step clusterplan.PlanAddons decides: it moves
// kube-proxy and CoreDNS to the release of the newest Ready control-plane
// version while machines of an older version remain, and records that
// version in the Cluster's status.addons, so that neither this executor
// nor the next leader's runs it again.
func (e *Executor) syncAddons(ctx context.Context, c *typesv1.Cluster, machines []*typesv1.Machine) error {
	name := c.GetMetadata().GetName()
	step, ok := clusterplan.PlanAddons(c, machines)
	if !ok {
		return nil
	}
	r, err := e.recipe(ctx, name, step.Image, step.Version)
	if err != nil {
		return nil // the AddonUpgrade condition says why; no addon step
	}
	boot, err := LoadBootstrap(ctx, e.deps.Store, name)
	if err != nil || boot.Kubeconfig == "" {
		return err
	}
	cs, err := e.kubeClient(boot.Kubeconfig)
	if err != nil {
		return err
	}
	callCtx, cancel := context.WithTimeout(ctx, kubeCallTimeout)
	defer cancel()
	changed, err := SetAddonImages(callCtx, cs, r)
	if len(changed) > 0 {
		msg := "control plane at " + step.Version + " Ready (recipe of Image " + strconv.Quote(step.Image) + "): " + strings.Join(changed, "; ")
		e.clusterEvent(ctx, name, "Normal", ReasonAddonsUpgraded, msg)
		e.setClusterCondition(ctx, name, conditions.New(ConditionAddonUpgrade, conditions.True, ReasonAddonsUpgraded, msg))
	}
	if err != nil {
		e.clusterEvent(ctx, name, "Warning", "AddonsUpgradeFailed", err.Error())
		return fmt.Errorf("addons to %s: %w", step.Version, err)
	}
	return e.recordAddons(ctx, name, func(a *typesv1.ClusterAddons) { a.Version = step.Version })
}

// recordAddons records an addon step done in the Cluster's status.addons.
func (e *Executor) recordAddons(ctx context.Context, cluster string, set func(*typesv1.ClusterAddons)) error {
	for {
		c := &typesv1.Cluster{}
		rev, err := e.deps.Store.Get(ctx, ClustersKind, cluster, c)
		if err != nil {
			return err
		}
		if c.Status == nil {
			c.Status = &typesv1.ClusterStatus{}
		}
		if c.Status.Addons == nil {
			c.Status.Addons = &typesv1.ClusterAddons{}
		}
		before := proto.Clone(c.Status.Addons)
		set(c.Status.Addons)
		if proto.Equal(before, c.Status.Addons) {
			return nil
		}
		_, err = e.deps.Store.Update(ctx, ClustersKind, cluster, c, rev)
		if errdefs.IsConflict(err) && ctx.Err() == nil {
			continue
		}
		if err != nil {
			return fmt.Errorf("cluster %s: record addon step: %w", cluster, err)
		}
		return nil
	}
}
