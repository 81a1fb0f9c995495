// Package probe checks a Kubernetes node's health from the node itself and
// reports it as conditions with a reason and a message: the kubelet's and
// containerd's health, the API server's readiness, the node's Ready
// condition, a real DNS answer from the cluster DNS service (Ready is not
// the data path), certificate expiry, the local etcd member and whether an
// external cloud provider has initialised the node.
//
// It talks to the API server with minimal REST calls over the kubelet's
// client certificate (no client-go: the agent stays small), and reads
// certificates from files. Probe is read-only.
package probe

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/kilnhq/kiln/internal/conditions"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Condition types, in the order Probe reports them.
const (
	KubeletHealthy           = "KubeletHealthy"
	ContainerdHealthy        = "ContainerdHealthy"
	APIServerReady           = "APIServerReady"
	NodeReady                = "NodeReady"
	ClusterDNSResolves       = "ClusterDNSResolves"
	CertificatesValid        = "CertificatesValid"
	EtcdMemberHealthy        = "EtcdMemberHealthy"
	CloudProviderInitialized = "CloudProviderInitialized"
)

// Types lists every condition type Probe may report.
var Types = []string{KubeletHealthy, ContainerdHealthy, APIServerReady, NodeReady, ClusterDNSResolves, CertificatesValid, EtcdMemberHealthy, CloudProviderInitialized}

// Defaults of Options.
const (
	DefaultKubeletHealthz   = "http://127.0.0.1:10248/healthz"
	DefaultContainerdSocket = "/run/containerd/containerd.sock"
	DefaultEtcdEndpoint     = "https://127.0.0.1:2379"
	DefaultTimeout          = 5 * time.Second
	// ExpiryWarning is how close to expiry CertificatesValid turns False
	// (severity Warning).
	ExpiryWarning = 30 * 24 * time.Hour
)

// Files read, relative to Options.Root.
const (
	kubeletConf       = "/etc/kubernetes/kubelet.conf"
	adminConf         = "/etc/kubernetes/admin.conf"
	pkiDir            = "/etc/kubernetes/pki"
	kubeletClientCert = "/var/lib/kubelet/pki/kubelet-client-current.pem"
	etcdManifest      = "/etc/kubernetes/manifests/etcd.yaml"
	etcdCA            = "/etc/kubernetes/pki/etcd/ca.crt"
	etcdClientCert    = "/etc/kubernetes/pki/apiserver-etcd-client.crt"
	etcdClientKey     = "/etc/kubernetes/pki/apiserver-etcd-client.key"
)

// Options configure a Prober. Zero values take the defaults, which are
// right for a kubeadm node.
type Options struct {
	// Root is the host's root directory ("/" in production).
	Root string
	// KubeletHealthz is the kubelet's healthz URL.
	KubeletHealthz string
	// ContainerdSocket is containerd's gRPC socket (a path under Root).
	ContainerdSocket string
	// EtcdEndpoint is the local etcd member's client URL.
	EtcdEndpoint string
	// DNSServer, when set, is the host:port asked instead of the cluster
	// DNS service IP on port 53 (tests).
	DNSServer string
	// Timeout bounds each check (default 5 s).
	Timeout time.Duration
	// Now is the clock (default time.Now).
	Now func() time.Time
	Log *slog.Logger
	// Observer, when set, is told of each check's result and latency
	// (agent/metrics).
	Observer Observer
}

// Observer is told of each check a Probe ran. Its method must not block.
type Observer interface {
	// ObserveProbe records that check (one of Types) ended with status
	// result (True, False or Unknown) after d.
	ObserveProbe(check, result string, d time.Duration)
}

// Prober checks the node's health.
type Prober struct {
	o   Options
	log *slog.Logger
	// plain is the HTTP client for the kubelet's healthz (no TLS).
	plain *http.Client

	// Clients kept between probes (their connections are reused), each
	// rebuilt when the files it was made from change (rotated
	// certificates).
	mu         sync.Mutex
	api        *apiClient
	apiKey     string
	etcd       *http.Client
	etcdKey    string
	containerd *grpc.ClientConn
}

// filesKey identifies the content of files by their size and mtime.
func (p *Prober) filesKey(files ...string) string {
	var b strings.Builder
	for _, f := range files {
		st, err := os.Stat(p.path(f))
		if err != nil {
			b.WriteString("-|")
			continue
		}
		fmt.Fprintf(&b, "%d.%d|", st.Size(), st.ModTime().UnixNano())
	}
	return b.String()
}

// cachedAPIClient returns the API client, rebuilt when the kubelet's
// kubeconfig or client certificate changed.
func (p *Prober) cachedAPIClient() (*apiClient, error) {
	key := p.filesKey(kubeletConf, kubeletClientCert)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.api != nil && p.apiKey == key {
		return p.api, nil
	}
	api, err := p.newAPIClient(kubeletConf)
	if err != nil {
		return nil, err
	}
	if p.api != nil {
		p.api.client.CloseIdleConnections()
	}
	p.api, p.apiKey = api, key
	return api, nil
}

