package probe

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	"sigs.k8s.io/yaml"
)

// kubeconfig is the part of a kubeconfig file the probe reads.
type kubeconfig struct {
	CurrentContext string `json:"current-context"`
	Clusters       []struct {
		Name    string `json:"name"`
		Cluster struct {
			Server string `json:"server"`
			CAData string `json:"certificate-authority-data"`
			CA     string `json:"certificate-authority"`
		} `json:"cluster"`
	} `json:"clusters"`
	Users []struct {
		Name string `json:"name"`
		User struct {
			CertData string `json:"client-certificate-data"`
			KeyData  string `json:"client-key-data"`
			Cert     string `json:"client-certificate"`
			Key      string `json:"client-key"`
		} `json:"user"`
	} `json:"users"`
	Contexts []struct {
		Name    string `json:"name"`
		Context struct {
			Cluster string `json:"cluster"`
			User    string `json:"user"`
		} `json:"context"`
	} `json:"contexts"`
}

// apiClient makes REST calls to the API server as the kubelet.
type apiClient struct {
	server   string
	client   *http.Client
	nodeName string // from the client certificate, system:node:NAME
}

// newAPIClient reads a kubeconfig (the kubelet's, or admin.conf; its file
// paths taken under Root) and returns a client with its credentials.
func (p *Prober) newAPIClient(kubeletConf string) (*apiClient, error) {
	b, err := os.ReadFile(p.path(kubeletConf))
	if err != nil {
		return nil, fmt.Errorf("kubelet kubeconfig: %w", err)
	}
	var kc kubeconfig
	if err := yaml.Unmarshal(b, &kc); err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", kubeletConf, err)
	}
	clusterName, userName := "", ""
	for _, c := range kc.Contexts {
		if c.Name == kc.CurrentContext {
			clusterName, userName = c.Context.Cluster, c.Context.User
		}
	}
	ci, ui := -1, -1
	for i, c := range kc.Clusters {
		if c.Name == clusterName || (ci < 0 && clusterName == "") {
			ci = i
		}
	}
	for i, u := range kc.Users {
		if u.Name == userName || (ui < 0 && userName == "") {
			ui = i
		}
	}
	if ci < 0 || ui < 0 {
		return nil, fmt.Errorf("kubeconfig %s: no cluster or user for context %q", kubeletConf, kc.CurrentContext)
	}
	cl, u := kc.Clusters[ci].Cluster, kc.Users[ui].User
	caPEM, err := p.dataOrFile(cl.CAData, cl.CA)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: certificate authority: %w", kubeletConf, err)
	}
	certPEM, err := p.dataOrFile(u.CertData, u.Cert)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: client certificate: %w", kubeletConf, err)
	}
	keyPEM, err := p.dataOrFile(u.KeyData, u.Key)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: client key: %w", kubeletConf, err)
	}
	tlsConf, err := clientTLS(caPEM, certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", kubeletConf, err)
	}
	if _, err := url.Parse(cl.Server); err != nil || cl.Server == "" {
		return nil, fmt.Errorf("kubeconfig %s: server %q is not a URL", kubeletConf, cl.Server)
	}
	api := &apiClient{
		server: strings.TrimSuffix(cl.Server, "/"),
		client: &http.Client{Transport: &http.Transport{TLSClientConfig: tlsConf, Proxy: nil, ForceAttemptHTTP2: true}},
	}
	if leaf, err := x509.ParseCertificate(tlsConf.Certificates[0].Certificate[0]); err == nil {
		api.nodeName = strings.TrimPrefix(leaf.Subject.CommonName, "system:node:")
		if api.nodeName == leaf.Subject.CommonName {
			api.nodeName = ""
		}
	}
	return api, nil
}

// dataOrFile returns base64 data, or the file's content (under Root).
func (p *Prober) dataOrFile(data, file string) ([]byte, error) {
	if data != "" {
		return base64.StdEncoding.DecodeString(data)
	}
	if file == "" {
		return nil, fmt.Errorf("neither data nor a file given")
	}
	return os.ReadFile(filepath.Join(p.o.Root, file))
}

// clientTLS builds a TLS client configuration trusting caPEM and
// presenting the certificate and key.
func clientTLS(caPEM, certPEM, keyPEM []byte) (*tls.Config, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return nil, fmt.Errorf("no CA certificate in PEM")
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("client certificate: %w", err)
	}
	return &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}, nil
}

// get fetches path and returns the body of a 200 answer, or an error
// naming the status and the start of the body.
func (a *apiClient) get(ctx context.Context, path string) ([]byte, error) {
	return getURL(ctx, a.client, a.server+path)
}

func getURL(ctx context.Context, c *http.Client, u string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", u, err)
	}
	if resp.StatusCode != http.StatusOK {
		return body, &statusError{code: resp.StatusCode, body: firstLine(string(body), 200)}
	}
	return body, nil
}

type statusError struct {
	code int
	body string
}

func (e *statusError) Error() string {
	if e.body == "" {
		return fmt.Sprintf("HTTP %d", e.code)
	}
	return fmt.Sprintf("HTTP %d: %s", e.code, e.body)
}

func firstLine(s string, n int) string {
	s = strings.TrimSpace(s)
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	if len(s) > n {
		s = s[:n] + "…"
	}
	return s
}

// node is the part of a Node object the probe reads.
type node struct {
	Spec struct {
		Taints []struct {
			Key    string `json:"key"`
			Effect string `json:"effect"`
		} `json:"taints"`
	} `json:"spec"`
	Status struct {
		Conditions []struct {
			Type    string `json:"type"`
			Status  string `json:"status"`
			Reason  string `json:"reason"`
			Message string `json:"message"`
		} `json:"conditions"`
	} `json:"status"`
}

func (a *apiClient) node(ctx context.Context, name string) (*node, error) {
	if name == "" {
		return nil, fmt.Errorf("node name unknown")
	}
	b, err := a.get(ctx, "/api/v1/nodes/"+url.PathEscape(name))
	if err != nil {
		return nil, fmt.Errorf("get node %s: %w", name, err)
	}
	var n node
	if err := json.Unmarshal(b, &n); err != nil {
		return nil, fmt.Errorf("get node %s: %w", name, err)
	}
	return &n, nil
}

// podList is the part of a PodList the probe reads.
type podList struct {
	Items []struct {
		Metadata struct {
			Name      string            `json:"name"`
			Namespace string            `json:"namespace"`
			Labels    map[string]string `json:"labels"`
		} `json:"metadata"`
		Status struct {
			Phase string `json:"phase"`
		} `json:"status"`
	} `json:"items"`
}

// pemCerts returns the certificates in PEM data.
func pemCerts(b []byte) []*x509.Certificate {
	var out []*x509.Certificate
	for {
		var blk *pem.Block
		blk, b = pem.Decode(b)
		if blk == nil {
			return out
		}
		if blk.Type != "CERTIFICATE" {
			continue
		}
		if c, err := x509.ParseCertificate(blk.Bytes); err == nil {
			out = append(out, c)
		}
	}
}
