package probe

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// kubeletHealthy: GET the kubelet's healthz; True on 200 "ok".
func (p *Prober) kubeletHealthy(ctx context.Context, _ *env) *typesv1.Condition {
	body, err := getURL(ctx, p.plain, p.o.KubeletHealthz)
	if err != nil {
		var se *statusError
		if errors.As(err, &se) {
			return falseCond(KubeletHealthy, "KubeletUnhealthy", fmt.Sprintf("kubelet healthz %s answered %v", p.o.KubeletHealthz, err))
		}
		return falseCond(KubeletHealthy, "KubeletUnreachable", fmt.Sprintf("kubelet healthz %s: %v (is kubelet running? systemctl status kubelet)", p.o.KubeletHealthz, err))
	}
	if strings.TrimSpace(string(body)) != "ok" {
		return falseCond(KubeletHealthy, "KubeletUnhealthy", fmt.Sprintf("kubelet healthz answered %q, want \"ok\"", firstLine(string(body), 100)))
	}
	return trueCond(KubeletHealthy, "HealthzOK", "kubelet healthz answered ok")
}

// containerdHealthy: the gRPC health service on containerd's socket.
func (p *Prober) containerdHealthy(ctx context.Context, _ *env) *typesv1.Condition {
	sock := p.path(p.o.ContainerdSocket)
	if _, err := os.Stat(sock); err != nil {
		return falseCond(ContainerdHealthy, "SocketMissing", fmt.Sprintf("containerd socket %s: %v (is containerd running?)", p.o.ContainerdSocket, err))
	}
	conn, err := p.containerdConn(sock)
	if err != nil {
		return falseCond(ContainerdHealthy, "SocketUnreachable", fmt.Sprintf("containerd socket %s: %v", p.o.ContainerdSocket, err))
	}
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		return falseCond(ContainerdHealthy, "NotAnswering", fmt.Sprintf("containerd on %s did not answer its health check: %v", p.o.ContainerdSocket, err))
	}
	if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		return falseCond(ContainerdHealthy, "NotServing", fmt.Sprintf("containerd health is %s", resp.GetStatus()))
	}
	return trueCond(ContainerdHealthy, "Serving", "containerd answers on "+p.o.ContainerdSocket)
}

// containerdConn returns the gRPC connection to containerd, kept between
// probes (gRPC reconnects by itself after a containerd restart).
func (p *Prober) containerdConn(sock string) (*grpc.ClientConn, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.containerd != nil {
		return p.containerd, nil
	}
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	p.containerd = conn
	return conn, nil
}

// etcdClient returns the HTTP client for etcd, rebuilt when its
// credentials change.
func (p *Prober) etcdClient() (*http.Client, error) {
	key := p.filesKey(etcdCA, etcdClientCert, etcdClientKey)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.etcd != nil && p.etcdKey == key {
		return p.etcd, nil
	}
	read := func(f string) ([]byte, error) { return os.ReadFile(p.path(f)) }
	ca, err1 := read(etcdCA)
	cert, err2 := read(etcdClientCert)
	key2, err3 := read(etcdClientKey)
	if err := errors.Join(err1, err2, err3); err != nil {
		return nil, err
	}
	tlsConf, err := clientTLS(ca, cert, key2)
	if err != nil {
		return nil, err
	}
	if p.etcd != nil {
		p.etcd.CloseIdleConnections()
	}
	p.etcd = &http.Client{Transport: &http.Transport{TLSClientConfig: tlsConf, Proxy: nil}}
	p.etcdKey = key
	return p.etcd, nil
}

// apiServerReady: GET /readyz with the kubelet's credentials.
func (p *Prober) apiServerReady(ctx context.Context, e *env) *typesv1.Condition {
	api, err := e.apiClient()
	if err != nil {
		return falseCond(APIServerReady, "NoCredentials", err.Error())
	}
	body, err := api.get(ctx, "/readyz")
	if err != nil {
		var se *statusError
		if errors.As(err, &se) {
			return falseCond(APIServerReady, "NotReady", fmt.Sprintf("%s/readyz: %v", api.server, err))
		}
		return falseCond(APIServerReady, "Unreachable", fmt.Sprintf("%s/readyz: %v", api.server, err))
	}
	if strings.TrimSpace(string(body)) != "ok" {
		return falseCond(APIServerReady, "NotReady", fmt.Sprintf("%s/readyz answered %q", api.server, firstLine(string(body), 100)))
	}
	return trueCond(APIServerReady, "ReadyzOK", api.server+"/readyz answered ok")
}

