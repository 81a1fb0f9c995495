package drain

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

// kubeToolsBin is the pinned kube-tools cache (make kube-tools).
func kubeToolsBin() string {
	root := os.Getenv("KILN_CACHE")
	if root == "" {
		root = "/var/cache/kiln"
	}
	return filepath.Join(root, "kube-tools", "v1.34.4", "bin")
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startProcess runs bin with args until the test ends, stopping it by
// its PID.
func startProcess(t *testing.T, dir, bin string, args ...string) {
	t.Helper()
	logf, err := os.Create(filepath.Join(dir, filepath.Base(bin)+".log"))
	require.NoError(t, err)
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		logf.Close()
		if t.Failed() {
			b, _ := os.ReadFile(logf.Name())
			if len(b) > 4000 {
				b = b[len(b)-4000:]
			}
			t.Logf("%s log tail:\n%s", filepath.Base(bin), b)
		}
	})
}

// startAPIServer runs a real etcd and kube-apiserver from the kube-tools
// cache on loopback and returns a kubeconfig for it. No kubelet runs, so
// a pod's deletion completes at once only with a grace period of 0, and
// no controller-manager runs, so the test writes PodDisruptionBudget
// status itself; the eviction decisions are the real API server's.
func startAPIServer(t *testing.T) []byte {
	t.Helper()
	bin := kubeToolsBin()
	for _, b := range []string{"etcd", "kube-apiserver"} {
		if _, err := os.Stat(filepath.Join(bin, b)); err != nil {
			testenv.Skipf(t, "no %s in the kube-tools cache %s (make kube-tools): %v", b, bin, err)
		}
	}
	dir := t.TempDir()
	ep, pp, ap := freePort(t), freePort(t), freePort(t)
	startProcess(t, dir, filepath.Join(bin, "etcd"),
		"--data-dir", filepath.Join(dir, "etcd"), "--name", "drain-test",
		"--listen-client-urls", fmt.Sprintf("http://127.0.0.1:%d", ep),
		"--advertise-client-urls", fmt.Sprintf("http://127.0.0.1:%d", ep),
		"--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", pp),
		"--initial-advertise-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", pp),
		"--initial-cluster", fmt.Sprintf("drain-test=http://127.0.0.1:%d", pp))

	key, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	require.NoError(t, err)
	saKey, saPub := filepath.Join(dir, "sa.key"), filepath.Join(dir, "sa.pub")
	require.NoError(t, os.WriteFile(saKey, pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}), 0o600))
	require.NoError(t, os.WriteFile(saPub, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}), 0o644))
	token := rand.Text()
	tokens := filepath.Join(dir, "tokens.csv")
	require.NoError(t, os.WriteFile(tokens, []byte(token+",drain-test,1,system:masters\n"), 0o600))

	startProcess(t, dir, filepath.Join(bin, "kube-apiserver"),
		"--etcd-servers", fmt.Sprintf("http://127.0.0.1:%d", ep),
		"--bind-address", "127.0.0.1", "--secure-port", fmt.Sprint(ap), "--advertise-address", "127.0.0.1",
		"--cert-dir", filepath.Join(dir, "certs"),
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", saPub, "--service-account-signing-key-file", saKey,
		"--service-cluster-ip-range", "10.96.0.0/16",
		"--token-auth-file", tokens, "--authorization-mode", "AlwaysAllow",
		"--disable-admission-plugins", "ServiceAccount",
		"--endpoint-reconciler-type", "none")

	kubeconfig := []byte(fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: https://127.0.0.1:%d
    insecure-skip-tls-verify: true
users:
- name: test
  user:
    token: %s
contexts:
- name: test
  context: {cluster: test, user: test}
current-context: test
`, ap, token))
	cfg, err := clientcmd.RESTConfigFromKubeConfig(kubeconfig)
	require.NoError(t, err)
	cs, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	deadline := time.Now().Add(90 * time.Second)
	for {
		_, err := cs.CoreV1().Namespaces().Get(context.Background(), "default", metav1.GetOptions{})
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("kube-apiserver not serving after 90s: %v", err)
		}
		time.Sleep(500 * time.Millisecond)
	}
	return kubeconfig
}

// TestDrainRealAPIServer drains a node through a real kube-apiserver: the
// node is cordoned, a pod that may go is evicted, and a pod whose
// PodDisruptionBudget allows no disruption stays, so the drain gives up
// at its timeout naming the budget.
func TestDrainRealAPIServer(t *testing.T) {
	if testing.Short() {
		t.Skip("starts etcd and kube-apiserver")
	}
	kubeconfig := startAPIServer(t)
	cfg, err := clientcmd.RESTConfigFromKubeConfig(kubeconfig)
	require.NoError(t, err)
	cs, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	ctx := context.Background()

	for _, n := range []string{"w1", "w2"} {
		_, err := cs.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	zero := int64(0)
	mkPod := func(name, nodeName string, lbls map[string]string) {
		t.Helper()
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", Labels: lbls},
			Spec: corev1.PodSpec{NodeName: nodeName, TerminationGracePeriodSeconds: &zero,
				Containers: []corev1.Container{{Name: "c", Image: "registry.k8s.io/pause:3.10.1"}}},
		}
		p, err := cs.CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{})
		require.NoError(t, err)
		p.Status.Phase = corev1.PodRunning
		p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
		_, err = cs.CoreV1().Pods("default").UpdateStatus(ctx, p, metav1.UpdateOptions{})
		require.NoError(t, err)
	}
	mkPod("web-1", "w1", map[string]string{"app": "web"})
	mkPod("db-0", "w1", map[string]string{"app": "db"})
	mkPod("web-2", "w2", map[string]string{"app": "web"})

	one := intstr.FromInt32(1)
	pdb, err := cs.PolicyV1().PodDisruptionBudgets("default").Create(ctx, &policyv1.PodDisruptionBudget{
		ObjectMeta: metav1.ObjectMeta{Name: "db", Namespace: "default"},
		Spec:       policyv1.PodDisruptionBudgetSpec{MinAvailable: &one, Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "db"}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	// What the disruption controller would write: one healthy, one needed.
	pdb.Status = policyv1.PodDisruptionBudgetStatus{ObservedGeneration: pdb.Generation, CurrentHealthy: 1, DesiredHealthy: 1, ExpectedPods: 1, DisruptionsAllowed: 0}
	_, err = cs.PolicyV1().PodDisruptionBudgets("default").UpdateStatus(ctx, pdb, metav1.UpdateOptions{})
	require.NoError(t, err)

	err = Drain(ctx, kubeconfig, "w1", 2*time.Second)
	require.Error(t, err)
	if !errdefs.IsUnavailable(err) || !errors.Is(err, errdefs.ErrDeadlineExceeded) || !strings.Contains(err.Error(), "PodDisruptionBudget") || !strings.Contains(err.Error(), "db-0") {
		t.Errorf("Drain(w1) = %v, want Unavailable and DeadlineExceeded naming the PodDisruptionBudget and db-0", err)
	}
	n, err := cs.CoreV1().Nodes().Get(ctx, "w1", metav1.GetOptions{})
	require.NoError(t, err)
	if !n.Spec.Unschedulable {
		t.Errorf("Drain(w1): node not cordoned")
	}
	pods, err := cs.CoreV1().Pods("default").List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	var names []string
	for _, p := range pods.Items {
		names = append(names, p.Name)
	}
	if got, want := strings.Join(names, ","), "db-0,web-2"; got != want {
		t.Errorf("after Drain(w1) pods = %s, want %s (web-1 evicted, db-0 protected, w2 untouched)", got, want)
	}

	// Once the budget allows it, the drain completes.
	pdb, err = cs.PolicyV1().PodDisruptionBudgets("default").Get(ctx, "db", metav1.GetOptions{})
	require.NoError(t, err)
	pdb.Status.DisruptionsAllowed = 1
	_, err = cs.PolicyV1().PodDisruptionBudgets("default").UpdateStatus(ctx, pdb, metav1.UpdateOptions{})
	require.NoError(t, err)
	require.NoError(t, Drain(ctx, kubeconfig, "w1", time.Minute))
	_, err = cs.CoreV1().Pods("default").Get(ctx, "db-0", metav1.GetOptions{})
	if err == nil {
		t.Errorf("Drain(w1) with the budget allowing one disruption left db-0")
	}
}
