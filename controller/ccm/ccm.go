// Package ccm checks the add-on manifests a Cluster names before the
// controller applies them: a cloud-controller-manager manifest for
// cloudProvider external must be able to run on a cluster whose nodes are
// still tainted uninitialized and not-ready (the deadlock where the CCM
// stays Pending waiting for the nodes it would initialise), and a CNI
// manifest must use the Cluster's pod CIDR. Every problem is named with
// its fix. It does no I/O: callers read the manifests.
package ccm

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Well-known node labels and taints.
const (
	LabelControlPlane      = "node-role.kubernetes.io/control-plane"
	TaintUninitialized     = "node.cloudprovider.kubernetes.io/uninitialized"
	TaintNotReady          = "node.kubernetes.io/not-ready"
	TaintControlPlane      = "node-role.kubernetes.io/control-plane"
	calicoPoolEnv          = "CALICO_IPV4POOL_CIDR"
	flannelNetConfKey      = "net-conf.json"
	kindDeployment         = "Deployment"
	kindDaemonSet          = "DaemonSet"
	kindConfigMap          = "ConfigMap"
	kindCalicoInstallation = "Installation"
)

// workload is a Deployment or DaemonSet of a manifest.
type workload struct {
	kind, name string
	pod        corev1.PodSpec
}

func (w workload) String() string { return w.kind + "/" + w.name }

// object is one document of a manifest.
type object struct {
	kind string
	raw  map[string]any
}

// parse splits a multi-document YAML (or JSON) manifest into objects; a
// List's items count as documents.
func parse(manifest []byte) ([]object, error) {
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(manifest), 4096)
	var out []object
	for {
		var m map[string]any
		if err := dec.Decode(&m); err != nil {
			if errors.Is(err, io.EOF) {
				return out, nil
			}
			return nil, errdefs.InvalidArgument("manifest: document %d is not YAML: %v", len(out)+1, err)
		}
		if m == nil {
			continue
		}
		kind, _ := m["kind"].(string)
		if items, ok := m["items"].([]any); ok && strings.HasSuffix(kind, "List") {
			for _, it := range items {
				if im, ok := it.(map[string]any); ok {
					k, _ := im["kind"].(string)
					out = append(out, object{kind: k, raw: im})
				}
			}
			continue
		}
		out = append(out, object{kind: kind, raw: m})
	}
}

func (o object) into(v any) error {
	return runtime.DefaultUnstructuredConverter.FromUnstructured(o.raw, v)
}

func workloads(objs []object) ([]workload, error) {
	var out []workload
	for _, o := range objs {
		switch o.kind {
		case kindDeployment:
			var d appsv1.Deployment
			if err := o.into(&d); err != nil {
				return nil, errdefs.InvalidArgument("manifest: Deployment: %v", err)
			}
			out = append(out, workload{kind: o.kind, name: d.Name, pod: d.Spec.Template.Spec})
		case kindDaemonSet:
			var d appsv1.DaemonSet
			if err := o.into(&d); err != nil {
				return nil, errdefs.InvalidArgument("manifest: DaemonSet: %v", err)
			}
			out = append(out, workload{kind: o.kind, name: d.Name, pod: d.Spec.Template.Spec})
		}
	}
	return out, nil
}

// Problems is the list of everything wrong with a manifest; it is of
// class errdefs.InvalidArgument.
type Problems struct {
	// What names the manifest ("ccm manifest", "cni manifest").
	What  string
	Items []string
}

func (p *Problems) Error() string {
	if len(p.Items) == 1 {
		return p.What + ": " + p.Items[0]
	}
	return p.What + ":\n  - " + strings.Join(p.Items, "\n  - ")
}

// Is makes errors.Is(err, errdefs.ErrInvalidArgument) true.
func (p *Problems) Is(target error) bool { return target == errdefs.ErrInvalidArgument }

func (p *Problems) add(format string, args ...any) {
	p.Items = append(p.Items, fmt.Sprintf(format, args...))
}

func (p *Problems) err() error {
	if len(p.Items) == 0 {
		return nil
	}
	return p
}

// CheckCCM checks a cloud-controller-manager manifest for a Cluster with
// cloudProvider external. Its Deployment or DaemonSet must use the host
// network (no CNI runs yet), be placed on control-plane nodes (nodeSelector
// or required node affinity on node-role.kubernetes.io/control-plane), and
// tolerate the uninitialized, not-ready and control-plane taints; otherwise
// it stays Pending while every node keeps the uninitialized taint it
// should remove. It returns nil or a *Problems naming each missing piece
// and its fix (class errdefs.InvalidArgument).
func CheckCCM(manifest []byte) error {
	objs, err := parse(manifest)
	if err != nil {
		return err
	}
	ws, err := workloads(objs)
	if err != nil {
		return err
	}
	p := &Problems{What: "ccm manifest"}
	if len(ws) == 0 {
		p.add("no Deployment or DaemonSet: the manifest must run the cloud-controller-manager")
		return p.err()
	}
	for _, w := range ws {
		if !w.pod.HostNetwork {
			p.add("%s: spec.template.spec.hostNetwork is not true: the CCM runs before the CNI gives pods a network; set hostNetwork: true", w)
		}
		if !onControlPlane(w.pod) {
			p.add("%s: not placed on control-plane nodes: add nodeSelector %s: \"\" (or a required node affinity on that label)", w, LabelControlPlane)
		}
		for _, key := range []string{TaintUninitialized, TaintNotReady, TaintControlPlane} {
			if !tolerates(w.pod.Tolerations, key) {
				p.add("%s: no toleration for %s: add {key: %s, operator: Exists, effect: NoSchedule}", w, key, key)
			}
		}
	}
	return p.err()
}

