package kubeadm

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
	"github.com/kilnhq/kiln/internal/testenv"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// fakeHost is a host root with kubeadm and kubelet replaced by shell
// scripts that behave like the real ones for what Kiln asks of them (and
// record their calls), so that Init/Join/Reset run real processes and
// real output streaming. The real binaries are exercised in e2e/kube.
type fakeHost struct {
	root, calls      string
	kubeadm, kubelet string
	ca               *pki.CA
}

const fakeKubeadm = `#!/bin/sh
ROOT=%[1]q; CALLS=%[2]q; CA=%[3]q; VERSION=%[4]q; GOODHASH=%[5]q; TOKEN=%[6]q
echo "kubeadm $*" >> "$CALLS"
case "$1" in
version) echo "$VERSION" ;;
init)
  cp "$3" "$ROOT/init-config-seen.yaml"; stat -c %%a "$3" > "$ROOT/init-config-mode"
  echo "[init] Using Kubernetes version: $VERSION"
  echo "[preflight] Running pre-flight checks" >&2
  if [ -f "$ROOT/fail-preflight" ]; then
    printf '%%s\n' "[preflight] Some fatal errors occurred:" \
      "	[ERROR ImagePull]: failed to pull image registry.k8s.io/kube-apiserver:$VERSION: image not present locally and pull policy is Never" \
      "	[ERROR ImagePull]: failed to pull image registry.k8s.io/etcd:3.6.4-0: image not present locally and pull policy is Never" \
      "[preflight] If you know what you are doing, you can make a check non-fatal with --ignore-preflight-errors=..." \
      "error: error execution phase preflight: preflight checks failed" \
      "To see the stack trace of this error execute with --v=5 or higher" >&2
    exit 1
  fi
  mkdir -p "$ROOT/etc/kubernetes/pki"
  cp "$CA" "$ROOT/etc/kubernetes/pki/ca.crt"
  printf 'apiVersion: v1\nkind: Config\n' > "$ROOT/etc/kubernetes/admin.conf"
  echo "[bootstrap-token] Using token: zzzzzz.yyyyyyyyyyyyyyyy"
  key=$(sed -n 's/^certificateKey: //p' "$3")
  [ -n "$key" ] && printf '[upload-certs] Using certificate key:\n%%s\n' "$key"
  echo "Your Kubernetes control-plane has initialized successfully!"
  [ -f "$ROOT/fail-init" ] && { echo "error execution phase wait-control-plane: the API server did not become healthy" >&2; exit 1; }
  exit 0 ;;
token) echo "$TOKEN" ;;
join)
  cp "$3" "$ROOT/join-config-seen.yaml"
  echo "[preflight] Running pre-flight checks"
  if grep -q "$GOODHASH" "$3"; then echo "This node has joined the cluster"; exit 0; fi
  echo "error execution phase preflight: couldn't validate the identity of the API Server: cluster CA found in cluster-info ConfigMap is invalid: none of the public keys \"$GOODHASH\" are pinned" >&2
  echo "To see the stack trace of this error execute with --v=5 or higher" >&2
  exit 1 ;;
reset)
  if [ "$2" = phase ] && [ -f "$ROOT/etcd-no-quorum" ]; then
    echo 'W1202 14:40:01.000000     123 removeetcdmember.go:106] [reset] Failed to remove etcd member: etcdserver: unhealthy cluster, please manually remove this etcd member using etcdctl' >&2
    exit 0
  fi
  echo "[reset] Deleted contents of the etcd data directory"; [ -f "$ROOT/fail-reset" ] && exit 1; exit 0 ;;
esac
`