// pressureAdvice is what to do about each of the kubelet's pressure
// conditions.
var pressureAdvice = map[string]string{
	"DiskPressure": "free space on the node's disk (journalctl -u kubelet | grep -i evict shows what the kubelet tries to reclaim), " +
		"or set absolute evictionHard thresholds with a kubeletconfiguration patch in /etc/kiln/kubeadm-patches " +
		"(the kubelet's defaults are percentages of the disk: a lab node shares the machine's, docs/lab.md)",
	"MemoryPressure": "free memory on the node (kubectl top pods -A --field-selector spec.nodeName=<node>) or give it more",
	"PIDPressure":    "find the pod that forks too many processes (kubectl get pods -A --field-selector spec.nodeName=<node>)",
}

// pressure returns the node's pressure conditions that are True
// (DiskPressure, MemoryPressure, PIDPressure, in the node's order), each
// as "Type (kubelet's message)", and the first one's type.
func (n *node) pressure() (first string, all []string) {
	for _, c := range n.Status.Conditions {
		if _, ok := pressureAdvice[c.Type]; !ok || c.Status != "True" {
			continue
		}
		if first == "" {
			first = c.Type
		}
		all = append(all, fmt.Sprintf("%s (%s)", c.Type, c.Message))
	}
	return first, all
}

// nodeReady: the node's own Ready condition, and the kubelet's pressure
// conditions. A node under pressure stays Ready but evicts pods (CoreDNS
// among them) and admits no new ones: NodeReady is then False with the
// pressure as its reason, severity Warning, and what to do.
func (p *Prober) nodeReady(ctx context.Context, e *env) *typesv1.Condition {
	n, err := e.getNode(ctx)
	if err != nil {
		return unknownCond(NodeReady, "NodeUnavailable", err.Error())
	}
	first, pressures := n.pressure()
	var advice string
	if first != "" {
		advice = fmt.Sprintf("; the kubelet reports %s: it evicts pods (CoreDNS among them) and admits no new ones until it clears: %s",
			strings.Join(pressures, ", "), pressureAdvice[first])
	}
	for _, c := range n.Status.Conditions {
		if c.Type != "Ready" {
			continue
		}
		msg := fmt.Sprintf("node Ready is %s: %s", c.Status, c.Message) + advice
		switch c.Status {
		case "True":
			if first != "" {
				cond := falseCond(NodeReady, first, msg)
				cond.Severity = "Warning"
				return cond
			}
			return trueCond(NodeReady, c.Reason, msg)
		case "False":
			return falseCond(NodeReady, c.Reason, msg)
		}
		return unknownCond(NodeReady, c.Reason, msg)
	}
	return unknownCond(NodeReady, "NoReadyCondition", "the node has no Ready condition yet"+advice)
}

// NoEndpointsAdvice is what ClusterDNSResolves says when the DNS service
// refuses the query: kube-proxy rejects traffic to a service with no ready
// endpoints (a write that fails with EPERM, or an ICMP port unreachable
// read as connection refused).
const NoEndpointsAdvice = "the DNS service has no ready endpoints (CoreDNS not running: kubectl -n kube-system get pods -l k8s-app=kube-dns); a node under DiskPressure evicts it"

