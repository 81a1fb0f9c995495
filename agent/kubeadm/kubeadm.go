// Package kubeadm runs kubeadm on the agent's host: it generates kubeadm
// v1beta4 configuration from a cluster's spec (the Kubernetes version
// always pinned, images never pulled), runs `kubeadm init`, `kubeadm join`
// and `kubeadm reset` through a command runner while streaming their
// output as progress, and returns what other nodes need to join (CA hash,
// bootstrap token, certificate key, admin kubeconfig).
//
// Before init or join it refuses, with a FailedPrecondition error, a host
// whose kubeadm or kubelet is not the pinned version. Secrets (tokens,
// certificate keys) never appear in progress events, logs or errors.
package kubeadm

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/kilnhq/kiln/host/command"
	"github.com/kilnhq/kiln/internal/atomicfile"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// Runner runs host commands: Run returns standard output, Stream reports
// every line of standard output and standard error as it comes.
type Runner interface {
	Run(ctx context.Context, name string, args ...string) ([]byte, error)
	Stream(ctx context.Context, line func(string), name string, args ...string) error
}

// Exec is the production Runner (os/exec).
type Exec struct{ command.Exec }

// Stream runs name with args, calls line for every line it writes to
// standard output or standard error, and blocks until it exits or ctx is
// done (the process is then killed). The error names the command and its
// exit status.
func (Exec) Stream(ctx context.Context, line func(string), name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("%s: %w", command.Line(name, args...), err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64*1024), 1024*1024)
		for sc.Scan() {
			line(sc.Text())
		}
		_, _ = io.Copy(io.Discard, pr)
	}()
	err := cmd.Wait()
	pw.Close()
	<-done
	if err != nil {
		return fmt.Errorf("%s: %w", command.Line(name, args...), err)
	}
	return nil
}

var _ Runner = Exec{}

// Emit reports one progress event (journal.Emit, server.Emit).
type Emit = func(*agentv1.OperationEvent)

// Options configure a Kubeadm.
type Options struct {
	// Root is the host's root directory ("/" in production): generated
	// configuration goes to Root/etc/kiln/kubeadm, kubeadm's output is read
	// from Root/etc/kubernetes.
	Root string
	// Runner runs kubeadm and kubelet (Exec{} in production).
	Runner Runner
	// Kubeadm and Kubelet are the binaries (default "kubeadm" and
	// "kubelet", found on PATH).
	Kubeadm, Kubelet string
	// Ports are the ports a reset must leave free, each with the
	// component that listens on it (default ControlPlanePorts: 6443,
	// 2379, 2380, 10250, 10257, 10259): after `kubeadm reset` the
	// Kubernetes components still listening on them are stopped, and the
	// reset fails naming any port left in use.
	Ports map[int]string
	// Proc is procfs, where the processes holding Ports are looked up
	// (default "/proc").
	Proc string
	// StopGrace is how long a leftover component gets between SIGTERM and
	// SIGKILL (default 15 s).
	StopGrace time.Duration
	Log       *slog.Logger
}

// Kubeadm runs kubeadm on the host. Its methods may be called concurrently
// but the host has one kubelet: the agent's journal runs one operation at
// a time per id, and a second init while one runs fails in kubeadm's own
// preflight (ports in use).
type Kubeadm struct {
	root             string
	run              Runner
	kubeadm, kubelet string
	ports            map[int]string
	proc             string
	stopGrace        time.Duration
	log              *slog.Logger
	mu               sync.Mutex // one kubeadm command at a time
}