func newFakeHost(t *testing.T, kubeadmVersion, kubeletVersion string) *fakeHost {
	t.Helper()
	if _, err := exec.LookPath("sh"); err != nil {
		testenv.Skip(t, "no sh to run the fake kubeadm")
	}
	dir := t.TempDir()
	h := &fakeHost{root: filepath.Join(dir, "root"), calls: filepath.Join(dir, "calls")}
	require.NoError(t, os.MkdirAll(h.root, 0o755))
	ca, err := pki.NewCA("kubernetes", time.Now())
	require.NoError(t, err)
	h.ca = ca
	caFile := filepath.Join(dir, "ca.crt")
	require.NoError(t, os.WriteFile(caFile, ca.CertPEM(), 0o644))
	h.kubeadm = filepath.Join(dir, "kubeadm")
	require.NoError(t, os.WriteFile(h.kubeadm, fmt.Appendf(nil, fakeKubeadm, h.root, h.calls, caFile, kubeadmVersion, ca.Hash(), "abcdef.0123456789abcdef"), 0o755))
	h.kubelet = filepath.Join(dir, "kubelet")
	require.NoError(t, os.WriteFile(h.kubelet, fmt.Appendf(nil, "#!/bin/sh\necho kubelet \"$*\" >> %q\necho Kubernetes %s\n", h.calls, kubeletVersion), 0o755))
	return h
}

func (h *fakeHost) kubeadmFor() *Kubeadm {
	// A reset checks this host's control plane ports: not 6443 and the
	// others, which the machine running the test may use, but a free one.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	free := l.Addr().(*net.TCPAddr).Port
	l.Close()
	return New(Options{Root: h.root, Kubeadm: h.kubeadm, Kubelet: h.kubelet, Ports: map[int]string{free: "kube-apiserver"}})
}

func (h *fakeHost) callLines(t *testing.T) []string {
	b, err := os.ReadFile(h.calls)
	if os.IsNotExist(err) {
		return nil
	}
	require.NoError(t, err)
	return strings.Split(strings.TrimSpace(string(b)), "\n")
}

type events []*agentv1.OperationEvent

func (e *events) emit(ev *agentv1.OperationEvent) { *e = append(*e, ev) }

func (e events) text() string {
	var b strings.Builder
	for _, ev := range e {
		b.WriteString(ev.GetMessage() + "\n")
	}
	return b.String()
}

func TestInit(t *testing.T) {
	h := newFakeHost(t, "v1.34.4", "v1.34.4")
	var evs events
	res, err := h.kubeadmFor().Init(context.Background(), &agentv1.KubeadmInitRequest{Cluster: labCluster(), UploadCerts: true}, evs.emit)
	require.NoError(t, err)

	if res.GetCaHash() != h.ca.Hash() {
		t.Errorf("Init().CaHash = %q, want %q (sha256 of the CA's SubjectPublicKeyInfo)", res.GetCaHash(), h.ca.Hash())
	}
	if res.GetJoinToken() != testToken {
		t.Errorf("Init().JoinToken = %q, want the token kubeadm token create printed", res.GetJoinToken())
	}
	if !certKeyRE.MatchString(res.GetCertificateKey()) {
		t.Errorf("Init().CertificateKey = %q, want 64 hex digits", res.GetCertificateKey())
	}
	if !strings.Contains(res.GetKubeconfig(), "kind: Config") {
		t.Errorf("Init().Kubeconfig = %q, want admin.conf", res.GetKubeconfig())
	}
	if res.GetApiServerEndpoint() != "10.251.0.2:6443" {
		t.Errorf("Init().ApiServerEndpoint = %q, want %q", res.GetApiServerEndpoint(), "10.251.0.2:6443")
	}
	// The config kubeadm got pins the version and holds the key we return.
	seen, err := os.ReadFile(filepath.Join(h.root, "init-config-seen.yaml"))
	require.NoError(t, err)
	for _, want := range []string{"kubernetesVersion: v1.34.4", "imagePullPolicy: Never", "certificateKey: " + res.GetCertificateKey()} {
		if !strings.Contains(string(seen), want) {
			t.Errorf("kubeadm init config lacks %q:\n%s", want, seen)
		}
	}
	mode, err := os.ReadFile(filepath.Join(h.root, "init-config-mode"))
	require.NoError(t, err)
	if strings.TrimSpace(string(mode)) != "600" {
		t.Errorf("init.yaml mode while kubeadm ran = %s, want 600 (it holds the certificate key)", mode)
	}
	if _, err := os.Stat(filepath.Join(h.root, configDir, "init.yaml")); !os.IsNotExist(err) {
		t.Errorf("init.yaml (with the certificate key) left after Init: %v", err)
	}
	if _, err := os.Stat(filepath.Join(h.root, KubeletResolvConf)); err != nil {
		t.Errorf("kubelet resolv.conf not written: %v", err)
	}
	// Progress streams kubeadm's lines, both stdout and stderr, and never a secret.
	out := evs.text()
	for _, want := range []string{"[init] Using Kubernetes version: v1.34.4", "[preflight] Running pre-flight checks", "initialized successfully"} {
		if !strings.Contains(out, want) {
			t.Errorf("progress lacks %q:\n%s", want, out)
		}
	}
	for _, secret := range []string{res.GetCertificateKey(), "zzzzzz.yyyyyyyyyyyyyyyy", testToken} {
		if strings.Contains(out, secret) {
			t.Errorf("progress contains a secret %q:\n%s", secret, out)
		}
	}
	calls := strings.Join(h.callLines(t), "\n")
	for _, want := range []string{"--upload-certs", "--skip-token-print", "token create --kubeconfig " + filepath.Join(h.root, adminConf)} {
		if !strings.Contains(calls, want) {
			t.Errorf("kubeadm calls lack %q:\n%s", want, calls)
		}
	}
}