// clusterDNS asks the cluster DNS service (the 10th address of the service
// CIDR) for kubernetes.default.svc.<domain> and wants the kubernetes
// service's address (the 1st) back.
func (p *Prober) clusterDNS(ctx context.Context, e *env) *typesv1.Condition {
	cidr := e.cluster.GetServiceCidr()
	if cidr == "" {
		return unknownCond(ClusterDNSResolves, "NoServiceCIDR", "the cluster's service CIDR was not given: cannot find the DNS service")
	}
	prefix, err := netip.ParsePrefix(cidr)
	if err != nil {
		return unknownCond(ClusterDNSResolves, "BadServiceCIDR", fmt.Sprintf("service CIDR %q: %v", cidr, err))
	}
	dnsIP, err1 := nthAddr(prefix, 10)
	apiIP, err2 := nthAddr(prefix, 1)
	if err := errors.Join(err1, err2); err != nil {
		return unknownCond(ClusterDNSResolves, "BadServiceCIDR", err.Error())
	}
	domain := e.cluster.GetDnsDomain()
	if domain == "" {
		domain = "cluster.local"
	}
	name := "kubernetes.default.svc." + strings.TrimSuffix(domain, ".") + "."
	server := p.o.DNSServer
	if server == "" {
		server = net.JoinHostPort(dnsIP.String(), "53")
	}
	addrs, err := lookup(ctx, server, name, apiIP.Is6())
	if err != nil {
		if refused(err) {
			msg := fmt.Sprintf("DNS %s for %s: %s: %s", server, name, refusal(err), NoEndpointsAdvice)
			if n, nerr := e.getNode(ctx); nerr == nil {
				if _, pressures := n.pressure(); len(pressures) > 0 {
					msg += "; this node reports " + strings.Join(pressures, ", ")
				}
			}
			return falseCond(ClusterDNSResolves, "NoEndpoints", msg)
		}
		return falseCond(ClusterDNSResolves, "NoAnswer", fmt.Sprintf("DNS %s for %s: %v", server, name, err))
	}
	if !slices.Contains(addrs, apiIP) {
		return falseCond(ClusterDNSResolves, "WrongAnswer", fmt.Sprintf("DNS %s answered %s = %v, want %s (the kubernetes service)", server, name, addrs, apiIP))
	}
	return trueCond(ClusterDNSResolves, "Resolved", fmt.Sprintf("DNS %s answered %s = %s", server, name, apiIP))
}

// refused reports whether a DNS query failed because the service refused
// it: kube-proxy's REJECT rule for a service with no ready endpoints makes
// the write fail with EPERM (or the read with ECONNREFUSED).
func refused(err error) bool {
	return errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.ECONNREFUSED)
}

// refusal says how the service refused a query, without the socket's
// local address: net's error names the ephemeral source port, which
// differs on every probe, and a condition's message that changes while the
// state does not is a store write and a progress line each time (a lab's
// `make lab` printed one every 4 s while CoreDNS was not yet running).
func refusal(err error) string {
	var errno syscall.Errno
	switch {
	case errors.As(err, &errno) && errno == syscall.EPERM:
		return "the query could not be sent: " + errno.Error()
	case errors.As(err, &errno):
		return "the query was refused: " + errno.Error()
	}
	return err.Error()
}

// nthAddr returns the n-th address of prefix (0 is the network address).
func nthAddr(prefix netip.Prefix, n int64) (netip.Addr, error) {
	base := prefix.Masked().Addr()
	v := new(big.Int).SetBytes(base.AsSlice())
	v.Add(v, big.NewInt(n))
	b := v.Bytes()
	size := len(base.AsSlice())
	if len(b) > size {
		return netip.Addr{}, fmt.Errorf("service CIDR %s has no address %d", prefix, n)
	}
	buf := make([]byte, size)
	copy(buf[size-len(b):], b)
	a, _ := netip.AddrFromSlice(buf)
	if !prefix.Contains(a) {
		return netip.Addr{}, fmt.Errorf("service CIDR %s has no address %d", prefix, n)
	}
	return a, nil
}

// lookup sends one A (or AAAA) query for name to server over UDP and
// returns the addresses of the answer. It fails on a timeout, a non-zero
// rcode, a truncated answer or an answer with no address.
func lookup(ctx context.Context, server, name string, v6 bool) ([]netip.Addr, error) {
	qtype := dnsmessage.TypeA
	if v6 {
		qtype = dnsmessage.TypeAAAA
	}
	qname, err := dnsmessage.NewName(name)
	if err != nil {
		return nil, err
	}
	id := uint16(time.Now().UnixNano())
	msg := dnsmessage.Message{
		Header:    dnsmessage.Header{ID: id, RecursionDesired: true},
		Questions: []dnsmessage.Question{{Name: qname, Type: qtype, Class: dnsmessage.ClassINET}},
	}
	q, err := msg.Pack()
	if err != nil {
		return nil, err
	}
	var d net.Dialer
	conn, err := d.DialContext(ctx, "udp", server)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Now()) })
	defer stop()
	buf := make([]byte, 1232)
	deadline, hasDeadline := ctx.Deadline()
	expired := func() bool { return ctx.Err() != nil || (hasDeadline && !time.Now().Before(deadline)) }
	noAnswer := fmt.Errorf("no answer before the deadline")
	// Resend once a second: UDP may drop the first query.
	for {
		if expired() {
			return nil, noAnswer
		}
		if _, err := conn.Write(q); err != nil {
			if expired() {
				return nil, noAnswer
			}
			return nil, err
		}
		rd := time.Now().Add(time.Second)
		if hasDeadline && deadline.Before(rd) {
			rd = deadline
		}
		_ = conn.SetReadDeadline(rd)
		n, err := conn.Read(buf)
		if err != nil {
			var ne net.Error
			if expired() {
				return nil, noAnswer
			}
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return nil, err
		}
		var resp dnsmessage.Message
		if err := resp.Unpack(buf[:n]); err != nil {
			return nil, fmt.Errorf("bad answer: %w", err)
		}
		if resp.Header.ID != id || !resp.Header.Response {
			continue
		}
		if resp.Header.RCode != dnsmessage.RCodeSuccess {
			return nil, fmt.Errorf("answer code %s", rcodeName(resp.Header.RCode))
		}
		if resp.Header.Truncated {
			return nil, fmt.Errorf("answer truncated")
		}
		var out []netip.Addr
		for _, a := range resp.Answers {
			switch r := a.Body.(type) {
			case *dnsmessage.AResource:
				out = append(out, netip.AddrFrom4(r.A))
			case *dnsmessage.AAAAResource:
				out = append(out, netip.AddrFrom16(r.AAAA))
			}
		}
		if len(out) == 0 {
			return nil, fmt.Errorf("answer has no address")
		}
		return out, nil
	}
}