// New returns a Kubeadm over o.
func New(o Options) *Kubeadm {
	k := &Kubeadm{root: o.Root, run: o.Runner, kubeadm: o.Kubeadm, kubelet: o.Kubelet, ports: o.Ports, proc: o.Proc, stopGrace: o.StopGrace, log: o.Log}
	if k.root == "" {
		k.root = "/"
	}
	if k.run == nil {
		k.run = Exec{}
	}
	if k.kubeadm == "" {
		k.kubeadm = "kubeadm"
	}
	if k.kubelet == "" {
		k.kubelet = "kubelet"
	}
	if k.ports == nil {
		k.ports = ControlPlanePorts
	}
	if k.proc == "" {
		k.proc = "/proc"
	}
	if k.stopGrace <= 0 {
		k.stopGrace = defaultStopGrace
	}
	if k.log == nil {
		k.log = slog.New(slog.DiscardHandler)
	}
	k.log = k.log.With("component", "kubeadm")
	return k
}

func (k *Kubeadm) path(p string) string { return filepath.Join(k.root, p) }

// PatchesDir is where a site puts kubeadm patch files for this host,
// relative to the root: when it is a directory, init and join pass it to
// kubeadm (`patches: {directory: ...}`), which applies its files named
// target[suffix][+patchtype].extension (kubeletconfiguration+merge.yaml,
// kube-apiserver+json.yaml, ...) to what it writes on this node. It is
// not under configDir: Reset removes that, and the patches are the
// site's, kept across a reset and rejoin.
const PatchesDir = "/etc/kiln/kubeadm-patches"

// Paths kubeadm writes, relative to the root.
const (
	configDir = "/etc/kiln/kubeadm"
	adminConf = "/etc/kubernetes/admin.conf"
	// apiServerManifest is kubeadm's static pod of the API server; its
	// advertiseAnnotation holds the endpoint kubeadm advertises.
	apiServerManifest   = "/etc/kubernetes/manifests/kube-apiserver.yaml"
	advertiseAnnotation = "kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint"
	caCert              = "/etc/kubernetes/pki/ca.crt"
	etcdReadyMf         = "/etc/kubernetes/manifests/etcd.yaml"
)

// CheckVersions returns nil when `kubeadm version -o short` and
// `kubelet --version` both report want, and a FailedPrecondition error
// naming the binary, its version and the pinned one otherwise (or when a
// binary is missing).
//
// Equivalent to: `kubeadm version -o short; kubelet --version`.
func (k *Kubeadm) CheckVersions(ctx context.Context, want string) error {
	out, err := k.run.Run(ctx, k.kubeadm, "version", "-o", "short")
	if err != nil {
		return errdefs.FailedPrecondition("kubeadm is not usable (want %s installed): %v", want, err)
	}
	if got := strings.TrimSpace(string(out)); got != want {
		return errdefs.FailedPrecondition("kubeadm version mismatch: %s is installed, the cluster pins %s; install kubeadm %s (or reimage the host)", got, want, want)
	}
	out, err = k.run.Run(ctx, k.kubelet, "--version")
	if err != nil {
		return errdefs.FailedPrecondition("kubelet is not usable (want %s installed): %v", want, err)
	}
	// "Kubernetes v1.34.4"
	got := strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(string(out)), "Kubernetes"))
	if got != want {
		return errdefs.FailedPrecondition("kubelet version mismatch: %s is installed, the cluster pins %s; install kubelet %s (or reimage the host)", got, want, want)
	}
	return nil
}

