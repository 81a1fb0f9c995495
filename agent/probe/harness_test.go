package probe

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/dns/dnsmessage"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// quiet drops the servers' handshake logs (the probe closes connections
// when a check ends).
var quiet = log.New(io.Discard, "", 0)

// testCA issues certificates for the test's servers and clients.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newTestCA(t testing.TB, cn string) *testCA {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(10 * 365 * 24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue returns a leaf's PEM certificate and key. A server leaf is valid
// for 127.0.0.1.
func (ca *testCA) issue(t testing.TB, cn string, server bool, notAfter time.Time) (certPEM, keyPEM []byte) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: notAfter,
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	require.NoError(t, err)
	kder, err := x509.MarshalECPrivateKey(key)
	require.NoError(t, err)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})
}

func (ca *testCA) serverTLS(t testing.TB) *tls.Config {
	c, k := ca.issue(t, "server", true, time.Now().Add(365*24*time.Hour))
	pair, err := tls.X509KeyPair(c, k)
	require.NoError(t, err)
	pool := x509.NewCertPool()
	pool.AddCert(ca.cert)
	return &tls.Config{Certificates: []tls.Certificate{pair}, ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert}
}

// node is a fake kubeadm node: a root with kubeadm's files, and real
// servers on loopback answering as the kubelet, containerd, the API
// server, etcd and CoreDNS do. Its fields inject faults.
type fakeNode struct {
	root string
	opts Options

	mu            sync.Mutex
	healthz       string // kubelet healthz body; "" = 500
	readyz        int    // API /readyz status
	nodeReady     string // Ready condition status
	pressure      string // a pressure condition that is True ("DiskPressure"); "" = none
	taints        []string
	ccmPhase      string // "" = no CCM pod
	etcdHealth    string
	dnsAnswer     string // A record; "" = NXDOMAIN; "drop" = no answer
	apiRequests   []string
	containerdSrv *health.Server
}

func (n *fakeNode) set(f func(n *fakeNode)) {
	n.mu.Lock()
	defer n.mu.Unlock()
	f(n)
}

const nodeName = "node-1"