// Close releases the connections kept between probes.
func (p *Prober) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.api != nil {
		p.api.client.CloseIdleConnections()
	}
	if p.etcd != nil {
		p.etcd.CloseIdleConnections()
	}
	if p.containerd != nil {
		return p.containerd.Close()
	}
	return nil
}

// New returns a Prober over o.
func New(o Options) *Prober {
	if o.Root == "" {
		o.Root = "/"
	}
	if o.KubeletHealthz == "" {
		o.KubeletHealthz = DefaultKubeletHealthz
	}
	if o.ContainerdSocket == "" {
		o.ContainerdSocket = DefaultContainerdSocket
	}
	if o.EtcdEndpoint == "" {
		o.EtcdEndpoint = DefaultEtcdEndpoint
	}
	if o.Timeout == 0 {
		o.Timeout = DefaultTimeout
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Prober{o: o, log: log.With("component", "probe"), plain: &http.Client{Transport: &http.Transport{Proxy: nil}}}
}

func (p *Prober) path(rel string) string { return filepath.Join(p.o.Root, rel) }

// check is one condition's check; it returns nil when the condition does
// not apply to this node.
type check struct {
	typ string
	run func(ctx context.Context, env *env) *typesv1.Condition
}

// env is what the checks of one Probe share: the request and a lazily
// built API client.
type env struct {
	p       *Prober
	cluster *agentv1.ClusterConfig

	apiOnce sync.Once
	api     *apiClient
	apiErr  error

	nodeOnce sync.Once
	node     *node
	nodeErr  error
}

func (e *env) apiClient() (*apiClient, error) {
	e.apiOnce.Do(func() { e.api, e.apiErr = e.p.cachedAPIClient() })
	return e.api, e.apiErr
}

// getNode fetches this node once per Probe (NodeReady and
// CloudProviderInitialized both read it).
func (e *env) getNode(ctx context.Context) (*node, error) {
	e.nodeOnce.Do(func() {
		api, err := e.apiClient()
		if err != nil {
			e.nodeErr = err
			return
		}
		e.node, e.nodeErr = api.node(ctx, e.nodeName(api))
	})
	return e.node, e.nodeErr
}

// nodeName is the cluster's node name, else the name in the kubelet's
// client certificate (system:node:NAME), else the host name.
func (e *env) nodeName(api *apiClient) string {
	if n := e.cluster.GetNodeName(); n != "" {
		return n
	}
	if api != nil && api.nodeName != "" {
		return api.nodeName
	}
	h, _ := os.Hostname()
	return h
}

// Probe runs every check not in req.Skip concurrently, each under the
// configured timeout, and returns their conditions in the order of Types
// and whether all are True. Checks that do not apply (etcd on a worker, the
// cloud provider when none is external) are left out. It fails only when
// ctx is done; an unhealthy node is a False condition, not an error.
func (p *Prober) Probe(ctx context.Context, req *agentv1.ProbeRequest) (*agentv1.ProbeResponse, error) {
	e := &env{p: p, cluster: req.GetCluster()}
	checks := []check{
		{KubeletHealthy, p.kubeletHealthy},
		{ContainerdHealthy, p.containerdHealthy},
		{APIServerReady, p.apiServerReady},
		{NodeReady, p.nodeReady},
		{ClusterDNSResolves, p.clusterDNS},
		{CertificatesValid, p.certificates},
		{EtcdMemberHealthy, p.etcdHealthy},
		{CloudProviderInitialized, p.cloudProvider},
	}
	results := make([]*typesv1.Condition, len(checks))
	var wg sync.WaitGroup
	for i, c := range checks {
		if slices.Contains(req.GetSkip(), c.typ) {
			continue
		}
		wg.Go(func() {
			cctx, cancel := context.WithTimeout(ctx, p.o.Timeout)
			defer cancel()
			start := p.o.Now()
			results[i] = c.run(cctx, e)
			if o := p.o.Observer; o != nil && results[i] != nil && ctx.Err() == nil {
				o.ObserveProbe(c.typ, results[i].GetStatus(), p.o.Now().Sub(start))
			}
		})
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("probe: %w", err)
	}
	resp := &agentv1.ProbeResponse{Healthy: true}
	now := p.o.Now()
	for _, c := range results {
		if c == nil {
			continue
		}
		if c.GetStatus() != conditions.True {
			resp.Healthy = false
			if c.Severity == "" {
				c.Severity = "Error"
			}
		}
		resp.Conditions, _ = conditions.Set(resp.Conditions, c, now)
	}
	return resp, nil
}

func isControlPlane(p *Prober, c *agentv1.ClusterConfig) bool {
	switch c.GetRole() {
	case "control-plane":
		return true
	case "worker":
		return false
	}
	_, err := os.Stat(p.path(etcdManifest))
	return err == nil
}

func trueCond(t, reason, msg string) *typesv1.Condition {
	return conditions.New(t, conditions.True, reason, msg)
}

func falseCond(t, reason, msg string) *typesv1.Condition {
	return conditions.New(t, conditions.False, reason, msg)
}

func unknownCond(t, reason, msg string) *typesv1.Condition {
	return conditions.New(t, conditions.Unknown, reason, msg)
}