// Init runs `kubeadm init` for req.Cluster, streaming its output through
// emit, and returns the CA hash, a new bootstrap token, the certificate
// key (when req.UploadCerts) and the admin kubeconfig.
//
// It returns InvalidArgument for a bad cluster spec, FailedPrecondition for
// a version mismatch, and an error carrying kubeadm's own error lines when
// kubeadm fails. It blocks for as long as kubeadm runs.
//
// Equivalent to: `kubeadm init --config /etc/kiln/kubeadm/init.yaml
// [--upload-certs] --skip-token-print --skip-certificate-key-print &&
// kubeadm token create`.
func (k *Kubeadm) Init(ctx context.Context, req *agentv1.KubeadmInitRequest, emit Emit) (*agentv1.KubeadmInitResult, error) {
	c := req.GetCluster()
	var certKey string
	if req.GetUploadCerts() {
		var b [32]byte
		if _, err := rand.Read(b[:]); err != nil {
			return nil, fmt.Errorf("kubeadm init: certificate key: %w", err)
		}
		certKey = hex.EncodeToString(b[:])
	}
	cfg, err := InitConfig(c, certKey, k.patchDir())
	if err != nil {
		return nil, fmt.Errorf("kubeadm init: %w", err)
	}
	if err := k.CheckVersions(ctx, c.GetKubernetesVersion()); err != nil {
		return nil, fmt.Errorf("kubeadm init: %w", err)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	file, err := k.writeConfig("init.yaml", cfg)
	if err != nil {
		return nil, fmt.Errorf("kubeadm init: %w", err)
	}
	defer os.Remove(file) // it holds the certificate key; kubeadm keeps its own copy (without secrets) in the cluster
	args := []string{"init", "--config", file, "--skip-token-print"}
	if req.GetUploadCerts() {
		args = append(args, "--upload-certs", "--skip-certificate-key-print")
	}
	red := newRedactor(certKey)
	k.log.Info("kubeadm init", "version", c.GetKubernetesVersion(), "node", c.GetNodeName(), "upload_certs", req.GetUploadCerts())
	if err := k.stream(ctx, red, emit, args...); err != nil {
		// As after a failed join: an init that failed half way (its
		// control-plane wait timed out, say) leaves static pods, a
		// running kubelet and files behind, and every retry then fails
		// kubeadm's preflight ("ports in use: 6443, 10250, ..."). Undo
		// it, so that the host is as before the attempt.
		emit(&agentv1.OperationEvent{Message: "kubeadm init failed: kubeadm reset --force to undo what it did"})
		if rerr := k.undo(ctx, red, emit); rerr != nil {
			k.log.Warn("kubeadm reset after a failed init", "error", rerr)
			return nil, fmt.Errorf("kubeadm init: %w; and the reset after it: %v", err, rerr)
		}
		return nil, fmt.Errorf("kubeadm init: %w", err)
	}

	hash, err := k.caHash()
	if err != nil {
		return nil, fmt.Errorf("kubeadm init: %w", err)
	}
	out, err := k.run.Run(ctx, k.kubeadm, "token", "create", "--kubeconfig", k.path(adminConf), "--description", "kiln join token")
	if err != nil {
		return nil, fmt.Errorf("kubeadm init: create a join token: %w", errors.New(red.redact(err.Error())))
	}
	token := strings.TrimSpace(string(out))
	if ValidateToken(token) != nil {
		return nil, fmt.Errorf("kubeadm init: kubeadm token create printed no token")
	}
	emit(&agentv1.OperationEvent{Message: "join token created"})
	kubeconfig, err := os.ReadFile(k.path(adminConf))
	if err != nil {
		return nil, fmt.Errorf("kubeadm init: admin kubeconfig: %w", err)
	}
	ep := c.GetControlPlaneEndpoint()
	if ep == "" && c.GetAdvertiseAddress() != "" {
		ep = fmt.Sprintf("%s:%d", hostForEndpoint(c.GetAdvertiseAddress()), APIServerPort)
	}
	if ep == "" {
		// kubeadm chose the address (its default route's interface) and
		// wrote it into the API server's static pod.
		ep = advertisedEndpoint(k.path(apiServerManifest))
	}
	if ep == "" {
		return nil, fmt.Errorf("kubeadm init: cannot tell the API server's endpoint: no controlPlaneEndpoint or advertise address given, and %s has no %s annotation", apiServerManifest, advertiseAnnotation)
	}
	return &agentv1.KubeadmInitResult{
		CaHash:            hash,
		JoinToken:         token,
		CertificateKey:    certKey,
		Kubeconfig:        string(kubeconfig),
		ApiServerEndpoint: ep,
	}, nil
}

func hostForEndpoint(ip string) string {
	if strings.Contains(ip, ":") {
		return "[" + ip + "]"
	}
	return ip
}

// Join runs `kubeadm join` with the token and CA hash of req, streaming
// its output through emit. A control-plane join needs the certificate key
// Init returned.
//
// It returns InvalidArgument for a malformed token, CA hash, endpoint or
// cluster spec (before anything runs), FailedPrecondition for a version
// mismatch, and an error carrying kubeadm's own error lines when kubeadm
// refuses (a CA hash that does not match the cluster's CA, an expired
// token). It blocks for as long as kubeadm runs.
//
// Equivalent to: `kubeadm join --config /etc/kiln/kubeadm/join.yaml`.
func (k *Kubeadm) Join(ctx context.Context, req *agentv1.KubeadmJoinRequest, emit Emit) error {
	c := req.GetCluster()
	cfg, err := JoinConfig(c, JoinRequest{
		APIServerEndpoint: req.GetApiServerEndpoint(),
		Token:             req.GetToken(),
		CAHash:            req.GetCaHash(),
		ControlPlane:      req.GetControlPlane(),
		CertificateKey:    req.GetCertificateKey(),
		PatchDir:          k.patchDir(),
	})
	if err != nil {
		return fmt.Errorf("kubeadm join: %w", err)
	}
	if err := k.CheckVersions(ctx, c.GetKubernetesVersion()); err != nil {
		return fmt.Errorf("kubeadm join: %w", err)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	file, err := k.writeConfig("join.yaml", cfg)
	if err != nil {
		return fmt.Errorf("kubeadm join: %w", err)
	}
	defer os.Remove(file) // it holds the token (and certificate key)
	k.log.Info("kubeadm join", "version", c.GetKubernetesVersion(), "node", c.GetNodeName(), "endpoint", req.GetApiServerEndpoint(), "control_plane", req.GetControlPlane())
	red := newRedactor(req.GetToken(), req.GetCertificateKey())
	if err := k.stream(ctx, red, emit, "join", "--config", file); err != nil {
		// A join that failed half way leaves files and a running kubelet
		// that make the next attempt fail kubeadm's preflight: undo it,
		// so the host is as before the attempt.
		emit(&agentv1.OperationEvent{Message: "kubeadm join failed: kubeadm reset --force to undo what it did"})
		if rerr := k.undo(ctx, red, emit); rerr != nil {
			k.log.Warn("kubeadm reset after a failed join", "error", rerr)
			return fmt.Errorf("kubeadm join %s: %w; and the reset after it: %v", req.GetApiServerEndpoint(), err, rerr)
		}
		return fmt.Errorf("kubeadm join %s: %w", req.GetApiServerEndpoint(), err)
	}
	return nil
}

// Reset undoes init or join: for a control-plane node with
// req.RemoveEtcdMember it first removes the node's etcd member (so the
// remaining members keep quorum and do not wait for it), then runs
// `kubeadm reset -f`, streaming output through emit, stops the Kubernetes
// components still listening on the control plane's ports (under TCG
// kubeadm's own container removal can fail or give up), and removes
// Kiln's generated configuration. It is idempotent: resetting a clean
// host succeeds. It blocks for as long as kubeadm runs, plus up to
// Options.StopGrace and a few seconds when something was left listening.
//
// It returns a FailedPrecondition error naming each port still in use
// and its process (name and PID) when a Kubernetes component on them
// could not be stopped. A process that is not a component is never
// stopped; it is named in a progress event, not an error (the host is
// about to be wiped, or the next init's preflight names the port).
//
// Equivalent to: `kubeadm reset phase remove-etcd-member --kubeconfig
// /etc/kubernetes/admin.conf; kubeadm reset -f`.
func (k *Kubeadm) Reset(ctx context.Context, req *agentv1.KubeadmResetRequest, emit Emit) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	red := newRedactor()
	if req.GetRemoveEtcdMember() {
		if _, err := os.Stat(k.path(etcdReadyMf)); err == nil {
			emit(&agentv1.OperationEvent{Message: "removing this node's etcd member"})
			// kubeadm only warns when the removal fails and exits 0:
			// watch for its warning, and stop before anything is wiped.
			var failed string
			watch := func(ev *agentv1.OperationEvent) {
				if m := ev.GetMessage(); strings.Contains(m, "Failed to remove etcd member") || strings.Contains(m, "manually remove this etcd member") {
					failed = m
				}
				emit(ev)
			}
			if err := k.stream(ctx, red, watch, "reset", "phase", "remove-etcd-member", "--kubeconfig", k.path(adminConf)); err != nil {
				return fmt.Errorf("kubeadm reset: remove etcd member (the node is left as it was): %w", err)
			}
			if failed != "" {
				return fmt.Errorf("kubeadm reset: remove etcd member (the node is left as it was): %s", strings.TrimSpace(failed))
			}
		} else {
			emit(&agentv1.OperationEvent{Message: "no local etcd member to remove"})
		}
	}
	if err := k.stream(ctx, red, emit, "reset", "-f", "--cri-socket", CRISocket); err != nil {
		// What it left still listening is what the operator needs to
		// know (and what the next init would be refused on).
		if perr := k.freePorts(ctx, emit, false); perr != nil {
			return fmt.Errorf("kubeadm reset: %w; %v", err, perr)
		}
		return fmt.Errorf("kubeadm reset: %w", err)
	}
	if err := k.freePorts(ctx, emit, false); err != nil {
		return fmt.Errorf("kubeadm reset: %w", err)
	}
	if err := os.RemoveAll(k.path(configDir)); err != nil {
		return fmt.Errorf("kubeadm reset: remove %s: %w", configDir, err)
	}
	return nil
}

// undo runs `kubeadm reset --force` after a failed init or join (even when
// ctx is done: the host must not be left half set up) and checks that it
// left the control plane's ports free (freePorts).
func (k *Kubeadm) undo(ctx context.Context, red *redactor, emit Emit) error {
	ctx = context.WithoutCancel(ctx)
	if err := k.stream(ctx, red, emit, "reset", "--force"); err != nil {
		if perr := k.freePorts(ctx, emit, true); perr != nil {
			return fmt.Errorf("%w; %v", err, perr)
		}
		return err
	}
	return k.freePorts(ctx, emit, true)
}

// writeConfig writes a configuration file (0600: it may hold a token or a
// certificate key; the caller removes it once kubeadm has run) and the kubelet's resolv.conf when missing, and returns
// the file's path.
func (k *Kubeadm) writeConfig(name string, data []byte) (string, error) {
	dir := k.path(configDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("config: %w", err)
	}
	rc := k.path(KubeletResolvConf)
	if _, err := os.Stat(rc); errors.Is(err, fs.ErrNotExist) {
		if err := os.WriteFile(rc, []byte("# No upstream resolver (written by kiln-agent): add nameserver lines to let pods and CoreDNS ask outside the cluster.\n"), 0o644); err != nil {
			return "", fmt.Errorf("kubelet resolv.conf: %w", err)
		}
	}
	p := filepath.Join(dir, name)
	if err := atomicfile.Write(p, data, 0o600); err != nil {
		return "", fmt.Errorf("config: %w", err)
	}
	return p, nil
}

// patchDir returns the path of PatchesDir under the root when it is a
// directory, else "" (no patches).
func (k *Kubeadm) patchDir() string {
	p := k.path(PatchesDir)
	if st, err := os.Stat(p); err == nil && st.IsDir() {
		return p
	}
	return ""
}

// caHash reads the cluster CA and returns its pin.
func (k *Kubeadm) caHash() (string, error) {
	b, err := os.ReadFile(k.path(caCert))
	if err != nil {
		return "", fmt.Errorf("cluster CA: %w", err)
	}
	blk, _ := pem.Decode(b)
	if blk == nil || blk.Type != "CERTIFICATE" {
		return "", fmt.Errorf("cluster CA %s: no PEM certificate", caCert)
	}
	cert, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		return "", fmt.Errorf("cluster CA %s: %w", caCert, err)
	}
	return pki.Hash(cert), nil
}