func newFakeNode(t testing.TB, clientNotAfter time.Time) *fakeNode {
	t.Helper()
	n := &fakeNode{root: t.TempDir(), healthz: "ok", readyz: 200, nodeReady: "True", etcdHealth: "true", dnsAnswer: "10.96.0.1"}
	write := func(rel string, data []byte, mode os.FileMode) {
		p := filepath.Join(n.root, rel)
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, data, mode))
	}
	kubeCA := newTestCA(t, "kubernetes")
	write(pkiDir+"/ca.crt", kubeCA.pem, 0o644)
	c, _ := kubeCA.issue(t, "kube-apiserver", true, time.Now().Add(365*24*time.Hour))
	write(pkiDir+"/apiserver.crt", c, 0o644)
	cc, ck := kubeCA.issue(t, "system:node:"+nodeName, false, clientNotAfter)
	write(kubeletClientCert, append(cc, ck...), 0o600)

	// kubelet healthz
	kubelet := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.mu.Lock()
		body := n.healthz
		n.mu.Unlock()
		if body == "" {
			http.Error(w, "[-]syncloop failed", http.StatusInternalServerError)
			return
		}
		fmt.Fprint(w, body)
	}))
	t.Cleanup(kubelet.Close)

	// API server, client certificates required
	api := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.mu.Lock()
		defer n.mu.Unlock()
		n.apiRequests = append(n.apiRequests, r.TLS.PeerCertificates[0].Subject.CommonName+" "+r.URL.Path)
		switch r.URL.Path {
		case "/readyz":
			w.WriteHeader(n.readyz)
			if n.readyz == 200 {
				fmt.Fprint(w, "ok")
			} else {
				fmt.Fprint(w, "[-]etcd failed: reason withheld\nreadyz check failed")
			}
		case "/api/v1/nodes/" + nodeName:
			var taints []string
			for _, k := range n.taints {
				taints = append(taints, fmt.Sprintf(`{"key":%q,"effect":"NoSchedule"}`, k))
			}
			conds := []string{`{"type":"MemoryPressure","status":"False","reason":"KubeletHasSufficientMemory"}`}
			if n.pressure != "" {
				conds = []string{fmt.Sprintf(`{"type":%q,"status":"True","reason":"KubeletHas%s","message":"kubelet has %s"}`, n.pressure, n.pressure, strings.ToLower(n.pressure))}
			}
			conds = append(conds, fmt.Sprintf(`{"type":"Ready","status":%q,"reason":"KubeletReady","message":"kubelet is posting ready status"}`, n.nodeReady))
			fmt.Fprintf(w, `{"kind":"Node","spec":{"taints":[%s]},"status":{"conditions":[%s]}}`, strings.Join(taints, ","), strings.Join(conds, ","))
		case "/api/v1/pods":
			// The node authorizer: a kubelet lists only its own node's pods.
			cn := r.TLS.PeerCertificates[0].Subject.CommonName
			sel := r.URL.Query().Get("fieldSelector")
			if strings.HasPrefix(cn, "system:node:") && sel != "spec.nodeName="+strings.TrimPrefix(cn, "system:node:") {
				w.WriteHeader(http.StatusForbidden)
				fmt.Fprintf(w, `{"kind":"Status","status":"Failure","message":"pods is forbidden: User \"%s\" cannot list resource \"pods\" in API group \"\" at the cluster scope","reason":"Forbidden","code":403}`, cn)
				return
			}
			type pod struct{ name, label, node, phase string }
			pods := []pod{{"coredns-1", "kube-dns", "", "Pending"}}
			if n.ccmPhase == "Running" {
				pods = append(pods, pod{"ccm-x", "cloud-controller-manager", nodeName, "Running"})
			} else if n.ccmPhase != "" {
				pods = append(pods, pod{"ccm-x", "cloud-controller-manager", "", n.ccmPhase})
			}
			var items []string
			for _, p := range pods {
				if sel != "" && sel != "spec.nodeName="+p.node {
					continue
				}
				items = append(items, fmt.Sprintf(`{"metadata":{"name":%q,"namespace":"kube-system","labels":{"component":%q}},"spec":{"nodeName":%q},"status":{"phase":%q}}`, p.name, p.label, p.node, p.phase))
			}
			fmt.Fprintf(w, `{"kind":"PodList","items":[%s]}`, strings.Join(items, ","))
		default:
			http.NotFound(w, r)
		}
	}))
	api.TLS = kubeCA.serverTLS(t)
	api.Config.ErrorLog = quiet
	api.StartTLS()
	t.Cleanup(api.Close)
	kubeconfig := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- cluster:
    certificate-authority-data: %s
    server: %s
  name: default-cluster
contexts:
- context:
    cluster: default-cluster
    namespace: default
    user: default-auth
  name: default-context
current-context: default-context
users:
- name: default-auth
  user:
    client-certificate: %s
    client-key: %s