func rcodeName(c dnsmessage.RCode) string {
	switch c {
	case dnsmessage.RCodeNameError:
		return "NXDOMAIN (no such name: is CoreDNS serving the cluster domain?)"
	case dnsmessage.RCodeServerFailure:
		return "SERVFAIL"
	case dnsmessage.RCodeRefused:
		return "REFUSED"
	}
	return strings.TrimPrefix(c.String(), "RCode")
}

// certificates: the earliest expiry of the cluster's certificates on this
// node and of the kubelet's client certificate.
func (p *Prober) certificates(_ context.Context, _ *env) *typesv1.Condition {
	files, _ := filepath.Glob(p.path(pkiDir + "/*.crt"))
	etcd, _ := filepath.Glob(p.path(pkiDir + "/etcd/*.crt"))
	files = append(files, etcd...)
	files = append(files, p.path(kubeletClientCert))
	now := p.o.Now()
	var (
		earliest time.Time
		which    string
		found    int
	)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, c := range pemCerts(b) {
			found++
			if earliest.IsZero() || c.NotAfter.Before(earliest) {
				earliest, which = c.NotAfter, strings.TrimPrefix(f, strings.TrimSuffix(p.o.Root, "/"))
			}
		}
	}
	if found == 0 {
		return falseCond(CertificatesValid, "NoCertificates", fmt.Sprintf("no certificates in %s or %s: the node has not joined a cluster", pkiDir, kubeletClientCert))
	}
	left := earliest.Sub(now)
	days := int(left.Hours() / 24)
	switch {
	case left <= 0:
		return falseCond(CertificatesValid, "Expired", fmt.Sprintf("%s expired %s (%d days ago); reimage or run kubeadm certs renew", which, earliest.UTC().Format(time.RFC3339), -days))
	case left < ExpiryWarning:
		c := falseCond(CertificatesValid, "ExpiringSoon", fmt.Sprintf("%d days left: %s expires %s", days, which, earliest.UTC().Format(time.RFC3339)))
		c.Severity = "Warning"
		return c
	}
	return trueCond(CertificatesValid, "Valid", fmt.Sprintf("%d days left: earliest expiry %s (%s) of %d certificates", days, earliest.UTC().Format(time.RFC3339), which, found))
}

// etcdHealthy: the local etcd member's /health over its client
// certificate, on control-plane nodes only.
func (p *Prober) etcdHealthy(ctx context.Context, e *env) *typesv1.Condition {
	if !isControlPlane(p, e.cluster) {
		return nil
	}
	c, err := p.etcdClient()
	if err != nil {
		return falseCond(EtcdMemberHealthy, "NoCredentials", fmt.Sprintf("etcd client credentials: %v", err))
	}
	body, err := getURL(ctx, c, p.o.EtcdEndpoint+"/health")
	if err != nil && body == nil {
		return falseCond(EtcdMemberHealthy, "Unreachable", fmt.Sprintf("etcd %s/health: %v", p.o.EtcdEndpoint, err))
	}
	var h struct {
		Health string `json:"health"`
		Reason string `json:"reason"`
	}
	if jerr := json.Unmarshal(body, &h); jerr != nil {
		return falseCond(EtcdMemberHealthy, "Unhealthy", fmt.Sprintf("etcd %s/health answered %q", p.o.EtcdEndpoint, firstLine(string(body), 100)))
	}
	if h.Health != "true" {
		return falseCond(EtcdMemberHealthy, "Unhealthy", fmt.Sprintf("etcd %s/health: health=%s reason=%q", p.o.EtcdEndpoint, h.Health, h.Reason))
	}
	return trueCond(EtcdMemberHealthy, "Healthy", "etcd member "+p.o.EtcdEndpoint+" is healthy")
}