// tailLines is how many of kubeadm's last output lines a failure keeps.
const tailLines = 40

// stream runs kubeadm with args, emitting each redacted line. On failure
// the error carries kubeadm's error lines (or its last lines).
func (k *Kubeadm) stream(ctx context.Context, red *redactor, emit Emit, args ...string) error {
	var tail []string
	err := k.run.Stream(ctx, func(line string) {
		line = red.redact(line)
		if strings.TrimSpace(line) == "" {
			return
		}
		tail = append(tail, line)
		if len(tail) > tailLines {
			tail = tail[1:]
		}
		emit(&agentv1.OperationEvent{Message: line})
	}, k.kubeadm, args...)
	if err == nil {
		return nil
	}
	if ctx.Err() != nil {
		return fmt.Errorf("%s: %w", red.redact(err.Error()), ctx.Err())
	}
	return fmt.Errorf("%s: %s", red.redact(err.Error()), errorLines(tail))
}

// errorLines picks kubeadm's error from its output: the lines from the
// first "error" line on (kubeadm's indented "[ERROR Check]" lines of a
// failed preflight too), or the last few lines when there is none.
func errorLines(tail []string) string {
	for i, l := range tail {
		// kubeadm indents its preflight errors ("\t[ERROR ImagePull]: ...").
		ll := strings.ToLower(strings.TrimSpace(l))
		if strings.HasPrefix(ll, "error") || strings.Contains(ll, "] error") || strings.HasPrefix(ll, "[error") {
			end := min(len(tail), i+6)
			return strings.Join(trimmed(tail[i:end]), "; ")
		}
	}
	return strings.Join(trimmed(tail[max(0, len(tail)-5):]), "; ")
}