`, base64.StdEncoding.EncodeToString(kubeCA.pem), api.URL, kubeletClientCert, kubeletClientCert)
	write(kubeletConf, []byte(kubeconfig), 0o600)
	ac, ak := kubeCA.issue(t, "kubernetes-admin", false, time.Now().Add(365*24*time.Hour))
	adminKubeconfig := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- cluster:
    certificate-authority-data: %s
    server: %s
  name: kubernetes
contexts:
- context:
    cluster: kubernetes
    user: kubernetes-admin
  name: kubernetes-admin@kubernetes
current-context: kubernetes-admin@kubernetes
users:
- name: kubernetes-admin
  user:
    client-certificate-data: %s
    client-key-data: %s
`, base64.StdEncoding.EncodeToString(kubeCA.pem), api.URL, base64.StdEncoding.EncodeToString(ac), base64.StdEncoding.EncodeToString(ak))
	write(adminConf, []byte(adminKubeconfig), 0o600)

	// etcd, its own CA
	etcdCAc := newTestCA(t, "etcd-ca")
	write(etcdCA, etcdCAc.pem, 0o644)
	ec, ek := etcdCAc.issue(t, "kube-apiserver-etcd-client", false, time.Now().Add(365*24*time.Hour))
	write(etcdClientCert, ec, 0o644)
	write(etcdClientKey, ek, 0o600)
	write(etcdManifest, []byte("kind: Pod\n"), 0o600)
	etcd := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.mu.Lock()
		defer n.mu.Unlock()
		if r.URL.Path != "/health" {
			http.NotFound(w, r)
			return
		}
		if n.etcdHealth != "true" {
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprint(w, `{"health":"false","reason":"RAFT NO LEADER"}`)
			return
		}
		fmt.Fprint(w, `{"health":"true","reason":""}`)
	}))
	etcd.TLS = etcdCAc.serverTLS(t)
	etcd.Config.ErrorLog = quiet
	etcd.StartTLS()
	t.Cleanup(etcd.Close)

	// containerd: a real gRPC health service on a unix socket
	sock := filepath.Join(n.root, DefaultContainerdSocket)
	require.NoError(t, os.MkdirAll(filepath.Dir(sock), 0o755))
	lis, err := net.Listen("unix", sock)
	require.NoError(t, err)
	gs := grpc.NewServer()
	n.containerdSrv = health.NewServer()
	healthpb.RegisterHealthServer(gs, n.containerdSrv)
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)

	// CoreDNS: a UDP DNS server on loopback
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { pc.Close() })
	go n.serveDNS(pc)

	n.opts = Options{
		Root:           n.root,
		KubeletHealthz: kubelet.URL + "/healthz",
		EtcdEndpoint:   etcd.URL,
		DNSServer:      pc.LocalAddr().String(),
		Timeout:        3 * time.Second,
	}
	return n
}

func (n *fakeNode) serveDNS(pc net.PacketConn) {
	buf := make([]byte, 1500)
	for {
		sz, addr, err := pc.ReadFrom(buf)
		if err != nil {
			return
		}
		var q dnsmessage.Message
		if q.Unpack(buf[:sz]) != nil || len(q.Questions) != 1 {
			continue
		}
		n.mu.Lock()
		answer := n.dnsAnswer
		n.mu.Unlock()
		if answer == "drop" {
			continue
		}
		resp := dnsmessage.Message{Header: dnsmessage.Header{ID: q.Header.ID, Response: true, Authoritative: true}, Questions: q.Questions}
		qq := q.Questions[0]
		switch {
		case answer == "":
			resp.Header.RCode = dnsmessage.RCodeNameError
		case qq.Name.String() == "kubernetes.default.svc.cluster.local." && qq.Type == dnsmessage.TypeA:
			ip := net.ParseIP(answer).To4()
			resp.Answers = []dnsmessage.Resource{{
				Header: dnsmessage.ResourceHeader{Name: qq.Name, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET, TTL: 5},
				Body:   &dnsmessage.AResource{A: [4]byte(ip)},
			}}
		default:
			resp.Header.RCode = dnsmessage.RCodeNameError
		}
		b, err := resp.Pack()
		if err == nil {
			_, _ = pc.WriteTo(b, addr)
		}
	}
}

func cluster() *agentv1.ClusterConfig {
	return &agentv1.ClusterConfig{KubernetesVersion: "v1.34.4", ServiceCidr: "10.96.0.0/12", DnsDomain: "cluster.local", Role: "control-plane"}
}

func probeOnce(t testing.TB, n *fakeNode, c *agentv1.ClusterConfig, skip ...string) *agentv1.ProbeResponse {
	t.Helper()
	p := New(n.opts)
	defer p.Close()
	resp, err := p.Probe(context.Background(), &agentv1.ProbeRequest{Cluster: c, Skip: skip})
	require.NoError(t, err)
	return resp
}