func TestInitFailureCarriesKubeadmError(t *testing.T) {
	h := newFakeHost(t, "v1.34.4", "v1.34.4")
	require.NoError(t, os.WriteFile(filepath.Join(h.root, "fail-init"), nil, 0o644))
	var evs events
	_, err := h.kubeadmFor().Init(context.Background(), &agentv1.KubeadmInitRequest{Cluster: labCluster(), UploadCerts: true}, evs.emit)
	require.Error(t, err)
	if !strings.Contains(err.Error(), "the API server did not become healthy") {
		t.Errorf("Init() = %v, want kubeadm's error line", err)
	}
	if certKeyRE.FindString(err.Error()) != "" {
		t.Errorf("Init() error %q contains a certificate key", err)
	}
	// The failed init is undone, so that a retry does not fail kubeadm's
	// preflight on the first attempt's ports and files (a TCG VM's init
	// whose control-plane wait timed out was refused ever after).
	if calls := strings.Join(h.callLines(t), "\n"); !strings.Contains(calls, "kubeadm reset --force") {
		t.Errorf("after a failed init, kubeadm calls = %q, want a kubeadm reset --force", calls)
	}
}

// TestInitPreflightFailureNamesChecks: kubeadm's own preflight lists its
// fatal checks indented ("\t[ERROR ImagePull]: ...") before its
// "error: error execution phase preflight" line (kubeadm 1.34's output,
// with the strings of its binary); Init's error
// carries them, not only "preflight checks failed" (which is all a
// TestVMEndToEnd run showed).
func TestInitPreflightFailureNamesChecks(t *testing.T) {
	h := newFakeHost(t, "v1.34.4", "v1.34.4")
	require.NoError(t, os.WriteFile(filepath.Join(h.root, "fail-preflight"), nil, 0o644))
	var evs events
	_, err := h.kubeadmFor().Init(context.Background(), &agentv1.KubeadmInitRequest{Cluster: labCluster(), UploadCerts: true}, evs.emit)
	require.Error(t, err)
	require.Contains(t, err.Error(), "[ERROR ImagePull]: failed to pull image registry.k8s.io/kube-apiserver:v1.34.4: image not present locally and pull policy is Never")
	require.Contains(t, err.Error(), "registry.k8s.io/etcd:3.6.4-0")
}