func trimmed(ls []string) []string {
	out := make([]string, 0, len(ls))
	for _, l := range ls {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "To see the stack trace") {
			out = append(out, l)
		}
	}
	return out
}

// redactor removes secrets from kubeadm's output: the known values, any
// bootstrap-token-shaped string, and the value after --certificate-key or
// --token.
type redactor struct{ secrets []string }

var (
	tokenShape = regexp.MustCompile(`\b[a-z0-9]{6}\.[a-z0-9]{16}\b`)
	flagValue  = regexp.MustCompile(`(--(?:certificate-key|token|discovery-token)[ =])\S+`)
)

func newRedactor(secrets ...string) *redactor {
	r := &redactor{}
	for _, s := range secrets {
		if s != "" {
			r.secrets = append(r.secrets, s)
		}
	}
	return r
}

func (r *redactor) redact(s string) string {
	for _, sec := range r.secrets {
		s = strings.ReplaceAll(s, sec, "<redacted>")
	}
	s = tokenShape.ReplaceAllString(s, "<redacted>")
	return flagValue.ReplaceAllString(s, "${1}<redacted>")
}

// advertisedEndpoint reads the endpoint kubeadm wrote into the API
// server's static pod annotation ("10.0.0.2:6443"), or "".
func advertisedEndpoint(manifest string) string {
	b, err := os.ReadFile(manifest)
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && strings.Trim(k, `"' `) == advertiseAnnotation {
			v = strings.Trim(strings.TrimSpace(v), `"'`)
			// Host and port both present: ":6443" names no endpoint
			// (found by FuzzOutput).
			if validateEndpoint(v) == nil {
				return v
			}
		}
	}
	return ""
}
