package drain

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	fakediscovery "k8s.io/client-go/discovery/fake"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// These tests run the real kubectl drain code against client-go's fake
// clientset, so they need nothing installed; apiserver_test.go repeats the
// PodDisruptionBudget case against a real kube-apiserver from the
// kube-tools cache. The fake answers evictions the way the API server's eviction subresource
// does: it refuses with 429 while a PodDisruptionBudget covering the pod
// allows no disruption, and deletes the pod otherwise.

func node(name string) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}
}

func pod(name, nodeName, ownerKind string, lbls map[string]string) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", Labels: lbls},
		Spec:       corev1.PodSpec{NodeName: nodeName},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning},
	}
	if ownerKind != "" {
		ctrl := true
		p.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: ownerKind, Name: name + "-owner", Controller: &ctrl}}
	}
	return p
}

func pdb(name string, sel map[string]string, allowed int32) *policyv1.PodDisruptionBudget {
	return &policyv1.PodDisruptionBudget{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec:       policyv1.PodDisruptionBudgetSpec{Selector: &metav1.LabelSelector{MatchLabels: sel}},
		Status:     policyv1.PodDisruptionBudgetStatus{DisruptionsAllowed: allowed},
	}
}

// newCluster returns a fake clientset holding objs whose eviction
// subresource honours PodDisruptionBudgets.
func newCluster(t *testing.T, objs ...runtime.Object) *fake.Clientset {
	t.Helper()
	cs := fake.NewClientset(objs...)
	cs.Discovery().(*fakediscovery.FakeDiscovery).Resources = []*metav1.APIResourceList{{
		GroupVersion: "v1",
		APIResources: []metav1.APIResource{{Name: "pods/eviction", Kind: "Eviction", Group: "policy", Version: "v1"}},
	}}
	podsGVR := schema.GroupVersionResource{Version: "v1", Resource: "pods"}
	cs.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "eviction" {
			return false, nil, nil
		}
		ev := a.(k8stesting.CreateAction).GetObject().(*policyv1.Eviction)
		obj, err := cs.Tracker().Get(podsGVR, ev.Namespace, ev.Name)
		if err != nil {
			return true, nil, err
		}
		p := obj.(*corev1.Pod)
		pdbs, err := cs.Tracker().List(schema.GroupVersionResource{Group: "policy", Version: "v1", Resource: "poddisruptionbudgets"},
			schema.GroupVersionKind{Group: "policy", Version: "v1", Kind: "PodDisruptionBudget"}, ev.Namespace)
		if err != nil {
			return true, nil, err
		}
		for _, b := range pdbs.(*policyv1.PodDisruptionBudgetList).Items {
			sel, err := metav1.LabelSelectorAsSelector(b.Spec.Selector)
			if err != nil || !sel.Matches(labels.Set(p.Labels)) {
				continue
			}
			if b.Status.DisruptionsAllowed < 1 {
				err := apierrors.NewTooManyRequests("Cannot evict pod as it would violate the pod's disruption budget.", 0)
				return true, nil, err
			}
		}
		return true, nil, cs.Tracker().Delete(podsGVR, ev.Namespace, ev.Name)
	})
	// The tracker ignores field selectors; the API server filters the
	// drain's list by spec.nodeName.
	cs.PrependReactor("list", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		fs := a.(k8stesting.ListAction).GetListRestrictions().Fields
		nodeName, ok := fs.RequiresExactMatch("spec.nodeName")
		if !ok {
			return false, nil, nil
		}
		obj, err := cs.Tracker().List(podsGVR, schema.GroupVersionKind{Version: "v1", Kind: "Pod"}, a.GetNamespace())
		if err != nil {
			return true, nil, err
		}
		list := obj.(*corev1.PodList)
		var keep []corev1.Pod
		for _, p := range list.Items {
			if p.Spec.NodeName == nodeName {
				keep = append(keep, p)
			}
		}
		list.Items = keep
		return true, list, nil
	})
	return cs
}

func podNames(t *testing.T, cs *fake.Clientset) []string {
	t.Helper()
	list, err := cs.CoreV1().Pods("").List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	var names []string
	for _, p := range list.Items {
		names = append(names, p.Name)
	}
	return names
}

