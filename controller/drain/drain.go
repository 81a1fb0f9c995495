// Package drain empties a Kubernetes node before its host is reimaged:
// cordon, then evict every pod that may be evicted, honouring
// PodDisruptionBudgets, within a node drain timeout. It wraps
// k8s.io/kubectl/pkg/drain, so it behaves as `kubectl drain` does. The
// controller links it; the agent must not (it pulls in client-go).
package drain

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	kdrain "k8s.io/kubectl/pkg/drain"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// DefaultTimeout is the deadline of a drain given no timeout: a drain
// never waits forever (a PodDisruptionBudget that allows no eviction would
// hold it for ever).
const DefaultTimeout = 5 * time.Minute

// Drain cordons node and evicts its pods through the API server that
// kubeconfig names, waiting until they are gone or timeout passes
// (DefaultTimeout when timeout <= 0; ctx may end it sooner). DaemonSet pods are left (they
// would come back), pods with emptyDir data are evicted (the host is
// about to be wiped anyway), unmanaged pods are deleted too.
//
// Equivalent to: `kubectl drain NODE --ignore-daemonsets
// --delete-emptydir-data --force --timeout TIMEOUT`.
//
// It blocks until the node is empty. It returns an error of class
// errdefs.InvalidArgument for an unusable kubeconfig, errdefs.NotFound
// when the node does not exist, and errdefs.Unavailable when the drain
// did not finish; when that is because timeout passed (for example a
// PodDisruptionBudget allows no eviction) the error is also
// errdefs.ErrDeadlineExceeded (errors.Is). The error names the pods that
// stayed.
func Drain(ctx context.Context, kubeconfig []byte, node string, timeout time.Duration) error {
	cfg, err := clientcmd.RESTConfigFromKubeConfig(kubeconfig)
	if err != nil {
		return fmt.Errorf("%w: %w", errdefs.InvalidArgument("drain node %q: kubeconfig", node), err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("%w: %w", errdefs.InvalidArgument("drain node %q: client", node), err)
	}
	return (&Drainer{Client: cs}).Drain(ctx, node, timeout)
}

// DeleteNode deletes the Node object of a machine that left the cluster
// (after its drain and kubeadm reset), as Cluster API does: its host may
// join again under the same name, which kubeadm refuses while a Node of
// that name exists. A Node that is already gone is not an error.
//
// Equivalent to: `kubectl delete node NODE --ignore-not-found`.
func DeleteNode(ctx context.Context, kubeconfig []byte, node string) error {
	cfg, err := clientcmd.RESTConfigFromKubeConfig(kubeconfig)
	if err != nil {
		return fmt.Errorf("%w: %w", errdefs.InvalidArgument("delete node %q: kubeconfig", node), err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("%w: %w", errdefs.InvalidArgument("delete node %q: client", node), err)
	}
	return (&Drainer{Client: cs}).DeleteNode(ctx, node)
}

// DeleteNode is DeleteNode with the client of d.
func (d *Drainer) DeleteNode(ctx context.Context, node string) error {
	err := d.Client.CoreV1().Nodes().Delete(ctx, node, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return errdefs.Unavailable("delete node %q: %v", node, err)
	}
	return nil
}

// Drainer drains nodes through a Kubernetes client.
type Drainer struct {
	// Client talks to the cluster's API server.
	Client kubernetes.Interface
	// Log receives one line per evicted pod; nil discards.
	Log *slog.Logger
}

// Drain is Drain with the client of d. See the package function for the
// errors it returns.
func (d *Drainer) Drain(ctx context.Context, node string, timeout time.Duration) error {
	log := d.Log
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	log = log.With("component", "drain", "node", node)
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	n, err := d.Client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		if apierrors.IsNotFound(err) {
			return errdefs.NotFound("drain node %q: no such node", node)
		}
		return fmt.Errorf("%w: %w", errdefs.Unavailable("drain node %q: get node", node), err)
	}
	var errOut strings.Builder
	h := &kdrain.Helper{
		Ctx:                 ctx,
		Client:              d.Client,
		Force:               true,
		GracePeriodSeconds:  -1,
		IgnoreAllDaemonSets: true,
		DeleteEmptyDirData:  true,
		Timeout:             timeout,
		Out:                 io.Discard,
		ErrOut:              &errOut,
		OnPodDeletionOrEvictionFinished: func(p *corev1.Pod, eviction bool, err error) {
			if err == nil {
				log.Info("pod evicted", "pod", p.Namespace+"/"+p.Name, "eviction", eviction)
			}
		},
	}
	if err := kdrain.RunCordonOrUncordon(h, n, true); err != nil {
		return fmt.Errorf("%w: %w", errdefs.Unavailable("drain node %q: cordon", node), err)
	}
	if err := kdrain.RunNodeDrain(h, node); err != nil {
		msg := fmt.Sprintf("drain node %q within %s", node, timeout)
		if strings.Contains(errOut.String(), "disruption budget") {
			msg += ": a PodDisruptionBudget allows no eviction"
		}
		if ctx.Err() != nil || strings.Contains(err.Error(), "global timeout") {
			return fmt.Errorf("%w: %w (%w)", errdefs.Unavailable("%s", msg), err, errdefs.ErrDeadlineExceeded)
		}
		return fmt.Errorf("%w: %w", errdefs.Unavailable("%s", msg), err)
	}
	return nil
}