func onControlPlane(pod corev1.PodSpec) bool {
	if _, ok := pod.NodeSelector[LabelControlPlane]; ok {
		return true
	}
	na := pod.Affinity
	if na == nil || na.NodeAffinity == nil || na.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution == nil {
		return false
	}
	terms := na.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms
	if len(terms) == 0 {
		return false
	}
	// Every term (they are ORed) must confine the pod to control planes.
	for _, t := range terms {
		ok := false
		for _, e := range t.MatchExpressions {
			if e.Key == LabelControlPlane && (e.Operator == corev1.NodeSelectorOpExists || e.Operator == corev1.NodeSelectorOpIn) {
				ok = true
			}
		}
		if !ok {
			return false
		}
	}
	return true
}

// taintValues are the values the well-known taints carry.
var taintValues = map[string]string{TaintUninitialized: "true", TaintNotReady: "", TaintControlPlane: ""}

// tolerates reports whether ts tolerate the NoSchedule taint key.
func tolerates(ts []corev1.Toleration, key string) bool {
	for _, t := range ts {
		if t.Effect != "" && t.Effect != corev1.TaintEffectNoSchedule {
			continue
		}
		switch {
		case t.Operator == corev1.TolerationOpExists && (t.Key == "" || t.Key == key):
			return true
		case t.Key == key && t.Value == taintValues[key]:
			return true
		}
	}
	return false
}

// PodNetwork is a pod CIDR a CNI manifest declares, and where.
type PodNetwork struct {
	CIDR  string
	Where string
}

// PodNetworks finds the pod networks a CNI manifest declares: flannel's
// net-conf.json Network, Calico's CALICO_IPV4POOL_CIDR and the ipPools of
// a Calico operator Installation.
func PodNetworks(manifest []byte) ([]PodNetwork, error) {
	objs, err := parse(manifest)
	if err != nil {
		return nil, err
	}
	var out []PodNetwork
	for _, o := range objs {
		switch o.kind {
		case kindConfigMap:
			var cm corev1.ConfigMap
			if err := o.into(&cm); err != nil {
				return nil, errdefs.InvalidArgument("cni manifest: ConfigMap: %v", err)
			}
			conf, ok := cm.Data[flannelNetConfKey]
			if !ok {
				continue
			}
			var nc struct{ Network string }
			if err := json.Unmarshal([]byte(conf), &nc); err != nil {
				return nil, errdefs.InvalidArgument("cni manifest: ConfigMap/%s %s is not JSON: %v", cm.Name, flannelNetConfKey, err)
			}
			out = append(out, PodNetwork{CIDR: nc.Network, Where: fmt.Sprintf("flannel ConfigMap/%s %s Network", cm.Name, flannelNetConfKey)})
		case kindCalicoInstallation:
			var inst struct {
				Spec struct {
					CalicoNetwork struct {
						IPPools []struct {
							CIDR string `json:"cidr"`
						} `json:"ipPools"`
					} `json:"calicoNetwork"`
				} `json:"spec"`
			}
			b, _ := json.Marshal(o.raw)
			if err := json.Unmarshal(b, &inst); err != nil {
				return nil, errdefs.InvalidArgument("cni manifest: Installation: %v", err)
			}
			for _, pool := range inst.Spec.CalicoNetwork.IPPools {
				if a, err := netip.ParsePrefix(pool.CIDR); err == nil && a.Addr().Is4() {
					out = append(out, PodNetwork{CIDR: pool.CIDR, Where: "calico Installation spec.calicoNetwork.ipPools cidr"})
				}
			}
		}
	}
	ws, err := workloads(objs)
	if err != nil {
		return nil, err
	}
	for _, w := range ws {
		for _, c := range append(w.pod.InitContainers, w.pod.Containers...) {
			for _, e := range c.Env {
				if e.Name == calicoPoolEnv {
					out = append(out, PodNetwork{CIDR: e.Value, Where: fmt.Sprintf("calico %s container %s env %s", w, c.Name, calicoPoolEnv)})
				}
			}
		}
	}
	return out, nil
}

// CheckCNI refuses a CNI manifest whose pod network differs from the
// Cluster's podCIDR (pods would get addresses the nodes do not route,
// and kube-proxy's cluster CIDR would be wrong). A manifest that declares
// no pod network this package knows passes. It returns nil or a
// *Problems (class errdefs.InvalidArgument).
func CheckCNI(manifest []byte, podCIDR string) error {
	want, err := netip.ParsePrefix(podCIDR)
	if err != nil {
		return errdefs.InvalidArgument("cni manifest: cluster podCidr %q is not a CIDR", podCIDR)
	}
	nets, err := PodNetworks(manifest)
	if err != nil {
		return err
	}
	p := &Problems{What: "cni manifest"}
	for _, n := range nets {
		got, err := netip.ParsePrefix(strings.TrimSpace(n.CIDR))
		switch {
		case err != nil:
			p.add("%s %q is not a CIDR: set it to the cluster's podCidr %s", n.Where, n.CIDR, want)
		case got.Masked() != want.Masked():
			p.add("%s %s disagrees with the cluster's podCidr %s: set it to %s", n.Where, got, want, want)
		}
	}
	return p.err()
}