func TestDrainEvictsAndCordons(t *testing.T) {
	cs := newCluster(t,
		node("w1"), node("w2"),
		pod("web-1", "w1", "ReplicaSet", map[string]string{"app": "web"}),
		pod("loner", "w1", "", nil),
		pod("proxy-w1", "w1", "DaemonSet", nil),
		pod("web-2", "w2", "ReplicaSet", map[string]string{"app": "web"}),
		pdb("web", map[string]string{"app": "web"}, 1),
	)
	// The DaemonSet pod is skipped only if its DaemonSet exists.
	require.NoError(t, cs.Tracker().Add(&appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "proxy-w1-owner", Namespace: "default"}}))

	d := &Drainer{Client: cs}
	err := d.Drain(context.Background(), "w1", time.Minute)
	require.NoError(t, err)

	n, err := cs.CoreV1().Nodes().Get(context.Background(), "w1", metav1.GetOptions{})
	require.NoError(t, err)
	if !n.Spec.Unschedulable {
		t.Errorf("Drain(%q): node not cordoned", "w1")
	}
	got := strings.Join(podNames(t, cs), ",")
	if want := "proxy-w1,web-2"; got != want {
		t.Errorf("Drain(%q) left pods %s, want %s", "w1", got, want)
	}
	n2, err := cs.CoreV1().Nodes().Get(context.Background(), "w2", metav1.GetOptions{})
	require.NoError(t, err)
	if n2.Spec.Unschedulable {
		t.Errorf("Drain(%q) cordoned w2 too", "w1")
	}
}

func TestDrainHonoursPodDisruptionBudget(t *testing.T) {
	cs := newCluster(t,
		node("w1"),
		pod("db-0", "w1", "StatefulSet", map[string]string{"app": "db"}),
		pod("web-1", "w1", "ReplicaSet", map[string]string{"app": "web"}),
		pdb("db", map[string]string{"app": "db"}, 0),
	)
	d := &Drainer{Client: cs}
	err := d.Drain(context.Background(), "w1", time.Second)
	require.Error(t, err)
	if !errdefs.IsUnavailable(err) || !errors.Is(err, errdefs.ErrDeadlineExceeded) {
		t.Errorf("Drain(%q) = %v, want an Unavailable error that is also ErrDeadlineExceeded", "w1", err)
	}
	for _, want := range []string{"PodDisruptionBudget", "db-0", "within 1s"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Drain(%q) = %q, want it to mention %q", "w1", err, want)
		}
	}
	got := strings.Join(podNames(t, cs), ",")
	if want := "db-0"; got != want {
		t.Errorf("Drain(%q) left pods %s, want %s (the budget protects db-0 only)", "w1", got, want)
	}
}

func TestDrainErrors(t *testing.T) {
	cs := newCluster(t, node("w1"))
	err := (&Drainer{Client: cs}).Drain(context.Background(), "nope", time.Second)
	if !errdefs.IsNotFound(err) {
		t.Errorf("Drain(%q) = %v, want NotFound", "nope", err)
	}
	err = Drain(context.Background(), []byte("not: [a kubeconfig"), "w1", time.Second)
	if !errdefs.IsInvalidArgument(err) {
		t.Errorf("Drain(bad kubeconfig) = %v, want InvalidArgument", err)
	}
}

// TestDeleteNode: a deleted machine's Node goes, so that its host can join
// again under the same name; a Node already gone is no error.
func TestDeleteNode(t *testing.T) {
	cs := newCluster(t, node("w1"), node("w2"))
	d := &Drainer{Client: cs}
	require.NoError(t, d.DeleteNode(context.Background(), "w1"))
	if _, err := cs.CoreV1().Nodes().Get(context.Background(), "w1", metav1.GetOptions{}); err == nil {
		t.Errorf("DeleteNode(w1): node still there")
	}
	if _, err := cs.CoreV1().Nodes().Get(context.Background(), "w2", metav1.GetOptions{}); err != nil {
		t.Errorf("DeleteNode(w1) removed w2 too: %v", err)
	}
	if err := d.DeleteNode(context.Background(), "w1"); err != nil {
		t.Errorf("DeleteNode of a node already gone = %v, want nil", err)
	}
}