func TestVersionMismatchRefusedUpFront(t *testing.T) {
	tests := []struct {
		kubeadm, kubelet, want string
	}{
		{"v1.33.2", "v1.34.4", "kubeadm version mismatch: v1.33.2 is installed, the cluster pins v1.34.4"},
		{"v1.34.4", "v1.35.0", "kubelet version mismatch: v1.35.0 is installed, the cluster pins v1.34.4"},
	}
	for _, tt := range tests {
		h := newFakeHost(t, tt.kubeadm, tt.kubelet)
		k := h.kubeadmFor()
		var evs events
		_, err := k.Init(context.Background(), &agentv1.KubeadmInitRequest{Cluster: labCluster()}, evs.emit)
		if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Init(kubeadm %s, kubelet %s) = %v, want FailedPrecondition %q", tt.kubeadm, tt.kubelet, err, tt.want)
		}
		err = k.Join(context.Background(), &agentv1.KubeadmJoinRequest{Cluster: labCluster(), ApiServerEndpoint: "10.251.0.2:6443", Token: testToken, CaHash: h.ca.Hash()}, evs.emit)
		if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Join(kubeadm %s, kubelet %s) = %v, want FailedPrecondition %q", tt.kubeadm, tt.kubelet, err, tt.want)
		}
		for _, l := range h.callLines(t) {
			if strings.HasPrefix(l, "kubeadm init") || strings.HasPrefix(l, "kubeadm join") {
				t.Errorf("kubeadm ran %q despite the version mismatch", l)
			}
		}
	}
}

func TestMissingKubeadm(t *testing.T) {
	k := New(Options{Root: t.TempDir(), Kubeadm: filepath.Join(t.TempDir(), "no-kubeadm")})
	_, err := k.Init(context.Background(), &agentv1.KubeadmInitRequest{Cluster: labCluster()}, func(*agentv1.OperationEvent) {})
	if !errdefs.IsFailedPrecondition(err) {
		t.Errorf("Init(no kubeadm) = %v, want FailedPrecondition", err)
	}
}

func TestJoin(t *testing.T) {
	h := newFakeHost(t, "v1.34.4", "v1.34.4")
	worker := labCluster()
	worker.Role, worker.NodeName, worker.AdvertiseAddress = RoleWorker, "node-2", "10.251.0.3"
	var evs events
	err := h.kubeadmFor().Join(context.Background(), &agentv1.KubeadmJoinRequest{
		Cluster: worker, ApiServerEndpoint: "10.251.0.2:6443", Token: testToken, CaHash: h.ca.Hash(),
	}, evs.emit)
	require.NoError(t, err)
	if !strings.Contains(evs.text(), "This node has joined the cluster") {
		t.Errorf("Join progress = %q, want kubeadm's output", evs.text())
	}
	seen, err := os.ReadFile(filepath.Join(h.root, "join-config-seen.yaml"))
	require.NoError(t, err)
	if !strings.Contains(string(seen), "- "+h.ca.Hash()) {
		t.Errorf("join config does not pin the CA hash:\n%s", seen)
	}
}

func TestJoinWrongCAHashSurfacesKubeadmError(t *testing.T) {
	h := newFakeHost(t, "v1.34.4", "v1.34.4")
	other, err := pki.NewCA("other", time.Now())
	require.NoError(t, err)
	var evs events
	err = h.kubeadmFor().Join(context.Background(), &agentv1.KubeadmJoinRequest{
		Cluster: labCluster(), ApiServerEndpoint: "10.251.0.2:6443", Token: testToken, CaHash: other.Hash(),
	}, evs.emit)
	require.Error(t, err)
	if !strings.Contains(err.Error(), "none of the public keys") || !strings.Contains(err.Error(), "are pinned") {
		t.Errorf("Join(wrong CA hash) = %v, want kubeadm's pin error", err)
	}
	if strings.Contains(err.Error(), testToken) {
		t.Errorf("Join(wrong CA hash) error contains the token: %v", err)
	}
	// The failed join is undone, so that the next attempt starts clean.
	if calls := strings.Join(h.callLines(t), "\n"); !strings.Contains(calls, "kubeadm reset --force") {
		t.Errorf("after a failed join, kubeadm calls = %q, want a kubeadm reset --force", calls)
	}
}