// uninitializedTaint marks a node an external cloud provider has not
// initialised.
const uninitializedTaint = "node.cloudprovider.kubernetes.io/uninitialized"

// CCMFix is the advice CloudProviderInitialized gives when the node waits
// for a cloud-controller-manager that is not running (the deadlock of a
// CCM that cannot schedule onto uninitialised, not-ready control planes).
const CCMFix = "run the cloud-controller-manager with hostNetwork: true, a nodeSelector for node-role.kubernetes.io/control-plane, and tolerations for node.cloudprovider.kubernetes.io/uninitialized, node.kubernetes.io/not-ready and node-role.kubernetes.io/control-plane (NoSchedule)"

// cloudProvider: with an external cloud provider, the node must lose the
// uninitialized taint; if it keeps it while no cloud-controller-manager
// runs, say how to fix the CCM's scheduling.
func (p *Prober) cloudProvider(ctx context.Context, e *env) *typesv1.Condition {
	if e.cluster.GetCloudProvider() != "external" {
		return nil
	}
	n, err := e.getNode(ctx)
	if err != nil {
		return unknownCond(CloudProviderInitialized, "NodeUnavailable", err.Error())
	}
	tainted := false
	for _, t := range n.Spec.Taints {
		if t.Key == uninitializedTaint {
			tainted = true
		}
	}
	if !tainted {
		return trueCond(CloudProviderInitialized, "Initialized", "the cloud provider has initialised the node")
	}
	api, _ := e.apiClient()
	running, pending, scope, err := p.ccmPods(ctx, api, e.nodeName(api))
	if err != nil {
		return falseCond(CloudProviderInitialized, "Uninitialized", fmt.Sprintf("the node still has the taint %s; could not list pods to find a cloud-controller-manager (%v); if none runs: %s", uninitializedTaint, err, CCMFix))
	}
	if running > 0 {
		c := falseCond(CloudProviderInitialized, "Initializing", fmt.Sprintf("the node still has the taint %s; %d cloud-controller-manager pod(s) run %s and have not initialised it yet", uninitializedTaint, running, scope))
		c.Severity = "Warning"
		return c
	}
	return falseCond(CloudProviderInitialized, "CloudControllerManagerNotRunning", fmt.Sprintf("the node still has the taint %s and no cloud-controller-manager pod is running %s (%d pending): %s", uninitializedTaint, scope, pending, CCMFix))
}

// ccmPods counts running and not-running cloud-controller-manager pods.
// The node authorizer lets a kubelet list only the pods bound to its own
// node, so on a control-plane node (which has admin.conf) the whole
// cluster is searched with the admin credentials; elsewhere only this
// node's pods. scope says which, for the message.
func (p *Prober) ccmPods(ctx context.Context, kubelet *apiClient, nodeName string) (running, other int, scope string, err error) {
	var b []byte
	if _, serr := os.Stat(p.path(adminConf)); serr == nil {
		admin, aerr := p.newAPIClient(adminConf)
		if aerr != nil {
			return 0, 0, "", aerr
		}
		defer admin.client.CloseIdleConnections()
		scope = "in the cluster"
		b, err = admin.get(ctx, "/api/v1/pods")
	} else {
		scope = "on this node"
		b, err = kubelet.get(ctx, "/api/v1/pods?fieldSelector="+url.QueryEscape("spec.nodeName="+nodeName))
	}
	if err != nil {
		return 0, 0, "", err
	}
	var pl podList
	if err := json.Unmarshal(b, &pl); err != nil {
		return 0, 0, "", err
	}
	for _, pod := range pl.Items {
		isCCM := strings.Contains(pod.Metadata.Name, "cloud-controller-manager")
		for k, v := range pod.Metadata.Labels {
			if strings.Contains(k, "cloud-controller-manager") || strings.Contains(v, "cloud-controller-manager") {
				isCCM = true
			}
		}
		if !isCCM {
			continue
		}
		if pod.Status.Phase == "Running" {
			running++
		} else {
			other++
		}
	}
	return running, other, scope, nil
}