func TestJoinMalformedCAHashRefusedUpFront(t *testing.T) {
	h := newFakeHost(t, "v1.34.4", "v1.34.4")
	err := h.kubeadmFor().Join(context.Background(), &agentv1.KubeadmJoinRequest{
		Cluster: labCluster(), ApiServerEndpoint: "10.251.0.2:6443", Token: testToken, CaHash: "sha256:abc",
	}, func(*agentv1.OperationEvent) {})
	if !errdefs.IsInvalidArgument(err) {
		t.Errorf("Join(CA hash sha256:abc) = %v, want InvalidArgument", err)
	}
	if calls := h.callLines(t); len(calls) != 0 {
		t.Errorf("Join(malformed hash) ran commands: %q", calls)
	}
}

func TestReset(t *testing.T) {
	h := newFakeHost(t, "v1.34.4", "v1.34.4")
	k := h.kubeadmFor()
	_, err := k.writeConfig("join.yaml", []byte("x"))
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(filepath.Join(h.root, "etc/kubernetes/manifests"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(h.root, etcdReadyMf), nil, 0o644))

	var evs events
	require.NoError(t, k.Reset(context.Background(), &agentv1.KubeadmResetRequest{RemoveEtcdMember: true}, evs.emit))
	calls := h.callLines(t)
	want := []string{
		"kubeadm reset phase remove-etcd-member --kubeconfig " + filepath.Join(h.root, adminConf),
		"kubeadm reset -f --cri-socket " + CRISocket,
	}
	if strings.Join(calls, "\n") != strings.Join(want, "\n") {
		t.Errorf("Reset() ran\n%s\nwant\n%s", strings.Join(calls, "\n"), strings.Join(want, "\n"))
	}
	if _, err := os.Stat(filepath.Join(h.root, configDir)); !os.IsNotExist(err) {
		t.Errorf("Reset() left %s: %v", configDir, err)
	}

	// A worker has no etcd member: only the reset runs.
	require.NoError(t, os.Remove(h.calls))
	require.NoError(t, os.Remove(filepath.Join(h.root, etcdReadyMf)))
	require.NoError(t, k.Reset(context.Background(), &agentv1.KubeadmResetRequest{RemoveEtcdMember: true}, evs.emit))
	if got := h.callLines(t); len(got) != 1 || got[0] != want[1] {
		t.Errorf("Reset(worker) ran %q, want only %q", got, want[1])
	}

	// kubeadm exits 0 when the member could not be removed, with a
	// warning: Reset stops there, before anything is wiped.
	require.NoError(t, os.Remove(h.calls))
	require.NoError(t, os.WriteFile(filepath.Join(h.root, etcdReadyMf), nil, 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(h.root, "etcd-no-quorum"), nil, 0o644))
	err = k.Reset(context.Background(), &agentv1.KubeadmResetRequest{RemoveEtcdMember: true}, evs.emit)
	if err == nil || !strings.Contains(err.Error(), "unhealthy cluster") {
		t.Errorf("Reset(etcd member removal fails) = %v, want the removal's error", err)
	}
	if got := h.callLines(t); len(got) != 1 || !strings.Contains(got[0], "remove-etcd-member") {
		t.Errorf("Reset(etcd member removal fails) ran %q, want only the removal (nothing wiped)", got)
	}
	require.NoError(t, os.Remove(filepath.Join(h.root, "etcd-no-quorum")))

	require.NoError(t, os.WriteFile(filepath.Join(h.root, "fail-reset"), nil, 0o644))
	if err := k.Reset(context.Background(), &agentv1.KubeadmResetRequest{}, evs.emit); err == nil {
		t.Errorf("Reset() with kubeadm failing = nil, want an error")
	}
}

// TestConfigValidatesWithRealKubeadm checks the generated files with the
// pinned kubeadm itself when it is available ($KILN_KUBEADM, the
// kube-tools cache, or PATH).
func TestConfigValidatesWithRealKubeadm(t *testing.T) {
	bin := realKubeadm()
	if bin == "" {
		testenv.Skip(t, "no kubeadm: set KILN_KUBEADM or build the kube-tools cache (make kube-tools)")
	}
	files, err := filepath.Glob("testdata/*.yaml")
	require.NoError(t, err)
	require.NotEmpty(t, files)
	for _, f := range files {
		out, err := exec.Command(bin, "config", "validate", "--config", f).CombinedOutput()
		if err != nil {
			t.Errorf("kubeadm config validate --config %s: %v\n%s", f, err, out)
		}
	}
}

func realKubeadm() string {
	if p := os.Getenv("KILN_KUBEADM"); p != "" {
		return p
	}
	cache := os.Getenv("KILN_CACHE")
	if cache == "" {
		cache = "/var/cache/kiln"
	}
	if p := filepath.Join(cache, "kube-tools/v1.34.4/bin/kubeadm"); fileExists(p) {
		return p
	}
	p, _ := exec.LookPath("kubeadm")
	return p
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// A site's kubeadm patches (PatchesDir) reach kubeadm on init and join
// only when the directory exists, and survive a reset (they are the
// site's, not Kiln's generated configuration).
func TestPatchesDirectory(t *testing.T) {
	worker := labCluster()
	worker.Role, worker.NodeName, worker.AdvertiseAddress = RoleWorker, "node-2", "10.251.0.3"
	for _, withPatches := range []bool{false, true} {
		t.Run(fmt.Sprintf("patches=%v", withPatches), func(t *testing.T) {
			h := newFakeHost(t, "v1.34.4", "v1.34.4")
			dir := filepath.Join(h.root, PatchesDir)
			patch := filepath.Join(dir, "kubeletconfiguration+merge.yaml")
			if withPatches {
				require.NoError(t, os.MkdirAll(dir, 0o755))
				require.NoError(t, os.WriteFile(patch, []byte("imageGCHighThresholdPercent: 100\n"), 0o644))
			}
			want := "patches:\n  directory: " + dir + "\n"
			k := h.kubeadmFor()
			_, err := k.Init(context.Background(), &agentv1.KubeadmInitRequest{Cluster: labCluster()}, func(*agentv1.OperationEvent) {})
			require.NoError(t, err)
			require.NoError(t, k.Join(context.Background(), &agentv1.KubeadmJoinRequest{
				Cluster: worker, ApiServerEndpoint: "10.251.0.2:6443", Token: testToken, CaHash: h.ca.Hash(),
			}, func(*agentv1.OperationEvent) {}))
			for _, f := range []string{"init-config-seen.yaml", "join-config-seen.yaml"} {
				seen, err := os.ReadFile(filepath.Join(h.root, f))
				require.NoError(t, err)
				if got := strings.Contains(string(seen), want); got != withPatches {
					t.Errorf("%s holds %q = %v, want %v:\n%s", f, want, got, withPatches, seen)
				}
				if !withPatches && strings.Contains(string(seen), "patches:") {
					t.Errorf("%s names patches with no %s:\n%s", f, PatchesDir, seen)
				}
			}
			require.NoError(t, k.Reset(context.Background(), &agentv1.KubeadmResetRequest{}, func(*agentv1.OperationEvent) {}))
			if _, err := os.Stat(patch); withPatches && err != nil {
				t.Errorf("after Reset, %s: %v, want it kept", patch, err)
			}
		})
	}
}
